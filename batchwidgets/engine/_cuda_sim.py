"""A simulated CUDA device over CPU tensors, for testing the CUDA search without a GPU: every
new tensor storage goes through a model of the caching allocator, with cuBLAS- and cuDNN-like
workspaces, and ``torch.OutOfMemoryError`` is raised at the op that passes the cap.

Usage:
    >>> import torch
    >>> from batchwidgets.engine._cuda_sim import SimulatedCudaMeter
    >>> meter = SimulatedCudaMeter("cpu", budget_bytes=64 * 2**20)
    >>> with meter.measure([]) as reading:
    ...     x = torch.zeros(1000)
    >>> reading.peak_bytes, reading.peak_reserved_bytes
    (4096, 2097152)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._cuda_model import KIB, CachingAllocatorModel, Event
from ._memory import unique_tensors
from ._meters import Reading

# NOTE [ Workspaces of the simulated device ]
# A GPU step allocates memory that is no tensor, through the same caching allocator:
# - cuBLAS: one workspace per handle and stream, made at the first GEMM and kept for the life of
#   the process. PyTorch's default CUBLAS_WORKSPACE_CONFIG is ":4096:2:16:8", 2 chunks of 4 MiB
#   and 8 of 16 KiB = 8 MiB + 128 KiB (Hopper uses ":4096:8", 32 MiB: pass cublas_bytes).
# - cuDNN: each convolution (forward and both backward passes) takes a workspace for its
#   algorithm and frees it after. Which algorithm runs depends on the free memory: PyTorch
#   skips algorithms whose workspace exceeds the largest block it could get (cacheInfo: the
#   larger of the room left under the cap and the largest cached free block) and falls back to
#   one with less workspace when allocating it fails. The simulated convolution wants
#   ``conv_ratio`` times its largest input, gets ``min(wanted, conv_free_fraction *
#   largest_free)``, and runs with none when even that cannot be allocated, so the workspace
#   follows the free memory as cuDNN's choice does, and never raises by itself.
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "linear", "matmul",
                        "_addmm_activation"})
CONV_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})


@dataclass(frozen=True)
class Workspaces:
    """Sizes of the simulated workspaces (NOTE [ Workspaces of the simulated device ])."""

    cublas_bytes: int = 4096 * KIB * 2 + 16 * KIB * 8  # PyTorch's default CUBLAS_WORKSPACE_CONFIG
    conv_ratio: float = 1.0  # a convolution wants this times its largest input, in bytes
    conv_free_fraction: float = 0.5  # and gets at most this share of the largest free block


NO_WORKSPACES = Workspaces(cublas_bytes=0, conv_ratio=0.0)


class _Recorder:
    """An allocator stand-in that writes the trace: every malloc and free, with its key."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.recording = True
        self._keys = iter(range(1, 2**62))

    def malloc(self, nbytes: int) -> int:
        key = next(self._keys)
        if self.recording:
            self.events.append(("alloc", key, nbytes))
        return key

    def free(self, key: int) -> None:
        if self.recording:
            self.events.append(("free", key, 0))

    def largest_free_bytes(self) -> int:
        return 2**62


