"""Remembered answers: find_batch's report kept in the cache directory under a key of everything
that decides the step's memory, and given back by an identical call at once (NOTE [ Remembered
answers ]); ``forget()`` clears them."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport, Remembered
from ...results._json import as_json, from_json
from .. import memory
from .._options import options_of
from .._state import RngState
from . import _cache
from ._fingerprint import batch_fingerprint, digest, fingerprint
from ._ranks import collective_device, in_job
from ._setup import ProbeSetup

# NOTE [ When to bump ENGINE_VERSION ]
# Every remembered answer's key holds ENGINE_VERSION. Change it (to the issue or branch that
# changes the answers; a new value, never an old one) in any change that may make find_batch
# answer otherwise for the same call: the search, the step it models, the meters, the budget,
# the per-op or allocator model, a target's numbers, the report's fields. Answers the old
# engine measured are then measured again instead of given back. It is not the package's
# version: a release that leaves the engine alone keeps its users' answers.
ENGINE_VERSION = "2025-issue-44-search"
KIND = "find_batch"  # the cache's folder for these entries
# Every option of FindBatchRequest declared ``keyed`` (all but those that say how to report or
# whether to remember) is in the key, as given and as resolve() made it where it made one.
RESOLVED_AS = {"budget": "budget_bytes"}  # the setup's name for an option it resolved
# The memory a probe without a budget may use (free on the device, or half of the free RAM)
# moves a little from one call to the next: an answer is given back while it moved by less
# than this share, and measured again past it.
LIMIT_TOLERANCE = 1 / 64

# NOTE [ Remembered answers ]
# find_batch(..., cache=True) looks its call up before measuring: the key is a SHA-256 of what
# decides the step's memory (NOTE [ What a fingerprint holds ] in probe/_fingerprint.py): the model
# (or the owner of step=), the batch make_batch gives at the first size tried (its shapes and
# dtypes; for a Dataset or DataLoader the worst case, as the probe builds it), the code of
# make_batch and of step= (a %%find_batch cell's too), every keyed option as given and as resolved
# (the optimizer's class and settings, amp, the device, budget, target, parallel, the loop
# modelled), the device's name and memory, the meter (a simulated device's workspaces), the
# backends' flags and PYTORCH_CUDA_ALLOC_CONF, the rank and world size inside a job, torch, Python
# and ENGINE_VERSION. The memory free on the device is kept beside the answer and compared within
# LIMIT_TOLERANCE. A hit is the report as it was measured, with ``remembered`` saying when and
# where; refresh=True measures again (and keeps the new answer), cache=False neither reads nor
# writes. A stopped probe and one where nothing fits are not kept. Inside a job every rank looks up
# its own entry, and one all_reduce keeps the answer only where every rank found one and all found
# the same size: every rank gets the same remembered answer, or all measure.


def remembered(setup: ProbeSetup,
               measure: Callable[[], BatchSizeReport]) -> BatchSizeReport:
    """``measure()``'s report, or the one an identical call kept (NOTE [ Remembered answers ])."""
    if not setup.request.cache:
        return measure()
    try:
        key, limit = _key(setup)
    except Exception as error:  # an object the fingerprints did not foresee: never fail the probe
        warnings.warn(f"find_batch could not take the key of this call ({type(error).__name__}: "
                      f"{error}), so its answer is not remembered; this is a bug in "
                      f"batchwidgets: please report it.", BatchwidgetsWarning, stacklevel=3)
        key, limit = None, None
    found = None if setup.request.refresh or key is None else _recall(key, limit)
    if setup.target is None and in_job():
        found = _agreed(found)
    if found is not None:
        return found
    report = measure()
    if key is not None and report.stop_reason != "stopped" and report.max_batch_size > 0:
        _keep(key, limit, report)
    return report


def forget() -> int:
    """Clear every answer ``find_batch`` remembers (the files under ``BATCHWIDGETS_CACHE_DIR``,
    or the user cache folder); the number of answers cleared.

    Returns
    -------
    int

    Examples
    --------
    >>> import batchwidgets as bw
    >>> bw.forget()  # doctest: +SKIP
    3
    """
    return _cache.forget(KIND)


