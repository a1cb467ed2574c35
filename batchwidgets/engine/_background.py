"""Probing off the main thread without disturbing it: private random generators for the
probing thread, a copy of the model and optimizer to probe, or the model held meanwhile."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# NOTE [ A probe off the main thread keeps its hands off the global RNG ]
# torch has one default generator per device for the whole process. A probe on a background
# thread (ProbePanel's button) draws from it (make_batch, Dropout) and, restoring it at the end,
# would rewind whatever the main thread drew meanwhile: ``torch.manual_seed(0); torch.randn(3)``
# in another cell would change. Dispatch modes are per thread, so ``private_rng()`` pushes one
# that hands every random op of this thread a private generator, and RngState restores none of
# the global generators (torch, Python, numpy) on that thread: a make_batch drawing from Python's
# or numpy's global generator still moves them, which no mode can redirect. native_dropout has
# no generator argument: it is rebuilt from bernoulli_, as PyTorch's own decomposition does.
_PRIVATE = threading.local()


class _PrivateGenerators(TorchDispatchMode):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten.native_dropout.default:
            tensor, p, train = ([*list(args), kwargs.get("train")])[:3]
            if train is False or p == 0:
                return tensor.clone(), torch.ones_like(tensor, dtype=torch.bool)
            mask = torch.empty_like(tensor).bernoulli_(1 - p, generator=self.generator(
                tensor.device)).bool()
            return tensor * mask / (1 - p), mask
        if "generator" not in (a.name for a in func._schema.arguments):
            # randn.default, randint.low...: their twin overload takes a generator
            name = func._overloadname
            twin = "generator" if name == "default" else f"{name}_generator"
            if not hasattr(func.overloadpacket, twin):
                return func(*args, **kwargs)
            func = getattr(func.overloadpacket, twin)
        if kwargs.get("generator") is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                          torch.device(kwargs.get("device") or "cpu"))
            kwargs["generator"] = self.generator(device)
        return func(*args, **kwargs)


def private_generators(modes: Any) -> list[TorchDispatchMode]:
    """The private RNG's mode among ``modes`` (what ``_disable_current_modes`` set aside)."""
    return [mode for mode in modes if isinstance(mode, _PrivateGenerators)]


def rng_is_private() -> bool:
    """True on a thread inside ``private_rng()``: probes leave the global generators alone."""
    return getattr(_PRIVATE, "active", False)


@contextmanager
def private_rng(seed: int = 0) -> Iterator[None]:
    """This thread's random ops draw from private generators, and probes leave the global ones
    alone (see NOTE [ A probe off the main thread keeps its hands off the global RNG ])."""
    previous = getattr(_PRIVATE, "active", False)
    _PRIVATE.active = True
    try:
        with _PrivateGenerators(seed):
            yield
    finally:
        _PRIVATE.active = previous


# NOTE [ Probing in the background ]
# While a panel probes off the main thread, the notebook stays usable: other cells may evaluate
# or train the model. So the background probe works on a copy of the model and its optimizer
# (and scheduler, scaler), made together so the copy's optimizer trains the copy's parameters,
# whenever the copy fits in the room left; the user's objects are then never touched. A copy
# cannot be made where it would not fit, and on CUDA it would distort the answer (the original
# stays resident, so the copy would find a smaller batch size); there the model is *held*:
# calling it or stepping its optimizer from another thread raises ModelHeldError, and a second
# probe of the same model waits its turn with an error.


class ModelHeldError(RuntimeError):
    """The model is being probed on another thread; using it now would see half-trained weights."""


_HELD: dict[int, str] = {}  # id(model) -> who holds it
_HELD_LOCK = threading.Lock()


def state_bytes(model: torch.nn.Module, optimizer: Any = None) -> int:
    """Bytes of the weights, buffers, gradients and optimizer state: what a copy costs."""
    tensors = [*model.parameters(), *model.buffers(),
               *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def copied(*objects: Any) -> tuple[Any, ...]:
    """Deep copies made together (one memo): the copied optimizer trains the copied model."""
    copies = copy.deepcopy(objects)
    for obj in copies:
        # An LR scheduler wraps optimizer.step in a closure over the *original* optimizer; on
        # the copy, that would step the user's optimizer. The class's step is the right one.
        if isinstance(obj, torch.optim.Optimizer):
            vars(obj).pop("step", None)
    return copies


def check_free(model: torch.nn.Module) -> None:
    """ModelHeldError where another probe holds ``model``: its registries may hold that probe's
    fake twins, so nothing of the model (its device, a copy of it) may be read until it ends."""
    with _HELD_LOCK:
        _refuse_held(model)


def _refuse_held(model: torch.nn.Module) -> None:
    if id(model) in _HELD:
        raise ModelHeldError(f"model should be free to probe, but it is held by "
                             f"{_HELD[id(model)]}; wait for it (panel.wait()) first.")


@contextmanager
def held(model: torch.nn.Module, optimizer: Any = None, holder: str = "a probe") -> Iterator[None]:
    """Only this thread may call ``model`` or step ``optimizer`` until the block ends
    (see NOTE [ Probing in the background ])."""
    with _HELD_LOCK:
        _refuse_held(model)
        _HELD[id(model)] = holder
    owner = threading.get_ident()

    def refuse(*_: Any) -> None:
        if threading.get_ident() != owner:
            raise ModelHeldError(f"the model is being probed by {holder} in the background: "
                                 f"its weights and modes change until it ends; wait for it "
                                 f"(panel.wait()) before using the model.")

    handles = [model.register_forward_pre_hook(refuse)]
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(refuse))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        with _HELD_LOCK:
            _HELD.pop(id(model), None)
