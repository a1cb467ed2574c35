"""What every engine module needs once: walking nested batches, the default device, the
world size, the first line of an error, and integer argument checks."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

# NOTE [ Walking a batch ]
# A batch is a tensor, or mappings (dict, Hugging Face's BatchEncoding, a UserDict), dataclasses,
# namedtuples, lists and tuples of them, nested. torch.utils._pytree knows dict, list, tuple and
# namedtuple only: a BatchEncoding or a dataclass would be one leaf there, and a batch moved to
# the device would keep its tensors behind. So one walker here rebuilds every container as the
# type it was (a mapping type that cannot be built from a dict comes back a dict), and leaves
# anything else as it is; ``leaves`` walks the containers DataLoader's collate and pinning walk
# into (``torch.utils.data._utils.pin_memory.pin_memory``: mappings, lists and tuples).


def map_tensors(function: Callable[[torch.Tensor], Any], batch: Any,
                other: Callable[[Any], Any] | None = None) -> Any:
    """``batch`` with ``function`` applied to every tensor in it, its containers rebuilt
    (NOTE [ Walking a batch ]); ``other`` is applied to any other leaf (default: kept)."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(function, v, other) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{
            f.name: map_tensors(function, getattr(batch, f.name), other)
            for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(function, v, other) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(function, v, other) for v in batch)
    return batch if other is None else other(batch)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """The batch's tensors (and other leaves with a ``.to``) on ``device``."""
    def move(leaf: Any) -> Any:
        return leaf.to(device, non_blocking=non_blocking) if hasattr(leaf, "to") else leaf
    return map_tensors(move, batch, move)


def leaves(batch: Any) -> Iterator[Any]:
    """What a batch holds below its mappings, lists and tuples (nested), in order."""
    if isinstance(batch, torch.Tensor):  # first: a Mapping check is an ABC's, and slower
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from leaves(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from leaves(value)
    else:
        yield batch


def tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch, in order, in every container ``map_tensors`` walks (dataclasses
    included, which ``leaves`` leaves whole as DataLoader's pinning does)."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def nbytes(batch: Any) -> int:
    """The bytes of a batch's tensors."""
    return sum(t.nelement() * t.element_size() for t in tensors(batch))


def default_device(model: Any = None) -> torch.device:
    """The one rule for ``device=None``: a model's parameters' device when it has parameters,
    else the current accelerator (CUDA, MPS, ...) when there is one, else the CPU."""
    if isinstance(model, torch.nn.Module):
        first = next(model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if not has_accelerator():
        return torch.device("cpu")
    if not hasattr(torch, "accelerator"):  # torch < 2.6 (the floor is 2.4): MPS or XPU
        return torch.device("mps" if torch.backends.mps.is_available() else "xpu")
    return torch.device(torch.accelerator.current_accelerator().type)


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


def has_accelerator() -> bool:
    """An accelerator (CUDA, MPS, XPU, ...) is present; torch.accelerator from torch 2.6 on,
    the three it would name before (pyproject's floor is torch 2.4)."""
    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return (torch.cuda.is_available() or torch.backends.mps.is_available()
            or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def world_size() -> int:
    """torch.distributed's world size, or 1 outside a process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the function that warns, to the first frame outside
    batchwidgets (the user's call), however many of the engine's stages lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("batchwidgets"):
        frame, level = frame.f_back, level + 1
    return level


def first_line(error: BaseException, *, with_type: bool = True) -> str:
    """An error in one line: ``Type: first line`` (or the first line alone, or the type's name
    for an empty message)."""
    lines = str(error).strip().splitlines()
    if not with_type:
        return lines[0] if lines else type(error).__name__
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def check_int(name: str, value: Any, minimum: int, *, optional: bool = False,
              hint: str = "") -> None:
    """One integer argument: an int (not a bool) >= ``minimum``, or None when ``optional``;
    else a ValueError in the STYLE shape, ``hint`` (``"; e.g. ..."``) after the value."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}{' or None' if optional else ''}"
        raise ValueError(f"{name} should be {expected}, but got {name}={value!r}{hint}.")


def check_number(name: str, value: Any, valid: Callable[[float], bool], expected: str,
                 hint: str = "") -> None:
    """One real-number argument (not a bool) for which ``valid(value)`` holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise ValueError(f"{name} should be {expected}, but got {name}={value!r}{hint}.")
