"""Under torch.distributed, one outcome for every rank: each size fits only if it fit on every
rank, and the smallest memory limit of any rank is everyone's, so all ranks take the same next
step and none waits alone in a collective; an error on one rank stops every rank, naming it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...results import Attempt
from .._grads import average_gradients
from .._util import first_line
from ..memory import is_oom

# NOTE [ One verdict per size, errors included ]
# After each size every rank joins one all_reduce (MIN) of its verdict: fits, minus its peaks
# and time (so MIN is the largest), and the lowest rank that met an error that is not out of
# memory (world_size for none). So every rank leaves a size with the same outcome and takes the
# same next step. A rank that meets such an error first writes it, in one line, to the process
# group's store (under a key of this probe and this size), then joins the verdict and re-raises
# its own error unchanged (on Python >= 3.11 with a note naming its rank); every other rank
# raises RankFailed naming that rank and its error.
# Making the batch (where uneven data fails first) has a verdict of its own, before the step's
# collectives, so an error there stops every rank at once.
# Where the erring rank left its step while the others still wait in one of the step's
# collectives (an FSDP2 all-gather, DDP's all-reduce), the verdict cannot meet them there: their
# collective fails at the group's timeout, and they read the store to name the rank that left.
# Either way every rank raises, none hangs, and the first cause is named.
_PROBES = [0]  # probes begun in this process: the same count on every rank (keys of the store)
_VERDICTS = [0]  # verdicts taken in this probe
_SHARED = "_batchwidgets_shared_with_every_rank"  # set on an error share_error has shared


class RankFailed(RuntimeError):
    """Another rank of the job met an error during ``find_batch``; every rank stopped."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def in_job() -> bool:
    """Whether a torch.distributed process group is initialised in this process (and the probe
    takes part in it: a plan for GPUs that are not here does not, see ``alone``)."""
    return (not _ALONE[0] and torch.distributed.is_available()
            and torch.distributed.is_initialized())


_ALONE = [False]  # a plan runs in this process alone: no collectives, whatever the others do


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """A target plan inside a job: it traces fake tensors in this process only, so it joins no
    collective (a plan called on one rank must not wait for the others)."""
    _ALONE[0], was = True, _ALONE[0]
    try:
        yield
    finally:
        _ALONE[0] = was


def collective_device() -> torch.device | None:
    """Where all_reduce tensors live (CUDA for NCCL, else the CPU); None when not distributed."""
    if not in_job():
        return None
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _store() -> Any:
    """The default group's key-value store (TCPStore under torchrun, FileStore for file://), or
    None where torch keeps it elsewhere: the errors are then named without their message."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # a private accessor: torch may move it
        return None


def _key(rank: int) -> str:
    """Where ``rank`` writes its error for the verdict now due (this probe's, this size's)."""
    return f"batchwidgets/find_batch/{_PROBES[0]}/{_VERDICTS[0]}/rank{rank}"


def _post(message: str) -> None:
    store = _store()
    if store is not None:
        store.set(_key(torch.distributed.get_rank()), message)


def _read(rank: int, wait: bool) -> str | None:
    store = _store()
    if store is None or (not wait and not store.check([_key(rank)])):
        return None
    return store.get(_key(rank)).decode()


def _failed(rank: int, message: str | None) -> RankFailed:
    world = torch.distributed.get_world_size()
    said = f" {message}" if message else " an error"
    return RankFailed(f"find_batch stopped on every rank: rank {rank} of {world} raised{said} "
                      f"(its traceback is on rank {rank}).", rank)


def _verdict(values: list[float], failed_rank: int) -> list[float]:
    flat = torch.tensor([*values, float(failed_rank)], dtype=torch.float64,
                        device=collective_device())
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MIN)
    return flat.tolist()


def _raise_if_failed(failed_rank: float) -> None:
    """After a verdict: RankFailed naming the lowest rank that met an error, if one did."""
    world = torch.distributed.get_world_size()
    if failed_rank < world:
        raise _failed(int(failed_rank), _read(int(failed_rank), wait=True))
    _VERDICTS[0] += 1  # the next verdict's keys


def agree(attempt: Attempt) -> Attempt:
    """Under torch.distributed, one outcome for all ranks: fits only if it fit everywhere, and
    the largest memory and time of any rank, so every rank takes the same next step. Raises
    RankFailed when another rank met an error (NOTE [ One verdict per size, errors included ])."""
    if not in_job():
        return attempt
    world = torch.distributed.get_world_size()
    if not attempt.fits:  # read only if a real OOM left the others inside the step
        _post(f"out of memory at batch size {attempt.batch_size} ({attempt.error})")
    values = [attempt.peak_memory_bytes, attempt.peak_reserved_bytes,
              attempt.activation_peak_bytes, attempt.step_time_s]
    # MIN of (fits, -x) is (fits everywhere, -max x); -1 stands for "not measured" (None).
    try:
        result = _verdict([float(attempt.fits)] + [-(v if v is not None else -1) for v in values],
                          world)
    except Exception as error:  # see NOTE [ A real CUDA OOM inside a job ] in memory/_tracker.py
        if attempt.fits:
            raise
        raise RuntimeError(
            f"find_batch: this rank ran out of memory inside the step at batch size "
            f"{attempt.batch_size} while the other ranks waited in its collectives, and the "
            f"process group cannot be recovered; restart the job and probe with a lower "
            f"budget= (or a lower max_batch_size=).") from error
    fits, peak, reserved, activation, seconds, failed_rank = result
    _raise_if_failed(failed_rank)
    unmeasured = 1.0
    return dataclasses.replace(  # the prediction fields are the same on every rank: kept
        attempt, fits=bool(fits),
        peak_memory_bytes=None if peak == unmeasured else int(-peak),
        peak_reserved_bytes=None if reserved == unmeasured else int(-reserved),
        step_time_s=None if seconds == unmeasured or not fits else -seconds,
        activation_peak_bytes=None if activation == unmeasured else int(-activation),
        error=attempt.error or ("" if fits else "out of memory on another rank"))


def _broken_collective(error: BaseException) -> bool:
    """A collective that failed (timed out, its peer gone) rather than the user's code."""
    if isinstance(error, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(error)  # gloo's and NCCL's timeouts arrive as plain RuntimeErrors
    return isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text)


