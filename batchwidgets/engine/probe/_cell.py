"""A notebook cell as find_batch's step: the user's training code for one step (or a loop,
stopped after one), run at each batch size the search picks, its namespace put back after each
trial; and its fake trials (``CellWorld``): every module and optimizer the cell names on fake
twins while it runs.

Usage:
    >>> import torch, batchwidgets as bw
    >>> model = torch.nn.Linear(8, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> namespace = {"torch": torch, "model": model, "opt": opt}
    >>> code = compile("model(torch.randn(bs, 8)).sum().backward(); opt.step(); opt.zero_grad()",
    ...                "<cell>", "exec")
    >>> step = CellStep(code, namespace, "bs")
    >>> bw.find_batch(model, step=step, optimizer=opt, budget="64KB").max_batch_size > 0
    True
    >>> "bs" in namespace  # the name the probe bound is gone again
    False
"""

from __future__ import annotations

import collections
import contextlib
import io
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._called import calling
from ._fakes import fake_like, fake_state, host_scalars, quiet_meta_errors, where_it_failed

# NOTE [ A cell as the step ]
# `%%find_batch --var bs` probes the user's own training code: whatever it keeps, frees, clips,
# logs or accumulates is then measured, not modelled. Each trial runs the cell's code in the
# notebook's namespace with `bs` bound to the size, as often as the trial takes steps: the
# names the code binds (`outputs`, `loss`, `batch`) stay bound from one run to the next, as a
# loop's variables do from one iteration to the next, and at the trial's end (inside the meter,
# ``release``) each name the cell rebound gets its value back and each it created goes. A cell
# that loops over its data is stopped after one step: once an optimizer has stepped, the next
# module forward raises ``_OneStepDone`` (the next iteration's start), which ends the run. The
# modules, optimizers, schedulers and GradScalers the cell names (``touches``) come back bit for
# bit after each trial, with the RNGs (find_batch's TrainingState). What the cell prints during
# the probe is not shown: it runs a dozen times.


class _OneStepDone(BaseException):
    """The cell's loop finished one step (a BaseException: the user's `except Exception` does
    not catch it)."""


@contextmanager
def _one_step() -> Iterator[None]:
    """Stop the code inside at the first module forward after an optimizer has stepped."""
    stepped = []

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        stepped.append(True)

    def before_forward(module: Any, args: Any) -> None:
        if stepped:
            raise _OneStepDone

    step_hook = register_optimizer_step_post_hook(after_step)
    forward_hook = register_module_forward_pre_hook(before_forward)
    try:
        yield
    except _OneStepDone:
        pass
    finally:
        step_hook.remove()
        forward_hook.remove()


def names_in(code: types.CodeType) -> set[str]:
    """Every global name the code (and the functions it defines) reads or binds."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_in(const)
    return names


def _has_state(value: Any) -> bool:
    """What the probe puts back: modules, optimizers, LR schedulers, GradScalers."""
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or (
        hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
        and (hasattr(value, "get_last_lr") or hasattr(value, "unscale_")))


class CellStep:
    """``step(batch_size)``: the cell's ``code`` run in ``namespace`` with ``var`` bound to the
    batch size (NOTE [ A cell as the step ]). ``touches``: the objects with state the cell
    names, which find_batch puts back after each trial."""

    def __init__(self, code: types.CodeType, namespace: dict, var: str) -> None:
        self.code, self.namespace, self.var = code, namespace, var
        self.names = sorted(names_in(code) | {var})
        self.saved = {name: namespace[name] for name in self.names if name in namespace}
        found: dict[int, Any] = {}
        for name in self.names:
            value = namespace.get(name)
            if _has_state(value):
                found.setdefault(id(value), value)
        self.touches = tuple(found.values())
        self.loss_from = ""

    def __call__(self, batch_size: int) -> None:
        self.namespace[self.var] = batch_size
        with contextlib.redirect_stdout(io.StringIO()), _one_step(), \
                calling(lambda: f"the cell with {self.var} = {batch_size}", sized=True):
            exec(self.code, self.namespace)

    def release(self) -> None:
        """The trial's end: the names the cell bound go back to what they were."""
        missing = object()
        for name in self.names:
            if name in self.saved:
                if self.namespace.get(name, missing) is not self.saved[name]:
                    self.namespace[name] = self.saved[name]
            else:
                self.namespace.pop(name, None)

    @property
    def fakes(self) -> str:
        """Why the cell cannot run on fake tensors ("" where it may): a GradScaler's inf check
        reads a value back, and its scale would be made a fake tensor."""
        if any(hasattr(value, "unscale_") for value in self.touches):
            return "the cell steps a GradScaler, whose inf check reads a value back"
        return ""


