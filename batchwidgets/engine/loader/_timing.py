"""Measuring one DataLoader: warm-up apart, steady-state samples/s, the copy to the device
included, and the workers always shut down."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ...results import LoaderTrial
from .._options import Clock, ShouldStop
from .._util import default_device, has_accelerator, tensors, to_device, usable_device
from ._checks import batch_warnings, setting_warnings


def resolve_device(device: torch.device | str | None) -> torch.device:
    """None: the current accelerator when there is one (copies are then measured), else CPU.
    A device given that this process cannot use is a one-line ValueError, before any worker
    starts (not torch's assertion from the first copy)."""
    return usable_device(device) if device is not None else default_device()


def copy_batch(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    return batch if device.type == "cpu" else to_device(batch, device, non_blocking)


def synchronize(device: torch.device) -> None:
    """Wait for the copies queued on the device (a CUDA event on the current stream)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)
    elif device.type != "cpu":  # torch < 2.6 (the floor is 2.4): torch.mps, torch.xpu
        getattr(torch, device.type).synchronize()


def batch_samples(batch: Any) -> tuple[int, int]:
    """(samples, bytes): samples from the first tensor's dim 0 (0-d ones skipped; 1 when there
    is none), bytes from all tensors."""
    found = list(tensors(batch))
    n_bytes = sum(t.nelement() * t.element_size() for t in found)
    return next((t.shape[0] for t in found if t.dim() > 0), 1), n_bytes


def _settings(loader: DataLoader) -> dict[str, Any]:
    """The loader's settings, as a LoaderTrial names them (no prefetch_factor without workers)."""
    return {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
            "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
            "persistent_workers": loader.persistent_workers, "batch_size": loader.batch_size}


def shutdown(iterator: Any) -> None:
    """Stop the iterator's workers now, persistent ones too (see NOTE [ Shut workers down ])."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    try:
        if shutdown is not None:
            shutdown()
    finally:  # a worker that died can leave its siblings running past a partial shutdown
        for worker in getattr(iterator, "_workers", None) or []:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)


# NOTE [ Shut workers down ]
# A worker iterator stops its processes when garbage collected, which in a notebook can be much
# later (a traceback, a panel's closure or `_` may hold it), and persistent workers live as long
# as their DataLoader. Every measurement therefore runs on a DataLoader of its own and calls the
# iterator's _shutdown_workers() in a `finally`: the workers are joined (or terminated) and their
# queues closed before measure_loader returns or raises, so toggling settings never piles up
# processes or shared memory.


def time_loader(loader: DataLoader, device: torch.device, duration_s: float,
                 max_batches: int | None, clock: Clock,
                 should_stop: ShouldStop | None) -> LoaderTrial:
    """Measure one DataLoader; a worker's exception propagates unchanged."""
    non_blocking = loader.pin_memory and has_accelerator()
    notes = setting_warnings(loader.num_workers, loader.pin_memory)
    iterator = None
    try:
        started = clock()
        iterator = iter(loader)
        try:
            first = next(iterator)
        except StopIteration:
            raise ValueError("loader_or_dataset should yield at least one batch, but got an "
                             "empty loader; check the dataset's length, batch_size and "
                             "drop_last.") from None
        first = copy_batch(first, device, non_blocking)
        synchronize(device)
        first_batch_s = clock() - started
        notes += batch_warnings(first, loader, batch_samples(first)[1])
        del first
        n_batches = n_samples = n_bytes = epoch_ends = 0
        cancelled = restarted = False
        start = now = clock()
        while max_batches is None or n_batches < max_batches:
            if now - start >= duration_s:
                break
            if should_stop is not None and should_stop():
                cancelled = True
                break
            try:
                batch = next(iterator)
            except StopIteration:  # an epoch ended: restarting it is part of the cost
                if restarted:  # a fresh epoch with no batch in it
                    break
                epoch_ends, restarted = epoch_ends + 1, True
                iterator = iter(loader)
                continue
            restarted = False
            samples, size = batch_samples(copy_batch(batch, device, non_blocking))
            n_batches, n_samples, n_bytes = n_batches + 1, n_samples + samples, n_bytes + size
            now = clock()
        synchronize(device)
        seconds = clock() - start
    finally:
        shutdown(iterator)
    rate = 1 / seconds if seconds > 0 else 0.0
    return LoaderTrial(
        **_settings(loader), samples_per_s=n_samples * rate, batches_per_s=n_batches * rate,
        bytes_per_s=n_bytes * rate, first_batch_s=first_batch_s, n_batches=n_batches,
        n_samples=n_samples, duration_s=seconds, device=str(device), n_epoch_ends=epoch_ends,
        cancelled=cancelled, warnings=tuple(notes))


def one_line(error: BaseException) -> str:
    """``'ValueError: boom'``: DataLoader re-raises a worker's error with the worker's traceback
    in its message, whose last line is the original error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "Original Traceback" in str(error) and lines:
        return f"{lines[-1]} (in a DataLoader worker)"
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def failed_trial(loader: DataLoader, device: torch.device, error: BaseException) -> LoaderTrial:
    return LoaderTrial(
        **_settings(loader), samples_per_s=0.0, batches_per_s=0.0, bytes_per_s=0.0,
        first_batch_s=0.0, n_batches=0, n_samples=0, duration_s=0.0, device=str(device),
        error=one_line(error))