def made_on_every_rank(make: Callable[[], Any], in_a_job: bool) -> Any:
    """``make()`` (a trial's batch); ``in_a_job`` (a real step in a job), then a verdict of
    every rank's: an error making one rank's batch raises on every rank before any of them
    enters the step's collectives; a device that ran out making it, out of memory on every
    rank (NOTE [ A rank that runs out alone ])."""
    if not in_a_job:
        return make()
    try:
        made = make()
    except Exception as error:
        if ran_out_alone(error):
            raise
        share_error(error)
        raise
    checkpoint()
    return made


def _shared(error: BaseException | None) -> bool:
    """Whether ``error``, or the error it says in our words (its ``__cause__``, engine/_called.py),
    was shared already: the verdict is taken once per error, or the ranks' collectives part."""
    while error is not None:
        if getattr(error, _SHARED, False):
            return True
        error = error.__cause__
    return False


def share_error(error: BaseException) -> None:
    """This rank met ``error`` (not out of memory) in a trial: tell every rank (NOTE [ One
    verdict per size, errors included ]), then return for the caller to re-raise it; raises
    RankFailed instead when ``error`` is a collective that failed because another rank left."""
    if not in_job() or isinstance(error, RankFailed) or _shared(error):
        return
    setattr(error, _SHARED, True)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if _broken_collective(error):
        for other in range(world):
            message = _read(other, wait=False) if other != rank else None
            if message is not None:
                raise _failed(other, message) from error
        return
    _post(first_line(error))
    # where the others wait in the step's collective, this fails: theirs fails and names us
    with contextlib.suppress(Exception):
        _verdict([0.0] * 5, rank)
    if hasattr(error, "add_note"):  # Python >= 3.11; the error itself propagates unchanged
        error.add_note(f"find_batch: raised on rank {rank} of {world}; every rank stopped.")


