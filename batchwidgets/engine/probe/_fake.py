"""Fake trials: the training step run on fake tensors (``FakeTensorMode``: shapes, dtypes and
devices, no storage), so a plan for a GPU that is not here computes nothing and allocates
nothing, and works on a model built on the meta device. The user's model is only read: its
parameters and buffers are swapped for fake ones while a step runs (``FakeWorld.swapped``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only

from .._background import private_generators
from .._batches import as_keywords
from .._unsharded import optimizer_twin
from ._fakes import (
    fake_like,
    fake_state,
    host_scalars,
    in_fake_mode,
    quiet_meta_errors,
    where_it_failed,
)
from ._optimizer_shapes import StandIn, StateRule
from ._trials import ModelStep, model_step

# NOTE [ Fake trials ]
# A target plan needs the step's op sequence and every storage's size at two small batch sizes,
# not the numbers in them. Under FakeTensorMode every op runs its meta kernel: shapes, dtypes and
# strides come out, no data, and a Llama-3-8B-shaped step takes seconds and no memory. The meters
# above it (the simulated device, the per-op tracer) see the same ops and storages as on real
# tensors, and count their bytes from the storages' sizes. The fakes live on the CPU device, as
# the simulated CUDA device's storages do: fake CUDA tensors through autograd or SDPA abort a
# CPU-only build of PyTorch. The model's parameters and buffers get fake twins (the same shapes,
# dtypes, strides and requires_grad: a frozen weight gets no gradient and no optimizer state) and
# the optimizer a shallow copy over them, its state faked from the real state's shapes (one
# fake tensors cannot step: NOTE [ Optimizer state by shape ] in _optimizer_shapes.py);
# the step runs the user's module with the twins swapped in. An op fake tensors cannot run (a value
# read back to Python: .item(), nonzero, a branch on a tensor) raises FakeTraceError, naming the
# op and the module; a real model is then traced by real steps, a meta model cannot be.


# NOTE [ Twins for the whole step ]
# The twins stand in the model's own registries (each module's _parameters and _buffers) from
# the batch to the optimizer step, not only through the forward call as functional_call does:
# activation checkpointing runs the forward again inside backward, and that forward must find
# the twins too (with functional_call it found the real weights: a meta model raised a device
# mismatch, a real one was planned 9% over its real answer). The originals go back in a
# finally, and the probe's ModelState puts back each registry as it was in any case.
class FakeWorld:
    """Fake twins of a model's parameters and buffers and of its optimizer, the state each fake
    trial starts from (``restore()`` puts it back, as ``TrainingState`` does for real trials)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 mode: FakeTensorMode, rule: StateRule | None = None) -> None:
        """``rule``: the optimizer's state learned by shape, when it cannot be faked as it is
        (NOTE [ Optimizer state by shape ] in _optimizer_shapes.py)."""
        self.model, self.mode = model, mode
        scalars = host_scalars(optimizer)  # read before the fake mode: they are real
        with mode:
            self.params = {name: torch.nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
                           for name, p in model.named_parameters()}
            self.buffers = {name: fake_like(b) for name, b in model.named_buffers()}
            twins = {id(p): self.params[name] for name, p in model.named_parameters()}
            self.optimizer = (optimizer_twin(optimizer, twins,
                                             lambda value: fake_state(value, scalars))
                              if rule is None
                              else StandIn(optimizer, twins, rule))
        # gradients the user holds: a real trial accumulates into them (and frees them), so
        # each fake trial starts with fakes of their shapes, made anew: a fake kept here to
        # start the next trial with would outlive the trial's zero_grad, and a second step
        # would start with them still alive
        self._grads = {name: (p.grad.shape, p.grad.stride(), p.grad.dtype)
                       for name, p in model.named_parameters() if p.grad is not None}
        self._start = {param: dict(state) for param, state in self.optimizer.state.items()}
        self.restore()

    def tensors(self) -> list:
        """What the step holds before it starts: weights, buffers, gradients, optimizer state."""
        params = list(self.params.values())
        return [*params, *self.buffers.values(), *[p.grad for p in params if p.grad is not None],
                *[dict(state) for state in self.optimizer.state.values()]]

    def marked(self) -> list[torch.Tensor]:
        """The parameters and buffers, for the memory split's marks."""
        return [*self.params.values(), *self.buffers.values()]

    def restore(self) -> None:
        with self.mode:
            for name, param in self.params.items():
                grad = self._grads.get(name)
                param.grad = None if grad is None else torch.empty_strided(
                    grad[0], grad[1], dtype=grad[2], device="cpu")
        self.optimizer.state.clear()
        self.optimizer.state.update({p: dict(state) for p, state in self._start.items()})

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The model's parameters and buffers are their twins for a whole step, its backward
        too (NOTE [ Twins for the whole step ]); each occurrence of a tied one."""
        twins = {id(t): self.params[name] for name, t in self.model.named_parameters()}
        twins.update({id(t): self.buffers[name] for name, t in self.model.named_buffers()})
        saved = []
        try:
            for module in self.model.modules():
                for registry in (module._parameters, module._buffers):
                    for name, value in registry.items():
                        if value is not None and id(value) in twins:
                            saved.append((registry, name, value))
                            registry[name] = twins[id(value)]
            yield
        finally:
            for registry, name, value in reversed(saved):
                registry[name] = value

    def active(self) -> contextlib.AbstractContextManager:
        return in_fake_mode(self.mode)


class FakeStep:
    """The model form's training step on a world's twins (under its fake mode, which the
    Trainer enters), as ``ModelStep`` is for real ones: ``release()``, ``loss_from``."""

    def __init__(self, world: FakeWorld, step: ModelStep, meter: Any) -> None:
        self.world, self.step, self.meter = world, step, meter

    def __call__(self, batch_size: int) -> None:
        with quiet_meta_errors(), where_it_failed(self.meter), self.world.swapped():
            self.step(batch_size)

    def release(self) -> None:
        self.step.release()

    @property
    def loss_from(self) -> str:
        return self.step.loss_from


def fake_step(world: FakeWorld, make: Callable[[int], Any], loss_fn: Callable | None,
              amp: str | None, meter: Any, *, keep_output: bool) -> FakeStep:
    """The model form's step on ``world``'s twins. Without a GradScaler: scaling changes no
    storage's size, and its inf check reads a value back."""
    return FakeStep(world, model_step(world.model, _made_real(make), loss_fn, world.optimizer,
                                      torch.device("cpu"), amp, None, meter,
                                      keep_output=keep_output), meter)