# NOTE [ A cell's fake trials ]
# A cell traced on fake tensors (the free first guess of NOTE [ A free first guess ] in
# _probe.py) runs the user's objects themselves, not copies: while it runs, every module it names
# has fake twins in its registries (as FakeWorld.swapped), and every optimizer it names holds the
# twins in its param groups and fake state made from its real state's shapes; the real ones go
# back when the run ends, and the real objects' hyperparameters, schedulers and modes come back
# after each trial with find_batch's TrainingState (``home``). What the cell makes itself
# (torch.randn(bs, ...)) is fake under the mode; real tensors it reads become fake constants.
class CellWorld:
    """The fake twins of the modules and optimizers a cell names, the state each fake trial of
    the cell starts from."""

    def __init__(self, step: CellStep, mode: FakeTensorMode, home: Any) -> None:
        self.step, self.mode, self.home = step, mode, home
        modules = [o for o in step.touches if isinstance(o, torch.nn.Module)]
        self.optimizers = [o for o in step.touches if isinstance(o, torch.optim.Optimizer)]
        params = {id(p): p for m in modules for p in m.parameters()}
        params.update({id(p): p for o in self.optimizers for g in o.param_groups
                       for p in g["params"]})
        buffers = {id(b): b for m in modules for b in m.buffers()}
        self.modules = modules
        scalars = {k: v for o in self.optimizers for k, v in host_scalars(o).items()}
        with mode:
            self.twins = {key: torch.nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
                          for key, p in params.items()}
            self.twins.update({key: fake_like(b) for key, b in buffers.items()})
            self._start = [{self.twins[id(p)]: {k: fake_state(v, scalars) for k, v in s.items()}
                            for p, s in o.state.items() if id(p) in self.twins}
                           for o in self.optimizers]
        self._grads = {key: (p.grad.shape, p.grad.stride(), p.grad.dtype)
                       for key, p in params.items() if p.grad is not None}
        self._params = params
        self.states = [collections.defaultdict(dict) for _ in self.optimizers]
        self.reset()

    def tensors(self) -> list:
        params = [self.twins[key] for key in self._params]
        return [*self.twins.values(), *[p.grad for p in params if p.grad is not None],
                *[dict(s) for state in self.states for s in state.values()]]

    def marked(self) -> list[torch.Tensor]:
        return list(self.twins.values())

    def reset(self) -> None:
        """The fakes as each trial starts: fresh gradients where the user held some, the
        optimizers' fake state as it was faked."""
        with self.mode:
            for key in self._params:
                grad = self._grads.get(key)
                self.twins[key].grad = None if grad is None else torch.empty_strided(
                    grad[0], grad[1], dtype=grad[2], device="cpu")
        for state, start in zip(self.states, self._start):
            state.clear()
            state.update({p: dict(s) for p, s in start.items()})

    def restore(self) -> None:
        self.reset()
        self.home.restore()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        saved: list = []
        try:
            for module in {id(sub): sub for top in self.modules for sub in top.modules()}.values():
                for registry in (module._parameters, module._buffers):
                    for name, value in registry.items():
                        if value is not None and id(value) in self.twins:
                            saved.append((registry, name, value))
                            registry[name] = self.twins[id(value)]
            for optimizer, state in zip(self.optimizers, self.states):
                saved.append((optimizer, "state", optimizer.state))
                optimizer.state = state
                for group in optimizer.param_groups:
                    saved.append((group, "params", group["params"]))
                    group["params"] = [self.twins.get(id(p), p) for p in group["params"]]
            yield
        finally:
            for owner, name, value in reversed(saved):
                if isinstance(owner, torch.optim.Optimizer):
                    owner.state = value
                else:
                    owner[name] = value


class FakeCellStep:
    """The cell run on its world's fakes (under the fake mode the Trainer enters)."""

    def __init__(self, world: CellWorld, meter: Any) -> None:
        self.world, self.meter = world, meter

    def __call__(self, batch_size: int) -> None:
        with quiet_meta_errors(), where_it_failed(self.meter), self.world.swapped():
            self.world.step(batch_size)

    def release(self) -> None:
        self.world.step.release()