def agree_size(size: int | None, stopping: bool) -> tuple[int | None, bool]:
    """Rank 0's next size (None: the search ends) and whether any rank's ``should_stop`` said
    stop, on every rank. The verdicts are shared, but each rank fits the per-op model on its own
    trace, and a trace's frees may land a few ops apart (a collective's buffers are released when
    its work completes, on the backend's thread), so two ranks' predictions can differ by a
    sample: all follow rank 0's, and none waits alone."""
    device = collective_device()
    if device is None:
        return size, stopping
    mine = -1 if size is None or torch.distributed.get_rank() != 0 else size
    value = torch.tensor([mine, int(stopping)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    agreed, stop = value.tolist()
    return (None if agreed < 0 else int(agreed)), bool(stop)


def agree_limit(limit_bytes: int | None) -> int | None:
    """The smallest limit of any rank (a probe begins here on every rank)."""
    device = collective_device()
    if device is None:
        return limit_bytes  # every rank takes part below, with or without a limit of its own
    _PROBES[0] += 1
    _VERDICTS[0] = 0
    value = torch.tensor([float("inf") if limit_bytes is None else float(limit_bytes)],
                         dtype=torch.float64, device=device)
    try:
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    except Exception as error:
        if not _broken_collective(error):
            raise
        raise RuntimeError(
            "find_batch should be called on every rank of the job (the ranks agree on each "
            "size by collectives), but the other ranks did not join within the process "
            "group's timeout; call find_batch on every rank, with the same arguments.") from error
    return None if value.item() == float("inf") else int(value.item())


# NOTE [ A rank that runs out alone ]
# A real device runs out where the probe's meter saw room, and inside a job it may run out on one
# rank only. That rank leaves its step at the op that failed, while the others go on to the step's
# next collective (DDP's all-reduce of a bucket, FSDP2's next all-gather or reduce-scatter): the
# rank that left then joined find_batch's verdict instead, and gloo aborted the job ("Received
# data size doesn't match expected size"), or NCCL hung until its timeout. So, as Composer's
# auto micro-batching does, the ranks agree on "did anyone run out" before each collective a
# failure could strand, and at the end of each step (``checkpoint``: one all-reduce of the
# verdict's shape, so it also meets a rank that shares an error). The rank that ran out joins
# the checkpoint the others wait at (``ran_out_alone``) and leaves; every other rank learns it
# there, raises ``OutOfMemoryElsewhere`` (an out-of-memory error) before that collective, and
# leaves too. Every rank's trial is then out of memory at that size, every rank's state guard
# resets its wrappers (engine/_state.py), and the verdict after the trial meets them all.
# The checkpoints: making the batch (above); under DDP the trial's forward and backward run
# under ``no_sync()``, so the reducer starts no collective, and after backward a checkpoint, then
# the gradients are all-reduced as DDP would (in place, each once: the same memory, DDP's buckets
# counted as before, NOTE [ What a wrapper holds outside every op ] in _trials.py; the user's
# comm hook is not run); under FSDP2 before each unit's all-gather and reduce-scatter (its
# ``FSDPParamGroup.unshard`` and ``post_backward``, private, wrapped on the instance for the
# trial only); after every step. A step of the user's own (``step=``, a cell) gets the end of
# step's: one that runs DDP's reducer itself cannot be met inside it. A device that runs out
# inside a collective's own buffer, on one rank, is not met either (it left before the
# collective the others entered). With one rank there is no one to wait: nothing is added.
_DECLARED = "_batchwidgets_told_every_rank"


class OutOfMemoryElsewhere(torch.OutOfMemoryError):
    """Another rank's device ran out of memory inside the step (NOTE [ A rank that runs out
    alone ]): this rank leaves the step there too."""


def _with_others() -> bool:
    return in_job() and torch.distributed.get_world_size() > 1


def checkpoint(ran_out: bool = False) -> None:
    """Every rank's "did anyone run out": raises ``OutOfMemoryElsewhere`` when another rank's
    device did, RankFailed when another rank met an error (NOTE [ A rank that runs out
    alone ])."""
    world = torch.distributed.get_world_size()
    result = _verdict([-1.0 if ran_out else 0.0, 0.0, 0.0, 0.0, 0.0], world)
    _raise_if_failed(result[-1])
    if result[0] < 0 and not ran_out:
        raise OutOfMemoryElsewhere("out of memory on another rank (its device ran out inside "
                                   "the step; every rank left it there)")


def ran_out_alone(error: BaseException) -> bool:
    """Whether ``error`` is this rank's device running out inside a step of a job; if so, every
    other rank is told at the checkpoint it waits at (once per error)."""
    if (not _with_others() or isinstance(error, OutOfMemoryElsewhere)
            or getattr(error, _DECLARED, False) or not is_oom(error)):
        return False
    setattr(error, _DECLARED, True)
    checkpoint(ran_out=True)
    return True


def end_of_step() -> None:
    """A step ended on this rank: the checkpoint after it (NOTE [ A rank that runs out alone ])."""
    if _with_others():
        checkpoint()


def _ddp(model: Any) -> Any:
    ddp = torch.nn.parallel.DistributedDataParallel
    return model if isinstance(model, ddp) and _with_others() else None


@contextlib.contextmanager
def no_reducer(model: Any) -> Iterator[None]:
    """The trial's forward and backward under DDP's ``no_sync()`` in a job of several ranks
    (NOTE [ A rank that runs out alone ]); else as they are."""
    ddp = _ddp(model)
    with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
        yield


def after_backward(model: Any) -> None:
    """Backward ended: the checkpoint, then DDP's gradient all-reduce, in place (NOTE [ A rank
    that runs out alone ])."""
    ddp = _ddp(model)
    if ddp is None:
        return
    checkpoint()
    average_gradients(list(ddp.parameters()), getattr(ddp, "process_group", None))


def _checkpointed(method: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        checkpoint()
        return method(*args, **kwargs)
    return run


_FSDP_COLLECTIVES = ("unshard", "post_backward")


@contextlib.contextmanager
def checkpoints_in(model: Any) -> Iterator[None]:
    """For a trial: FSDP2's units in ``model`` agree before each all-gather and reduce-scatter
    in a job of several ranks (NOTE [ A rank that runs out alone ])."""
    groups = []
    if isinstance(model, torch.nn.Module) and _with_others():
        for module in model.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            groups += list(getattr(state, "_fsdp_param_groups", None) or ())
    for group in groups:
        for name in _FSDP_COLLECTIVES:
            setattr(group, name, _checkpointed(getattr(group, name)))
    try:
        yield
    finally:
        for group in groups:
            for name in _FSDP_COLLECTIVES:
                group.__dict__.pop(name, None)