def _key(setup: ProbeSetup) -> tuple[str | None, int | None]:
    """The call's key and the memory its probe may use; (None, None) where the key cannot be
    taken (make_batch raised: the probe then raises it, as it would without a cache)."""
    meter = memory.probe_meter(setup.device, setup.budget_bytes,
                               setup.target[0] if setup.target is not None else None)
    values: dict[str, Any] = {}
    for option in options_of(setup.request):  # as given (trace=None searches otherwise than
        if option.keyed:  # "real"), and as resolved
            values[option.name] = getattr(setup.request, option.name)
            name = RESOLVED_AS.get(option.name, option.name)
            if hasattr(setup, name):
                values[f"{option.name} as resolved"] = getattr(setup, name)
    try:
        batch = _batch(setup)
    except Exception:  # the probe meets it again, and says what it called
        return None, None
    values.update(model=setup.owner if setup.model is None else setup.model,
                  make_batch=setup.make, world_size=setup.world_size,
                  fake_first=setup.fake_first)
    found = fingerprint(values)
    found.update(batch=batch, where=_where(setup, meter), engine=ENGINE_VERSION)
    return digest(found), meter.limit_bytes


def _batch(setup: ProbeSetup) -> Any:
    """The batch at the first size tried, by shapes and dtypes (the RNGs as they were)."""
    if setup.make is None:
        return None
    rng = RngState()
    try:
        with torch.no_grad():
            batch = (setup.make(setup.start) if setup.seq_len is None
                     else setup.make(setup.start, setup.seq_len[0]))
        return [batch_fingerprint(batch), setup.batch_description]
    finally:
        rng.restore()


def _where(setup: ProbeSetup, meter: Any) -> dict[str, Any]:
    """The device, the meter, the flags that change kernels' memory, the job, the versions."""
    device: dict[str, Any] = {"device": str(setup.device), "meter": type(meter).__name__,
                              "workspaces": repr(getattr(getattr(meter, "_device", None),
                                                         "workspaces", None))}
    if setup.device.type == "cuda":
        properties = torch.cuda.get_device_properties(setup.device)
        device.update(name=properties.name, total_bytes=properties.total_memory,
                      capability=[properties.major, properties.minor],
                      flash=torch.backends.cuda.flash_sdp_enabled(),
                      efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                      cudnn=[torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                             torch.backends.cudnn.deterministic])
    job = None
    if setup.target is None and in_job():
        job = [torch.distributed.get_rank(), torch.distributed.get_world_size(),
               str(torch.distributed.get_backend())]
    return {**device, "job": job, "machine": platform.machine(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "torch": torch.__version__, "python": list(sys.version_info[:2])}


def _recall(key: str, limit: int | None) -> BatchSizeReport | None:
    """The report kept under ``key`` for about this much memory, or None (one warning for a
    file that cannot be used)."""
    path = _cache.entry_path(KIND, key)
    try:
        entry = _cache.read(KIND, key)
        if entry is None or not _near(entry.get("limit_bytes"), limit):
            return None
        report = from_json(BatchSizeReport, entry["report"])
        where = Remembered(measured_at=str(entry["measured_at"]), host=str(entry["host"]),
                           path=str(path))
    except (_cache.Unreadable, KeyError, TypeError, ValueError) as error:
        why = str(error) if isinstance(error, _cache.Unreadable) else (
            f"the file {path} holds no report of this version "
            f"({type(error).__name__}: {error})")
        warnings.warn(f"find_batch ignored a remembered answer: {why}; measuring again (the "
                      f"new answer replaces the file).", BatchwidgetsWarning, stacklevel=4)
        return None
    return dataclasses.replace(report, remembered=where)


def _near(kept: Any, limit: int | None) -> bool:
    if kept is None or limit is None:
        return kept is None and limit is None
    return isinstance(kept, int) and abs(kept - limit) <= LIMIT_TOLERANCE * limit


def _keep(key: str, limit: int | None, report: BatchSizeReport) -> None:
    entry = {"engine": ENGINE_VERSION, "limit_bytes": limit, "host": socket.gethostname(),
             "measured_at": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(
                 timespec="seconds"),
             "report": as_json(dataclasses.replace(report, remembered=None,
                                                   step_snapshot=None))}
    try:
        _cache.write(KIND, key, entry)
    except OSError as error:
        warnings.warn(f"find_batch could not remember its answer in {_cache.cache_dir()} "
                      f"({error}); it measures again next time. Set {_cache.ENV} to a folder "
                      f"you can write to, or pass cache=False.", BatchwidgetsWarning,
                      stacklevel=4)


def _agreed(found: BatchSizeReport | None) -> BatchSizeReport | None:
    """Inside a job: the remembered answer where every rank found one of the same size; else
    None on every rank, which then all measure (one all_reduce)."""
    size = float(found.max_batch_size) if found is not None else 0.0
    mine = torch.tensor([float(found is not None), size, -size], dtype=torch.float64,
                        device=collective_device())
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
    every_rank, smallest, largest = mine[0].item(), mine[1].item(), -mine[2].item()
    return found if every_rank == 1.0 and smallest == largest else None
