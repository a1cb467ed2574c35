"""The ``Accumulator`` that ``accumulate`` returns: it intercepts an unchanged loop's
optimizer, scaler, scheduler, backward and clipping calls, and keeps the books.
One object, one module: the calls it replaces read its books, so they live in it (STYLE G10)."""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import AccumulationReport
from .._called import in_own_steps
from .._grads import average_gradients, group_by_device_and_dtype, is_sharded, loss_scale
from .._state import InterruptGuard
from .._util import world_size
from ..noise import AccumulatorFeed, AutoSteps, NoiseTracker

_FLUSH_EVERY = 256  # device scalars kept before one host sync converts them to floats
SCHEDULE_EVERY = 16  # steps="auto": updates between two looks at the tracker's schedule


def _has_batchnorm(model: torch.nn.Module | None) -> bool:
    return model is not None and any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _first_batch_dim(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


class _Scalars:
    """Device scalars appended without a host sync; converted to floats every few hundred."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._pending: list[torch.Tensor] = []

    def append(self, value: torch.Tensor) -> torch.Tensor:
        """Keep ``value`` as a float32 0-dim tensor, and return that."""
        value = value.detach().float().reshape(())
        self._pending.append(value)
        if len(self._pending) >= _FLUSH_EVERY:
            self.flush()
        return value

    def flush(self) -> tuple[float, ...]:
        if self._pending:
            self.values.extend(torch.stack([v.cpu() for v in self._pending]).tolist())
            self._pending.clear()
        return tuple(self.values)


# NOTE [ What accumulate intercepts, and from whom ]
# The patches are process-wide (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_) or on
# objects other code may share, but only the thread that entered the block is accumulating:
# calls from other threads (a data-loading or logging thread, a panel) pass straight through,
# and so do batchwidgets' own steps (find_batch's probe steps inside an accumulate block, which
# would otherwise count as micro-steps and leave gradients behind; see NOTE [ Own steps ] in
# engine/_called.py).


# NOTE [ How accumulate intercepts an unchanged loop ]
# Inside the block, the optimizer's (and scaler's, scheduler's) own instance methods are shadowed:
# step() counts a micro-step and only every `steps`-th call reaches the real optimizer, after the
# summed gradients are divided by the count, so the update is the one of a batch `steps` times
# larger for a mean-reduced loss. zero_grad() is real only when no micro-gradients are pending,
# which suits both loop orders (zero_grad first or last). For DDP the model's
# require_backward_grad_sync flag (what no_sync() sets) is cleared before the forward of every
# micro-step but the last. torch.Tensor.backward is wrapped to record each micro-batch's loss.
# Everything is put back when the block ends, however it ends.


class Accumulator:
    """The context manager ``accumulate`` returns (see NOTE [ How accumulate intercepts ... ])."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int,
                 model: torch.nn.Module | None, scaler: Any, scheduler: Any,
                 remainder: str, track_grad_norms: bool, batch_size: int | None = None,
                 micro_batch_size: int | None = None, *,
                 noise: NoiseTracker | None = None, auto: bool = False) -> None:
        self.optimizer, self.steps, self.model = optimizer, steps, model
        self.scaler, self.scheduler, self.remainder = scaler, scheduler, remainder
        self.noise = noise
        # the tracker's side: NOTE [ What the noise tracker costs accumulate ] (noise/_feed.py)
        sharded = is_sharded([p for group in optimizer.param_groups for p in group["params"]])
        self._feed = (AccumulatorFeed(noise, track_grad_norms=track_grad_norms,
                                      ddp=self._is_ddp(), sharded=sharded)
                      if noise is not None else None)
        # per-micro-batch norms from hooks: for the report, or for a tracker that wants them
        # (never under FSDP2: see NOTE [ The noise of sharded gradients ] in noise/_feed.py)
        self._hooked = not sharded and (
            track_grad_norms or (self._feed is not None and self._feed.wants_every_norm))
        self._auto = AutoSteps(noise, steps, SCHEDULE_EVERY) if auto else None
        self._thread: int | None = None  # the thread that entered the block
        self._clip: tuple[Any, ...] | None = None  # a clip called on a micro-step, for a remainder
        self._param_ids: set[int] = set()
        self._grad_hooks: list[Any] = []
        self.batch_size, self.planned_micro_batch_size = batch_size, micro_batch_size
        self._pending = 0  # micro-steps since the last real step
        self._micro_steps = self._real_steps = self._skipped = 0
        self._averaged = self._in_real_step = self._update_due = False
        self._scheduler_due = self._scheduler_swallowed = 0
        self._scheduler_call: tuple[tuple, dict] = ((), {})  # the last swallowed call's arguments
        self._unscale_swallowed = False  # the loop's unscale_ on this micro-step, not carried out
        self._remainder_done, self._remainder_count = "none", 0
        self._micro_batch_size: int | None = None
        self._losses, self._grad_norms = _Scalars(), _Scalars()
        self._norms_current: list[torch.Tensor] = []  # this micro-batch's, per parameter
        self._scaled_loss_id: int | None = None
        self._patches: list[tuple[Any, str, bool, Any]] = []
        self._hooks: list[Any] = []
        self._ddp_sync: bool | None = None

    # ---- public helpers -------------------------------------------------------------------
    @property
    def is_sync_step(self) -> bool:
        """True when the next ``optimizer.step()`` is a real update (the last micro-step)."""
        return self._pending + 1 >= self.steps

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        parameters: Any = None) -> torch.Tensor | None:
        """Clip the *accumulated* gradient, as ``torch.nn.utils.clip_grad_norm_`` would clip the
        big batch's: on the last micro-step it averages and clips, and returns the total norm;
        on the other micro-steps it does nothing and returns None. Call it where you would clip
        (after ``scaler.unscale_(optimizer)`` with AMP)."""
        if not self.is_sync_step:
            return None
        params = self._params() if parameters is None else parameters
        return self._clip_now(self._clip_original, params, max_norm, norm_type=norm_type)

    def _clip_now(self, original: Callable, params: Any, *args: Any, **kwargs: Any) -> Any:
        """Average the accumulated gradient, take |G_big|^2 for the tracker, then clip."""
        self._average(self._pending + 1)
        if self._feed is not None:  # |G_big|^2 before clipping changes the gradient
            self._feed.before_clip(self._params(), self.scaler, self.optimizer)
        self._clip = None
        return original(params, *args, **kwargs)

    @property
    def _clip_original(self) -> Callable:
        for owner, name, _had_own, own in self._patches:
            if owner is torch.nn.utils and name == "clip_grad_norm_":
                return own
        return torch.nn.utils.clip_grad_norm_

    @property
    def report(self) -> AccumulationReport:
        world = world_size()
        return AccumulationReport(
            steps=self.steps, micro_steps=self._micro_steps, real_steps=self._real_steps,
            skipped_steps=self._skipped, remainder=self._remainder_done,
            remainder_micro_steps=self._remainder_count,
            micro_batch_size=self._micro_batch_size or self.planned_micro_batch_size,
            world_size=world, target_batch_size=self.batch_size,
            skips_allreduce=self._is_ddp() and self.steps > 1,
            losses=self._losses.flush(), grad_norms=self._grad_norms.flush(),
            auto=self._auto is not None,
            schedule_changes=tuple(self._auto.changes) if self._auto else (),
            lr_factor=self._auto.lr_factor if self._auto else 1.0,
            advice=self._feed.advice if self._feed is not None else "")

    # ---- who is accumulating: a call from the block, or another ---------------------------
    def _ours(self) -> bool:
        """Whether an intercepted call belongs to the block (NOTE [ What accumulate intercepts,
        and from whom ])."""
        return threading.get_ident() == self._thread and not in_own_steps()

    # ---- the replacements of the calls (NOTE [ How accumulate intercepts ... ]) -----------
    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        had_own = name in vars(owner)
        original = getattr(owner, name)
        self._patches.append((owner, name, had_own, vars(owner).get(name)))
        setattr(owner, name, make(original))

    def _optimizer_step(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            if self._in_real_step or not self._ours():
                return original(*args, **kwargs)
            return self._micro_step(lambda: original(*args, **kwargs))
        return step

    def _optimizer_zero_grad(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def zero_grad(*args: Any, **kwargs: Any) -> None:
            if self._pending == 0 or not self._ours():
                original(*args, **kwargs)
        return zero_grad

    def _scaler_scale(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def scale(outputs: Any) -> Any:
            scaled = original(outputs)
            if isinstance(outputs, torch.Tensor) and outputs.dim() == 0 and self._ours():
                self._record_loss(outputs)
                self._scaled_loss_id = id(scaled)
            return scaled
        return scale

    def _scaler_unscale(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            if (optimizer is not self.optimizer or self._in_real_step or self.is_sync_step
                    or not self._ours()):
                original(optimizer)
            else:
                self._unscale_swallowed = True
        return unscale_

    def _scaler_step(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if optimizer is not self.optimizer or self._in_real_step or not self._ours():
                return original(optimizer, *args, **kwargs)
            result = self._micro_step(lambda: original(optimizer, *args, **kwargs))
            self._update_due = self._update_due or self._pending == 0
            return result
        return step

    def _scaler_update(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def update(*args: Any, **kwargs: Any) -> None:
            if not self._ours():
                original(*args, **kwargs)
                return
            if not self._update_due:
                return
            before = self.scaler.get_scale()
            original(*args, **kwargs)
            self._update_due = False
            self._skipped += self.scaler.get_scale() < before
        return update

    def _scheduler_step(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> None:
            if not self._ours():
                original(*args, **kwargs)
            elif self._scheduler_due > 0:
                self._scheduler_due -= 1
                original(*args, **kwargs)
            else:
                self._scheduler_swallowed += 1
                self._scheduler_call = (args, kwargs)  # ReduceLROnPlateau's metric, for one
                # a remainder applies (NOTE [ The remainder's scheduler step ])
        return step

    def _tensor_backward(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if tensor.dim() == 0 and id(tensor) != self._scaled_loss_id and self._ours():
                self._record_loss(tensor)
            return original(tensor, *args, **kwargs)
        return backward

    def _clip_grad_norm(self, original: Callable) -> Callable:
        # NOTE [ Clipping inside accumulate ]: torch.nn.utils.clip_grad_norm_ on a micro-step
        # would clip a partial sum, so the big batch's gradient would be clipped several times
        # over, each time by a different, smaller norm. Inside the block, the standard call on
        # the optimizer's parameters clips once: on the last micro-step, the averaged gradient
        # (as the big batch's), at the real step; on the other micro-steps it changes nothing
        # and returns the norm of the mean gradient so far. A block that ends on a micro-step
        # applies the last clip asked for to its remainder step.
        @functools.wraps(original)
        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not self._ours() or self._in_real_step:
                return original(parameters, *args, **kwargs)
            params = ([parameters] if isinstance(parameters, torch.Tensor)
                      else list(parameters))
            if not any(id(p) in self._param_ids for p in params):
                return original(params, *args, **kwargs)
            if self.is_sync_step:
                return self._clip_now(original, params, *args, **kwargs)
            self._clip = (original, params, args, kwargs)
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                return torch.tensor(0.0)
            norm_type = float(args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0))
            with torch.no_grad():  # no host sync: the norm stays on the device
                device = grads[0].device
                norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float().to(device)
                                     for g in grads])
                norm = torch.linalg.vector_norm(norms, norm_type) / (self._pending + 1)
                scale = loss_scale(self.scaler, device) if self._unscale_swallowed else None
                return norm if scale is None else norm / scale  # as the loop's unscale_ would
        return clip_grad_norm_

    # ---- what the tracker costs -----------------------------------------------------------
    def _tick(self) -> float:
        return self._feed.tick() if self._feed is not None else 0.0

    def _charge(self, started: float) -> None:
        if self._feed is not None:
            self._feed.charge(started)

    # ---- the books: micro-steps and real steps --------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _average(self, count: int) -> None:
        if self._averaged or count <= 1:
            self._averaged = True
            return
        with torch.no_grad():
            for param in self._params():
                if param.grad is not None:
                    param.grad.div_(count)
        self._averaged = True

    def _micro_step(self, real: Callable[[], Any]) -> Any:
        self._unscale_swallowed = False
        self._micro_steps += 1
        self._pending += 1
        self._close_micro_batch()
        if self._pending < self.steps:
            if self._feed is not None and self._pending == 1:
                self._feed.first_micro_step(self._hooked)
            self._set_ddp_sync(self._pending == self.steps - 1)
            return None
        return self._real_step(real)

    def _real_step(self, real: Callable[[], Any]) -> Any:
        self._average(self._pending)
        if self._feed is not None:
            self._feed.update(self._params(), self.scaler, self.optimizer, hooked=self._hooked,
                              n_pending=self._pending, micro_batch_size=self._micro_batch_size)
        self._in_real_step = True
        saved = self._scale_lr()
        try:
            result = real()
        finally:
            self._in_real_step = False
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        self._pending, self._averaged, self._clip = 0, False, None
        self._real_steps += 1
        self._scheduler_due += 1
        self._scheduler_swallowed = 0
        if self._auto is not None:
            self.steps = self._auto.after_update(self._real_steps, self._micro_batch_size)
        if self._feed is not None and self._feed.sampler is not None:
            measuring = self._feed.end_update()
            if self._hooked:
                self._set_grad_hooks(measuring)
        self._set_ddp_sync(self.steps == 1)
        return result

    def _scale_lr(self) -> list[Any]:
        """steps="auto": the schedule's learning-rate factor on the optimizer's learning rates
        for this update (whatever a scheduler set them to); the saved values, to put back."""
        groups = self.optimizer.param_groups
        saved = [group.get("lr") for group in groups] if self._auto is not None else []
        factor = self._auto.lr_factor if self._auto is not None else 1.0
        if factor != 1.0:
            for group in groups:
                if isinstance(group.get("lr"), (int, float)):
                    group["lr"] = group["lr"] * factor
                elif isinstance(group.get("lr"), torch.Tensor):
                    group["lr"] = group["lr"] * factor  # a new tensor; the saved one goes back
        return saved

    def _set_grad_hooks(self, on: bool) -> None:
        if on and not self._grad_hooks:
            self._grad_hooks = [p.register_hook(self._grad_hook) for p in self._params()
                                if p.requires_grad]
        elif not on:
            for hook in self._grad_hooks:
                hook.remove()
            self._grad_hooks = []

    def _record_loss(self, loss: torch.Tensor) -> None:
        value = self._losses.append(loss)
        if self._feed is not None:
            self._feed.loss(value)

    # ---- the books: gradient norms, batch sizes -------------------------------------------
    def _grad_hook(self, grad: torch.Tensor) -> None:
        # one reduction per parameter here, combined in one go at the micro-step's end: the
        # hook runs once per parameter per micro-step, so every op in it counts
        if not self._ours():
            return
        started = self._tick()
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else None
        self._norms_current.append(torch.linalg.vector_norm(grad, dtype=wide))
        self._charge(started)

    def _close_micro_batch(self) -> None:
        if not self._norms_current:
            return
        norms, self._norms_current = self._norms_current, []
        if any(n.device != norms[0].device for n in norms):  # a model split across devices
            norms = [n.to(norms[0].device) for n in norms]
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack(norms)).float()
            scale = loss_scale(self.scaler, norm.device)
            if scale is not None:
                norm = norm / scale
        norm = self._grad_norms.append(norm)
        if self._feed is not None:
            self._feed.micro_norm(norm)

    def _record_batch_size(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._ours():
            return
        size = _first_batch_dim(args, kwargs)
        if size is not None:
            self._micro_batch_size = size

    # ---- DDP --------------------------------------------------------------------------------
    def _is_ddp(self) -> bool:
        return isinstance(self.model, torch.nn.parallel.DistributedDataParallel)

    def _set_ddp_sync(self, sync: bool) -> None:
        if self._is_ddp():
            self.model.require_backward_grad_sync = sync

    def _allreduce_pending(self) -> None:
        """Average the unsynchronised gradients of a remainder across ranks, as DDP would."""
        average_gradients(self._params(), getattr(self.model, "process_group", None))

    # ---- entering and leaving ---------------------------------------------------------------
    def __enter__(self) -> Accumulator:
        if _has_batchnorm(self.model):
            warnings.warn(
                f"the model has BatchNorm layers: under accumulate(steps={self.steps}) their "
                f"statistics come from each micro-batch, {self.steps} times smaller than the "
                f"effective batch, so training is close to the big batch but not identical; "
                f"GroupNorm or LayerNorm have no such difference.", BatchwidgetsWarning,
                stacklevel=2)
        # Ctrl-C waits while this __enter__ or the __exit__ runs, so that the patches go on and
        # come off whole (NOTE [ Restoring under Ctrl-C ] in _state.py); in the loop it is as usual.
        self._guard = InterruptGuard(home=sys._getframe(1))
        try:
            self._patch(self.optimizer, "step", self._optimizer_step)
            self._patch(self.optimizer, "zero_grad", self._optimizer_zero_grad)
            if self.model is not None:  # a loop may clear them through the model instead
                self._patch(self.model, "zero_grad", self._optimizer_zero_grad)
            if self.scaler is not None:
                for name, make in (("scale", self._scaler_scale), ("step", self._scaler_step),
                                   ("unscale_", self._scaler_unscale),
                                   ("update", self._scaler_update)):
                    self._patch(self.scaler, name, make)
            if self.scheduler is not None:
                self._patch(self.scheduler, "step", self._scheduler_step)
            self._patch(torch.Tensor, "backward", self._tensor_backward)
            for module in (torch.nn.utils, torch.nn.utils.clip_grad):
                self._patch(module, "clip_grad_norm_", self._clip_grad_norm)
            self._thread = threading.get_ident()
            self._param_ids = {id(p) for p in self._params()}
            if self._hooked:
                self._set_grad_hooks(True)
            if self._feed is not None:
                self._feed.start(group_by_device_and_dtype(
                    [p for p in self._params() if p.requires_grad]))
            if self.model is not None:
                self._hooks.append(self.model.register_forward_pre_hook(
                    self._record_batch_size, with_kwargs=True))
            if self._is_ddp():
                self._ddp_sync = self.model.require_backward_grad_sync
                self._set_ddp_sync(self.steps == 1)
        except BaseException:
            self._restore()
            self._guard.release()
            raise
        return self

    # NOTE [ The remainder's scheduler step ]
    # A block that ends on micro-steps applies them as one smaller update (remainder="apply"),
    # and a scheduler the loop called since the last update steps once after it, with the
    # arguments of the loop's last call: ReduceLROnPlateau's step takes its metric (called
    # without one, it raised TypeError at the block's end, the update already applied).
    def _finish_remainder(self) -> None:
        if self._pending == 0:
            return
        self._remainder_count = self._pending
        if self.remainder == "drop":
            self._remainder_done = "dropped"
            if self._feed is not None:
                self._feed.drop()
            self._restore()
            self.optimizer.zero_grad()
            self._pending = 0
            return
        self._remainder_done = "applied"
        if self._is_ddp():
            self._allreduce_pending()
        swallowed = self._scheduler_swallowed
        if self._clip is not None:  # NOTE [ Clipping inside accumulate ]
            original, params, args, kwargs = self._clip
            if self.scaler is not None:  # the loop's unscale_ was skipped on this micro-step
                self._in_real_step = True
                try:
                    self.scaler.unscale_(self.optimizer)
                finally:
                    self._in_real_step = False
            self._pending -= 1  # _clip_now averages over _pending + 1
            self._clip_now(original, params, *args, **kwargs)
            self._pending += 1
        if self.scaler is not None:
            self._real_step(lambda: self.scaler.step(self.optimizer))
            self._update_due = True
            self.scaler.update()
        else:
            self._real_step(self.optimizer.step)
        if self.scheduler is not None and swallowed:
            args, kwargs = self._scheduler_call
            self.scheduler.step(*args, **kwargs)
        self._restore()
        self.optimizer.zero_grad()

    def _drop_pending(self) -> None:
        """A block that raised: the micro-steps since the last update are dropped, their summed
        gradients cleared, as a loop without accumulate had cleared them at its zero_grad (a
        re-run would otherwise add them to its first update)."""
        if self._pending == 0:
            return
        self._remainder_count, self._remainder_done = self._pending, "dropped"
        if self._feed is not None:
            self._feed.drop()
        self.optimizer.zero_grad()
        self._pending = 0

    def _restore(self) -> None:
        self._set_grad_hooks(False)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._ddp_sync is not None:
            self.model.require_backward_grad_sync = self._ddp_sync
            self._ddp_sync = None
        while self._patches:
            owner, name, had_own, own = self._patches.pop()
            if had_own:
                setattr(owner, name, own)
            else:
                delattr(owner, name)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        interrupted = False
        try:
            if exc_type is None:
                self._finish_remainder()
        finally:
            self._restore()
            if exc_type is not None:
                self._drop_pending()
            interrupted = self._guard.release()  # Ctrl-C kept by a restore inside the block
        if self._feed is not None and (exc_type is None or exc_type is KeyboardInterrupt
                                       or interrupted):
            self._feed.flush()
        if interrupted and exc_type is None:
            raise KeyboardInterrupt