# NOTE [ The batch is made on real tensors ]
# Under the fake mode, a collate_fn that pads samples one by one (ids[i, :n] = sample) mixes the
# samples' real tensors into fake ops: each one becomes a fake constant, an allocation per sample,
# so two sizes' traces differ in their events and no pair of them lines up for the target's
# allocator (a BERT on padded text planned for a T4 doubled to its ceiling). So make(batch_size)
# runs outside every mode but a panel's private RNG, on real tensors, and each tensor of the
# batch enters the step as one fake of its shape, strides and dtype: the batch's memory,
# allocated once per tensor (once for a tensor the batch holds twice, as labels=input_ids).
def _made_real(make: Callable[[int], Any]) -> Callable[[int], Any]:
    def made(batch_size: int) -> Any:
        with _disable_current_modes() as modes, contextlib.ExitStack() as kept:
            for mode in private_generators(modes):  # a panel's probe keeps its private RNG
                kept.enter_context(mode)
            batch = make(batch_size)
        keywords = as_keywords(batch)  # a BatchEncoding is fed as the dict it is
        fakes: dict[int, torch.Tensor] = {}  # a tensor twice in the batch (labels=ids) is one

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in fakes:
                fakes[id(tensor)] = fake_like(tensor)
            return fakes[id(tensor)]

        return tree_map_only(torch.Tensor, fake, batch if keywords is None else keywords)

    return made


