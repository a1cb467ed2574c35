"""Out-of-memory detection, budget parsing, and the tensor-memory tracker that emulates a device.

Usage:
    >>> import torch
    >>> from batchwidgets.engine._memory import track_tensor_memory, is_oom
    >>> with track_tensor_memory(budget_bytes=1_000_000) as tracker:
    ...     x = torch.zeros(1000)
    >>> tracker.peak_bytes
    4000
"""

from __future__ import annotations

import gc
import re
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str | None, name: str = "budget") -> int | None:
    """``"512MB"`` -> 512_000_000, ``"16GiB"`` -> 17_179_869_184, ``2**20`` -> 1_048_576."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} should be bytes as an int or a string such as '512MB' or "
                        f"'16GiB', but got {name}={value!r}.")
    if isinstance(value, str):
        match = _BUDGET_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} should be a size such as '512MB', '1.5GB' or '16GiB' "
                             f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), but got "
                             f"{name}={value!r}.")
        value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{name} should be a positive number of bytes, but got {name}={value!r}.")
    return int(value)


class BudgetExceededError(torch.OutOfMemoryError):
    """The tensors of a step passed the memory budget: out of memory on an emulated device.

    It subclasses ``torch.OutOfMemoryError`` so code that handles real out-of-memory errors
    handles this one too.
    """


# NOTE [ Out-of-memory messages ]
# The type is checked first (torch.OutOfMemoryError covers CUDA, and our budget). Older PyTorch
# builds and other backends raise a plain RuntimeError, so these fragments are a fallback, each
# with the backend that prints it.
_OOM_MESSAGES = (
    "CUDA out of memory",  # CUDA caching allocator (before torch.OutOfMemoryError existed)
    "CUDA error: out of memory",  # raw cudaMalloc failure outside the caching allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle or workspace allocation
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN, oversized batch (as Lightning, Accelerate)
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "HIP out of memory",  # ROCm
    "XPU out of memory",  # Intel GPUs
    "MPS backend out of memory",  # Apple Metal
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator on Linux and macOS
    "DefaultCPUAllocator: not enough memory",  # CPU allocator on Windows
)


def is_oom(error: BaseException) -> bool:
    """True for an out-of-memory error of any backend (see NOTE [ Out-of-memory messages ])."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    return any(fragment in message for fragment in _OOM_MESSAGES)


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def forget(error: BaseException) -> None:
    """Drop the frames an error holds, so the activations they reference can be freed."""
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None


def free_memory(device: torch.device, collect: bool = True) -> None:
    """Collect garbage (if ``collect``) and hand cached blocks back, so the next step starts from
    the baseline."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def unique_tensors(tensors: Iterable[object]) -> Iterator[torch.Tensor]:
    """The strided tensors holding the data in a nested structure: a sparse COO tensor (as
    ``nn.Embedding(sparse=True)`` makes for gradients) stands for its indices and values."""
    for item in tree_flatten(list(tensors))[0]:
        if not isinstance(item, torch.Tensor):
            continue
        if item.layout == torch.strided:
            yield item
        elif item.layout == torch.sparse_coo:
            yield from (item._indices(), item._values())


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive on one device, op by op.

    Every operator's outputs pass through ``__torch_dispatch__`` (forward, backward and optimizer
    ops alike), so a new storage is counted when it is created and released by a weak-reference
    callback when it is freed. Going over ``budget_bytes`` raises ``BudgetExceededError`` at the
    operation that crosses it, so the process never exhausts real RAM.
    """

    def __init__(self, device: torch.device | str = "cpu", budget_bytes: int | None = None,
                 baseline: Iterable[object] = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        for tensor in unique_tensors(baseline):
            self._count(tensor)
        self.baseline_bytes = self.live_bytes

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        nbytes = storage.nbytes()
        if known is not None and known[0]() is storage:
            if known[1] == nbytes:
                return
            self.live_bytes -= known[1]  # resized in place (out= ops)
        self._storages[key] = (weakref.ref(storage, self._release(key)), nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int):
        def release(ref: weakref.ref) -> None:
            known = self._storages.get(key)
            if known is not None and known[0] is ref:
                del self._storages[key]
                self.live_bytes -= known[1]
        return release

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        before = self.live_bytes
        # An output sharing an input's storage (a view, an in-place op) allocates nothing new. A
        # storage made before the block, such as a dataset tensor that make_batch slices, is not
        # the step's memory: counting it would charge the whole dataset to the first slice.
        inputs = {id(t.untyped_storage()) for t in unique_tensors([args, kwargs])}
        for tensor in unique_tensors([out]):
            key = id(tensor.untyped_storage())
            if key in self._storages or key not in inputs:
                self._count(tensor)
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            raise BudgetExceededError(
                f"{self.device.type.upper()} out of memory (batchwidgets budget): the step held "
                f"{self.live_bytes} bytes of tensors after {func}, over the budget of "
                f"{self.budget_bytes} bytes (tried to allocate {self.live_bytes - before} bytes).")
        return out


@contextmanager
def track_tensor_memory(budget_bytes: int | None = None, device: torch.device | str = "cpu",
                        baseline: Iterable[object] = ()) -> Iterator[TensorMemoryTracker]:
    """Track (and cap at ``budget_bytes``) the tensor memory of the code inside the block.

    ``baseline`` lists tensors that already exist and count against the budget (weights,
    gradients, optimizer state); tensors created inside the block are counted as they appear.
    """
    with TensorMemoryTracker(device, budget_bytes, baseline) as tracker:
        yield tracker


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