class _SimulatedDevice(TorchDispatchMode):
    """Sends every new CPU storage through ``allocator`` and frees it when the storage dies;
    storages that existed before, and views and in-place outputs of them, cost nothing new (the
    rules of ``TensorMemoryTracker``)."""

    def __init__(self, allocator: Any, workspaces: Workspaces) -> None:
        super().__init__()
        self.allocator, self.workspaces = allocator, workspaces
        self.cublas_handle: Any = None
        self.cublas_made = False
        self._storages: dict[int, tuple[weakref.ref, int, Any]] = {}
        self._busy = False
        self._pending: list[Any] = []  # frees that arrived inside a malloc (a gc pass)

    def count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        known = self._storages.get(key)
        if known is not None and known[0]() is storage:
            if known[1] == nbytes:
                return
            old = known[2]  # resized in place (out= ops): the new block comes first, as in CUDA
            del self._storages[key]
            self._storages[key] = (weakref.ref(storage, self._release(key)), nbytes,
                                   self._malloc(nbytes))
            self._free(old)
            return
        handle = self._malloc(nbytes)
        self._storages[key] = (weakref.ref(storage, self._release(key)), nbytes, handle)

    def _malloc(self, nbytes: int) -> Any:
        self._busy = True
        try:
            return self.allocator.malloc(nbytes)
        finally:
            self._busy = False
            while self._pending:
                self.allocator.free(self._pending.pop())

    def _free(self, handle: Any) -> None:
        if self._busy:
            self._pending.append(handle)
        else:
            self.allocator.free(handle)

    def _release(self, key: int) -> Callable[[weakref.ref], None]:
        def release(ref: weakref.ref) -> None:
            known = self._storages.get(key)
            if known is not None and known[0] is ref:
                del self._storages[key]
                self._free(known[2])
        return release

    def _conv_workspace(self, args: Any, kwargs: Any) -> Any:
        largest = max((t.untyped_storage().nbytes() for t in unique_tensors([args, kwargs])),
                      default=0)
        wanted = int(self.workspaces.conv_ratio * largest)
        if wanted <= 0:
            return None
        room = int(self.workspaces.conv_free_fraction * self.allocator.largest_free_bytes())
        try:
            return self._malloc(min(wanted, room))
        except torch.OutOfMemoryError:
            return None  # cuDNN falls back to an algorithm without a workspace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS and not self.cublas_made and self.workspaces.cublas_bytes > 0:
            self.cublas_handle = self._malloc(self.workspaces.cublas_bytes)
            self.cublas_made = True
        workspace = self._conv_workspace(args, kwargs) if name in CONV_OPS else None
        try:
            out = func(*args, **kwargs)
        finally:
            if workspace is not None:
                self._free(workspace)
        inputs = {id(t.untyped_storage()) for t in unique_tensors([args, kwargs])}
        for tensor in unique_tensors([out]):
            key = id(tensor.untyped_storage())
            if key in self._storages or key not in inputs:
                self.count(tensor)
        return out


def record_events(run: Callable[[], object], *,
                  workspaces: Workspaces = Workspaces()) -> list[Event]:
    """The trace of ``run()``: every storage it allocates and frees, and the workspaces the
    simulated device would take (``NO_WORKSPACES`` for tensors only), as ``("alloc", key,
    nbytes)`` and ``("free", key, 0)`` events. Storages that existed before are not in it.
    Convolution workspaces get what they want, as on a device with memory to spare."""
    recorder = _Recorder()
    with _SimulatedDevice(recorder, workspaces):
        run()
    recorder.recording = False
    return recorder.events


def preallocated_sizes(tracked: Iterable[object]) -> list[int]:
    """The storage sizes ``SimulatedCudaMeter.measure(tracked)`` allocates first, in order."""
    seen: set[int] = set()
    sizes = []
    for tensor in unique_tensors(tracked):
        storage = tensor.untyped_storage()
        if id(storage) not in seen and tensor.device.type == "cpu":
            seen.add(id(storage))
            sizes.append(storage.nbytes())
    return sizes


class SimulatedCudaMeter:
    """A CUDA device for the CPU CI: the interface of the meters in ``_meters.py`` over CPU
    tensors, with a ``CachingAllocatorModel`` capped at ``budget_bytes`` and the workspaces of
    NOTE [ Workspaces of the simulated device ]. Like the real allocator, it lives across
    ``measure`` blocks; ``empty_cache()`` releases its wholly free segments."""

    def __init__(self, device: torch.device | str, budget_bytes: int | None, *,
                 workspaces: Workspaces = Workspaces()) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"device should be 'cpu' (the simulated CUDA device runs on CPU "
                             f"tensors), but got device={device!r}.")
        self.limit_bytes = budget_bytes
        self.baseline_bytes: int | None = None
        self.allocator = CachingAllocatorModel(budget_bytes)
        self._device = _SimulatedDevice(self.allocator, workspaces)
        self._reading = Reading()

    @contextmanager
    def capped(self) -> Iterator[None]:
        yield  # the allocator model enforces the cap at every malloc

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def _fold_peaks(self) -> None:
        reading, allocator = self._reading, self.allocator
        reading.peak_bytes = max(reading.peak_bytes, allocator.peak_allocated_bytes)
        reading.peak_reserved_bytes = max(reading.peak_reserved_bytes or 0,
                                          allocator.peak_reserved_bytes)

    def end_forward_backward(self) -> None:
        reading = self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0,
                                            self.allocator.peak_reserved_bytes)
        self._fold_peaks()
        self.allocator.reset_peaks()

    @contextmanager
    def measure(self, tracked: list) -> Iterator[Reading]:
        reading = self._reading = Reading(peak_reserved_bytes=0)
        for tensor in unique_tensors(tracked):
            self._device.count(tensor)  # weights, gradients, optimizer state: alive before
        self.allocator.reset_peaks()
        if self.baseline_bytes is None:
            self.baseline_bytes = self.allocator.allocated_bytes
        try:
            with self._device:
                yield reading
        finally:
            self._fold_peaks()
