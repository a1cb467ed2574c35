"""What can go wrong around DataLoader workers, found before or while measuring: arguments out of
range, a dataset the workers cannot unpickle (spawn/forkserver), and the warnings with numbers
(/dev/shm, CPUs, pinning)."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import shutil
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._util import check_int, first_line, has_accelerator, leaves

SHM_PATH = "/dev/shm"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a container)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_NOT_PINNED = (torch.Tensor, str, bytes, int, float, bool, type(None))  # pinned, or nothing to pin


def _unpinnable(batch: Any) -> Iterator[str]:
    """Type names in a batch that DataLoader's pinning passes over unchanged: no
    ``pin_memory()`` method, not a tensor, mapping or sequence."""
    return (type(leaf).__qualname__ for leaf in leaves(batch)
            if not isinstance(leaf, _NOT_PINNED) and not hasattr(leaf, "pin_memory"))


def start_method(loader: DataLoader) -> str:
    """How the loader starts its workers: its ``multiprocessing_context`` or the default.

    Reads the default without fixing it (``multiprocessing.get_start_method()`` would), from
    ``get_all_start_methods()``, whose first element is the platform's default.
    """
    context = loader.multiprocessing_context
    if context is not None:
        return context.get_start_method()
    return (multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0])


def _main_is_interactive() -> bool:
    """Classes defined in a notebook or REPL live in a ``__main__`` that spawned workers cannot
    import (a script's ``__main__`` they re-import from its file)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is None or "ipykernel" in main_file


# Argument checks of measure_loader and tune_loader: one rule a line, in the STYLE message shape.


def check_measure_arguments(num_workers: Any, prefetch_factor: Any, batch_size: Any,
                            duration_s: Any, max_batches: Any) -> None:
    check_int("num_workers", num_workers, 0)
    check_int("prefetch_factor", prefetch_factor, 1, optional=True,
              hint="; DataLoader's default is 2")
    check_int("batch_size", batch_size, 1, optional=True)
    if not isinstance(duration_s, (int, float)) or duration_s <= 0:
        raise ValueError(f"duration_s should be a positive number of seconds, but got "
                         f"duration_s={duration_s!r}; 1.0 is a good start.")
    check_int("max_batches", max_batches, 1, optional=True)


def check_tune_arguments(max_workers: Any, duration_s: Any, threshold: Any,
                         batch_size: Any) -> None:
    check_int("max_workers", max_workers, 0, optional=True,
              hint=f"; None means the {usable_cpus()} usable CPUs")
    if not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold should be in [0, 1), but got threshold={threshold!r}; "
                         f"0.05 stops when a step gains under 5%.")
    check_measure_arguments(0, None, batch_size, duration_s, None)


class _Discard(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(data)


class _Probe(pickle.Pickler):
    """Pickles as a spawned worker receives the object, but writes nothing and skips tensor and
    array data (it travels apart and is never what fails), noting classes and functions defined
    in an interactive ``__main__``."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.notebook_names: list[str] = []
        self.interactive = _main_is_interactive()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) \
                or hasattr(obj, "__array_interface__"):
            return 0
        if (self.interactive and isinstance(obj, (type, types.FunctionType))
                and getattr(obj, "__module__", None) == "__main__"):
            self.notebook_names.append(obj.__qualname__)
            return 0
        return None


def _pickling_problem(obj: Any) -> str | None:
    probe = _Probe()
    try:
        probe.dump(obj)
    except Exception as error:  # PicklingError, TypeError, AttributeError: all mean the same
        return first_line(error, with_type=False)
    if probe.notebook_names:
        return f"{probe.notebook_names[0]} is defined in the notebook (__main__)"
    return None


def check_workers_can_unpickle(loader: DataLoader) -> None:
    """Raise a one-line TypeError naming the fix when workers started by spawn or forkserver
    could not unpickle the dataset, collate_fn or worker_init_fn (instead of a pickling
    traceback from a worker)."""
    if loader.num_workers == 0:
        return
    method = start_method(loader)
    if method == "fork":
        return
    fork = (", or multiprocessing_context='fork' (Linux only)"
            if "fork" in multiprocessing.get_all_start_methods() else "")
    for name, obj in (("dataset", loader.dataset), ("collate_fn", loader.collate_fn),
                      ("worker_init_fn", loader.worker_init_fn)):
        problem = _pickling_problem(obj) if obj is not None else None
        if problem is not None:
            what = "Dataset class" if name == "dataset" else name
            raise TypeError(
                f"{name} should be picklable for DataLoader workers started by {method!r}, but "
                f"got {name}=<{type(obj).__qualname__}> ({problem}); move the {what} into a .py "
                f"module and import it, or use num_workers=0{fork}.")


def shm_warning(bytes_per_batch: float, num_workers: int, prefetch_factor: int | None,
                free_bytes: int | None) -> str | None:
    """In-flight batches (num_workers x prefetch_factor of them) sit in /dev/shm."""
    if not num_workers or free_bytes is None:
        return None
    in_flight = bytes_per_batch * num_workers * (prefetch_factor or 2)
    if in_flight <= free_bytes:
        return None
    return (f"/dev/shm has {free_bytes / 2**20:.0f} MiB free, but {num_workers} workers x "
            f"prefetch_factor {prefetch_factor} x {bytes_per_batch / 2**20:.1f} MiB per batch "
            f"keep about {in_flight / 2**20:.0f} MiB in flight there; workers may die with a bus "
            f"error: lower num_workers or prefetch_factor, or enlarge /dev/shm "
            f"(docker run --shm-size=...).")


def shm_free_bytes() -> int | None:
    try:
        return shutil.disk_usage(SHM_PATH).free
    except OSError:  # no /dev/shm (macOS, Windows): workers use other shared memory
        return None


def setting_warnings(num_workers: int, pin_memory: bool) -> list[str]:
    """Warnings known from the settings alone."""
    notes = []
    cpus = usable_cpus()
    if num_workers > cpus:
        notes.append(f"num_workers={num_workers} is more than the {cpus} CPUs this process may "
                     f"use; the workers and the training loop then compete for them: use at "
                     f"most {cpus}.")
    if pin_memory and not has_accelerator():
        notes.append("pin_memory=True does nothing here: torch finds no accelerator "
                     "(torch.accelerator.is_available() is False), so nothing is copied from "
                     "pinned memory: use pin_memory=False.")
    return notes


def batch_warnings(batch: Any, loader: DataLoader, bytes_per_batch: float) -> list[str]:
    """Warnings known from the first batch."""
    notes = []
    shm = shm_warning(bytes_per_batch, loader.num_workers, loader.prefetch_factor,
                      shm_free_bytes())
    if shm is not None:
        notes.append(shm)
    if loader.pin_memory:
        names = sorted(set(_unpinnable(batch)))
        if names:
            notes.append(f"pin_memory=True leaves batches of type {', '.join(names)} unpinned "
                         f"(no pin_memory() method), so their copies to the device are not "
                         f"asynchronous: give the class a pin_memory() method that returns a "
                         f"pinned copy, or yield tensors, tuples or dicts of tensors.")
    return notes
