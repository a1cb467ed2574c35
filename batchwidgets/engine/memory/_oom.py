"""Out of memory as data: which errors are a device running out (and which are the user's), a
model that cannot train on one sample, and the memory an error's traceback would keep alive.

Usage:
    >>> from batchwidgets.engine.memory import is_oom
    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda")
    True
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import traceback

import torch

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


_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def cannot_train_alone(error: BaseException | str | None) -> bool:
    """The model cannot train on one sample (BatchNorm), whatever memory there is."""
    if isinstance(error, BaseException):
        return isinstance(error, ValueError) and _ONE_SAMPLE in str(error)
    return bool(error) and _ONE_SAMPLE in error


# batchwidgets/, from batchwidgets/engine/memory/_oom.py
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))) + os.sep


# NOTE [ Memory after an error ]
# IPython keeps the last traceback (sys.last_traceback, for %debug), and with it every frame it
# passes through. batchwidgets' own frames hold the snapshot (a host copy of weights, gradients
# and optimizer state) and the batches, so their locals are cleared before the error leaves the
# probe. Frames of the user's code keep theirs: they are what %debug is for.
_GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def drop_own_frames(error: BaseException) -> None:
    """Clear the locals of batchwidgets' finished frames in ``error``'s traceback and context,
    and of those its frames were called from: a frame keeps its caller's frame (``f_back``), so
    the user's forward, kept by the user's error that a said error carries as its cause, keeps
    the step that called it, and the trial's snapshot of the user's state with it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frame, called = tb.tb_frame, False
            while frame is not None:
                # a caller that is a generator may be suspended, not done: clearing it would
                # close it (its finally run early), so only the traceback's own are cleared
                ours = frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                if ours and not (called and frame.f_code.co_flags & _GENERATOR):
                    with contextlib.suppress(RuntimeError):  # still running: it clears its own
                        frame.clear()
                frame, called = frame.f_back, True
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
