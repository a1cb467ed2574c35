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

import contextlib
import gc
import math
import os
import re
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# NOTE [ Size units ]
# "512MB" is decimal (10**6) and "512MiB" binary (2**20), as the SI and IEC prefixes say. A single
# letter ("512M", "1G", "1.5g") is binary, the way Docker (--memory 512m), Slurm (--mem=16G),
# ``ulimit`` and PyTorch's own out-of-memory messages write sizes. Case does not matter.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS_HELP = ("units: B; KB, MB, GB, TB = 1000**n; KiB, MiB, GiB, TiB = 1024**n; K, M, G, T "
               "= 1024**n as Docker and Slurm write them")


def parse_bytes(value: int | float | str | None, name: str = "budget") -> int | None:
    """A size in bytes from an int, a float or a string (see NOTE [ Size units ]).

    ``"512MB"`` -> 512_000_000 and ``"1.5GB"`` -> 1_500_000_000 (decimal); ``"16GiB"`` ->
    17_179_869_184 (binary); ``"512M"`` -> 536_870_912 and ``"1.5g"`` -> 1_610_612_736 (one
    letter: binary, as Docker and Slurm write it); ``"1e9"`` -> 1_000_000_000; ``2**20`` ->
    1_048_576. Raises ValueError for what is not a positive, finite size, TypeError for
    what is not a number or a string.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} should be bytes as an int or a string such as '512MB' or "
                        f"'16GiB', but got {name}={value!r}.")
    given = value
    if isinstance(value, str):
        match = _BUDGET_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} should be a size such as '512MB', '1.5GB', '16GiB' or "
                             f"'512M' ({_UNITS_HELP}), but got {name}={value!r}.")
        value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"{name} should be a finite number of bytes, but got {name}={given!r}; "
                         f"leave it out (None) for no budget.")
    if value < 1:
        raise ValueError(f"{name} should be a positive number of bytes, but got {name}={given!r}.")
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


# Which of those a device can raise: a message from another backend is the user's own error
# (a user's RuntimeError("CUDA out of memory") on a CPU run is not our boundary).
_OOM_MESSAGES_BY_DEVICE = {
    "cuda": _OOM_MESSAGES[:6],  # ROCm builds report their devices as "cuda" too
    "xpu": ("XPU out of memory",),
    "mps": ("MPS backend out of memory",),
    "cpu": _OOM_MESSAGES[8:],
}


def is_oom(error: BaseException, device: torch.device | str | None = None) -> bool:
    """True for an out-of-memory error that ``device`` can raise (any backend when None).

    ``torch.OutOfMemoryError`` (our budget's error is one) and ``MemoryError`` count on every
    device; message text only counts from the device's own backend
    (see NOTE [ Out-of-memory messages ]).
    """
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    fragments = (_OOM_MESSAGES if device is None
                 else _OOM_MESSAGES_BY_DEVICE.get(torch.device(device).type, ()))
    message = str(error)
    return any(fragment in message for fragment in fragments)


def memory_stayed_flat(attempts: Iterable) -> bool:
    """True when the step's peak memory grew by less than one byte per extra sample between the
    smallest and the largest size that fit: the batch size never reached the model (a
    make_batch that ignores its argument, a step that allocates nothing)."""
    fitted = [a for a in attempts if a.fits]
    if len(fitted) < 2:
        return False
    small = min(fitted, key=lambda a: a.batch_size)
    large = max(fitted, key=lambda a: a.batch_size)
    grew = (large.peak_memory_bytes or 0) - (small.peak_memory_bytes or 0)
    return grew < large.batch_size - small.batch_size


# BatchNorm in train mode raises this at batch size 1 (torch.nn.functional._verify_batch_size)
_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def cannot_train_alone(error: BaseException | str | None) -> bool:
    """The model cannot train on one sample (BatchNorm), whatever memory there is."""
    if isinstance(error, BaseException):
        return isinstance(error, ValueError) and _ONE_SAMPLE in str(error)
    return bool(error) and _ONE_SAMPLE in error


def usable_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device, or a one-line ValueError if this process cannot train on it."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    usable = resolved is not None and resolved.type in ("cpu", "cuda", "mps", "xpu")
    if usable and resolved.type == "cuda":
        usable = torch.cuda.is_available() and (resolved.index or 0) < torch.cuda.device_count()
    elif usable and resolved.type == "mps":
        usable = torch.backends.mps.is_available()
    elif usable and resolved.type == "xpu":
        usable = hasattr(torch, "xpu") and torch.xpu.is_available()
    if not usable:
        here = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
        if torch.backends.mps.is_available():
            here.append("mps")
        raise ValueError(f"device should be a device this process can train on, but got "
                         f"device={device!r}; available here: {', '.join(here)}.")
    return resolved


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


# NOTE [ Memory after an error ]
# IPython keeps the last traceback (sys.last_traceback, for %debug), and with it every frame it
# passes through. batchwidgets' own frames hold the snapshot (a host copy of weights, gradients
# and optimizer state) and the batches, so their locals are cleared before the error leaves the
# probe. Frames of the user's code keep theirs: they are what %debug is for.
def drop_own_frames(error: BaseException) -> None:
    """Clear the locals of batchwidgets' finished frames in ``error``'s traceback and context."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                with contextlib.suppress(RuntimeError):  # still running: it clears its own
                    frame.clear()
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


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
    return _meminfo("MemAvailable")


def _meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    """A ``key: N kB`` line of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_number(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_dirs() -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup and its parents."""
    found = []
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.strip().split(":", 2) for line in lines]
    except OSError:
        return found
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":  # cgroup v2 (unified)
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                root = "/sys/fs/cgroup/unified"
        elif "memory" in controllers.split(","):  # cgroup v1
            root, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes",
                                                    "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # a container sees its own cgroup as the root
            found.append((os.path.join(root, *parts[:depth]), *files))
    return found


def cgroup_available_bytes() -> int | None:
    """What this process's memory cgroup (v1 or v2, the tightest level) still lets it use."""
    room = None
    for directory, limit_file, usage_file in _cgroup_dirs():
        limit = _read_number(os.path.join(directory, limit_file))
        if limit is None or limit >= 2**60:  # v1 writes "no limit" as a huge number
            continue
        usage = _read_number(os.path.join(directory, usage_file)) or 0
        room = max(0, limit - usage) if room is None else min(room, max(0, limit - usage))
    return room


def rlimit_available_bytes() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) and ``ulimit -d`` (RLIMIT_DATA) still let this process map."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    room = None
    for limit_name, used_key in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, limit_name))
        if soft == resource.RLIM_INFINITY:
            continue
        used = _meminfo(used_key, "/proc/self/status") or 0
        left = max(0, soft - used)
        room = left if room is None else min(room, left)
    return room


def available_memory_bytes() -> int | None:
    """The host memory this process can still take: the smallest of MemAvailable, its cgroup's
    room (a container's or a job's limit) and its rlimits; None where none can be read."""
    known = [value for value in (available_ram_bytes(), cgroup_available_bytes(),
                                 rlimit_available_bytes()) if value is not None]
    return min(known) if known else None
