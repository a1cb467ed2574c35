"""``accumulate``: gradient accumulation around an ordinary, unchanged training loop.

Usage:
    >>> import torch, batchwidgets as bw
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with bw.accumulate(optimizer, steps=4) as acc:
    ...     for _ in range(8):
    ...         loss = model(torch.randn(2, 4)).pow(2).mean()
    ...         loss.backward(); optimizer.step(); optimizer.zero_grad()
    >>> acc.report.real_steps
    2
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._warnings import BatchwidgetsWarning
from ..results import AccumulationReport
from ._noise_estimate import (
    DeferredUpdate,
    first_sq_norm,
    grad_norms,
    grad_sq_norm,
    group_by_device_and_dtype,
    loss_scale,
)
from ._schedule import AutoSteps
from .noise_tracker import NoiseTracker

REMAINDERS = ("apply", "drop")
_FLUSH_EVERY = 256  # device scalars kept before one host sync converts them to floats
SCHEDULE_EVERY = 16  # steps="auto": updates between two looks at the tracker's schedule
_LOCAL = threading.local()  # _LOCAL.suspended: depth of _suspended() blocks on this thread

# NOTE [ What accumulate intercepts, and from whom ]
# The patches are process-wide (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_) or on
# objects other code may share, but only the thread that entered the block is accumulating:
# calls from other threads (a data-loading or logging thread, a panel) pass straight through,
# and so do batchwidgets' own steps run inside _suspended() (find_batch's probe steps inside an
# accumulate block, which would otherwise count as micro-steps and leave gradients behind).


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """Inside, on this thread, every accumulate block lets the calls through untouched (see
    NOTE [ What accumulate intercepts, and from whom ]); for batchwidgets' own probe steps."""
    _LOCAL.suspended = getattr(_LOCAL, "suspended", 0) + 1
    try:
        yield
    finally:
        _LOCAL.suspended -= 1


def _is_suspended() -> bool:
    return getattr(_LOCAL, "suspended", 0) > 0

# NOTE [ How accumulate intercepts an unchanged loop ]
# Inside the block, the optimizer's (and scaler's, scheduler's) own instance methods are shadowed:
# step() counts a micro-step and only every `steps`-th call reaches the real optimizer, after the
# summed gradients are divided by the count, so the update is the one of a batch `steps` times
# larger for a mean-reduced loss. zero_grad() is real only when no micro-gradients are pending,
# which suits both loop orders (zero_grad first or last). For DDP the model's
# require_backward_grad_sync flag (what no_sync() sets) is cleared before the forward of every
# micro-step but the last. torch.Tensor.backward is wrapped to record each micro-batch's loss.
# Everything is put back when the block ends, however it ends.

# NOTE [ What the noise tracker costs accumulate ]
# Issue 5: at most 2% per training step. Two things used to cost more: a host sync per update
# (a .tolist() of the update's norms, which stalls a GPU's queue), and a gradient hook per
# parameter per micro-step (a Python call and a reduction each). Now each update's numbers are
# stacked into one small device tensor handed to the tracker, which reads all it holds in one
# .tolist() when they are needed (NoiseTracker.flush). And without hooks the tracker gets the
# squared norm of .grad after the first micro-step, which holds that micro-batch's gradient
# alone, besides |G_big|^2 (NOTE [ The prefix-sum estimator ]): one fused _foreach_norm per
# update, whatever the number of parameters and micro-steps. That estimate is noisier (2-10x the
# updates for one error bar), too noisy for a short run, so it is opt-in:
# NoiseTracker(every_micro_batch=False). By default, and with track_grad_norms=True (the
# report's per-micro-batch norms) and under DDP (whose micro-steps see only their rank's sums;
# with steps=1, none at all), the hooks take every micro-batch's norm, one reduction per
# parameter per micro-step, and the tracker uses all k of them.


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
        self.track_grad_norms = track_grad_norms
        # per-micro-batch norms from hooks; see NOTE [ What the noise tracker costs accumulate ]
        self._hooked = track_grad_norms or (noise is not None and (
            noise.every_micro_batch or self._is_ddp()))
        # NOTE [ Sampling updates to keep the tracker cheap ] (_schedule.py)
        self._sampler = noise.sampler if noise is not None and not (
            track_grad_norms or self._is_ddp() or noise.overhead_target is None) else None
        self._measuring = noise is not None  # whether this update feeds the tracker
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
        self._remainder_done, self._remainder_count = "none", 0
        self._micro_batch_size: int | None = None
        self._losses, self._grad_norms = _Scalars(), _Scalars()
        self._norms_current: list[torch.Tensor] = []  # this micro-batch's, per parameter
        # for the noise tracker, this update's: losses, micro-batch norms (hooks) or the
        # per-parameter norms of the first micro-batch's gradient (no hooks), |G_big|^2 if
        # clipping took it
        self._group_losses: list[torch.Tensor] = []
        self._group_norms: list[torch.Tensor] = []
        self._first_norms: list[torch.Tensor] = []
        self._big_sq: torch.Tensor | None = None
        self._param_groups: list[list[torch.Tensor]] = []  # by device and dtype, on entering
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
        if self._measuring and self._big_sq is None:  # before clipping changes the gradient
            started = self._tick()
            self._big_sq = grad_sq_norm(self._params(), self.scaler, self.optimizer,
                                        self._param_groups)
            self._charge(started)
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
        world = (torch.distributed.get_world_size() if torch.distributed.is_available()
                 and torch.distributed.is_initialized() else 1)
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
            advice=self.noise.report.accumulation_advice if self.noise is not None else "")

    # ---- who is accumulating; what the tracker costs ---------------------------------------
    def _ours(self) -> bool:
        """Whether an intercepted call belongs to the block (NOTE [ What accumulate intercepts,
        and from whom ])."""
        return threading.get_ident() == self._thread and not _is_suspended()

    def _tick(self) -> float:
        return self._sampler.clock() if self._sampler is not None else 0.0

    def _charge(self, started: float) -> None:
        if self._sampler is not None:
            self._sampler.charge(started)

    # ---- the intercepted calls ------------------------------------------------------------
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
        self._micro_steps += 1
        self._pending += 1
        self._close_micro_batch()
        if self._pending < self.steps:
            if self._measuring and not self._hooked and self._pending == 1:
                # .grad holds the first micro-batch's gradient: NOTE [ The prefix-sum estimator ]
                started = self._tick()
                with torch.no_grad():
                    self._first_norms = grad_norms(self._param_groups)
                self._charge(started)
            self._set_ddp_sync(self._pending == self.steps - 1)
            return None
        return self._real_step(real)

    def _real_step(self, real: Callable[[], Any]) -> Any:
        self._average(self._pending)
        if self.noise is not None:
            self._feed_noise_tracker()
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
        if self._sampler is not None:
            self._measuring = self._sampler.end_update()
            if self._hooked:
                self._set_grad_hooks(self._measuring)
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

    # ---- the noise tracker --------------------------------------------------------------------
    def _feed_noise_tracker(self) -> None:
        """Hand the tracker this update's losses and squared norms as one device tensor: no
        host sync (see NOTE [ What the noise tracker costs accumulate ])."""
        started = self._tick()  # the listeners (a panel's drawing) are not the tracker's cost
        big = (self._big_sq if self._big_sq is not None or not self._measuring
               else grad_sq_norm(self._params(), self.scaler, self.optimizer, self._param_groups))
        if not self._measuring:  # sampling left this update out: its losses only
            self._big_sq, self._group_norms, self._first_norms = None, [], []
            self._defer_losses()
            self.noise._skip_update()
            return
        losses, norms, first = self._group_losses, self._group_norms, self._first_norms
        self._group_losses, self._group_norms, self._first_norms = [], [], []
        self._big_sq = None
        if self._hooked:
            # under DDP the micro norms are each rank's own, and the big gradient is averaged
            # over the ranks too, so B_big is k times the world size times b. Every rank gets
            # every rank's micro norms (one all_gather of k scalars per update, no host sync):
            # all report the same estimate, pooled over world*k micro-batches
            world = torch.distributed.get_world_size() if self._is_ddp() else 1
            if world > 1 and norms:
                with torch.no_grad():
                    local = torch.stack(norms)
                    gathered = [torch.empty_like(local) for _ in range(world)]
                    torch.distributed.all_gather(gathered, local)
                norms = list(torch.cat(gathered).unbind())
            small, kind, n_micro = norms, "norms", len(norms)
        else:  # g_1 alone, unless the update had one micro-step (a remainder): then it is big
            square = first_sq_norm(first, self.scaler) if self._pending > 1 else None
            small, kind, n_micro = [square] if square is not None else [], "squares", self._pending
        if big is None or (self._hooked and not small):  # no gradients: the losses only
            small, kind = [], None
        scalars = [*losses, *small] + ([big] if kind is not None else [])
        if not scalars:
            return
        device = scalars[-1].device
        with torch.no_grad():
            values = torch.stack([t if t.device == device else t.to(device) for t in scalars])
        self._charge(started)
        self.noise._defer(values, DeferredUpdate(
            n_values=len(scalars), n_losses=len(losses), small=kind,
            micro_batch_size=self._micro_batch_size, n_micro=n_micro))

    def _defer_losses(self) -> None:
        if self._group_losses:
            n_losses = len(self._group_losses)
            self.noise._defer(torch.stack(self._group_losses), DeferredUpdate(
                n_values=n_losses, n_losses=n_losses, small=None, micro_batch_size=None,
                n_micro=0))
            self._group_losses = []

    def _record_loss(self, loss: torch.Tensor) -> None:
        value = self._losses.append(loss)
        if self.noise is not None:
            self._group_losses.append(value)

    # ---- the intercepted calls, continued -----------------------------------------------------
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
        return step

    def _tensor_backward(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if tensor.dim() == 0 and id(tensor) != self._scaled_loss_id and self._ours():
                self._record_loss(tensor)
            return original(tensor, *args, **kwargs)
        return backward

    def _grad_hook(self, grad: torch.Tensor) -> None:
        # one reduction per parameter here, combined in one go at the micro-step's end: the
        # hook runs once per parameter per micro-step, so every op in it counts
        if not self._ours():
            return
        started = self._tick()
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else None
        self._norms_current.append(torch.linalg.vector_norm(grad, dtype=wide))
        self._charge(started)

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
                return torch.linalg.vector_norm(norms, norm_type) / (self._pending + 1)
        return clip_grad_norm_

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
        if self.noise is not None:
            self._group_norms.append(norm)

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
        world = torch.distributed.get_world_size()
        for param in self._params():
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad)
                param.grad.div_(world)

    # ---- entering and leaving ---------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        had_own = name in vars(owner)
        original = getattr(owner, name)
        self._patches.append((owner, name, had_own, vars(owner).get(name)))
        setattr(owner, name, make(original))

    def __enter__(self) -> Accumulator:
        if _has_batchnorm(self.model):
            warnings.warn(
                f"the model has BatchNorm layers: under accumulate(steps={self.steps}) their "
                f"statistics come from each micro-batch, {self.steps} times smaller than the "
                f"effective batch, so training is close to the big batch but not identical; "
                f"GroupNorm or LayerNorm have no such difference.", BatchwidgetsWarning,
                stacklevel=2)
        try:
            self._patch(self.optimizer, "step", self._optimizer_step)
            self._patch(self.optimizer, "zero_grad", self._optimizer_zero_grad)
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
            self._param_groups = group_by_device_and_dtype(
                [p for p in self._params() if p.requires_grad])
            if self._hooked:
                self._set_grad_hooks(True)
            if self._sampler is not None:
                self._sampler.start()
            if self.model is not None:
                self._hooks.append(self.model.register_forward_pre_hook(
                    self._record_batch_size, with_kwargs=True))
            if self._is_ddp():
                self._ddp_sync = self.model.require_backward_grad_sync
                self._set_ddp_sync(self.steps == 1)
        except BaseException:
            self._restore()
            raise
        return self

    def _finish_remainder(self) -> None:
        if self._pending == 0:
            return
        self._remainder_count = self._pending
        if self.remainder == "drop":
            self._remainder_done = "dropped"
            if self.noise is not None:
                self._defer_losses()
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
            self.scheduler.step()
        self._restore()
        self.optimizer.zero_grad()

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
        try:
            if exc_type is None:
                self._finish_remainder()
        finally:
            self._restore()
        if self.noise is not None and (exc_type is None or exc_type is KeyboardInterrupt):
            self.noise.flush()  # the last updates, to the listeners (a live panel) too


def accumulate(optimizer: torch.optim.Optimizer, steps: int | str = 4,
               model: torch.nn.Module | None = None, scaler: Any = None, scheduler: Any = None,
               *, remainder: str = "apply", track_grad_norms: bool = False,
               batch_size: int | None = None, micro_batch_size: int | None = None,
               noise: NoiseTracker | None = None) -> Accumulator:
    """Gradient accumulation around an unchanged training loop.

    Inside the block, ``optimizer.step()`` and ``zero_grad()`` take effect every ``steps``
    calls, with the summed gradients divided by the count, so each update equals one step on a
    batch ``steps`` times larger (mean-reduced loss). A ``GradScaler`` unscales, checks for
    inf/NaN and updates once per real step; a scheduler steps once per real step; a
    ``DistributedDataParallel`` model skips the all-reduce on all micro-steps but the last.
    Everything is restored when the block ends, also on error or Ctrl-C.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer the loop calls ``step()``/``zero_grad()`` on.
    steps : int or "auto"
        Micro-steps per real optimizer step (or derived from ``batch_size``). ``"auto"``
        follows the schedule of ``noise`` (``tracker.report.schedule``, bounded by the
        tracker's ``max_batch_size``): from 2 micro-batches (the fewest that measure the noise),
        every 16 updates (one host sync) it ramps up to the schedule's micro-batches per update,
        and scales the optimizer's learning rates for each update by the schedule's factor (on
        top of any scheduler; put back after each step). ``acc.report.schedule_changes`` lists
        every change. See NOTE [ The batch-size schedule ].
    model : torch.nn.Module, optional
        Needed for DDP (to skip all-reduces), the BatchNorm warning and the micro-batch size.
    scaler : torch.amp.GradScaler, optional
        The loop's AMP scaler.
    scheduler : LR scheduler, optional
        Stepped once per real step however often the loop calls it.
    remainder : {"apply", "drop"}
        Micro-steps left when the block ends: one smaller step averaged over the real count
        (default), or discarded. The report says which happened.
    track_grad_norms : bool
        Record each micro-batch's gradient norm in the report: a hook and a reduction per
        parameter per micro-step, which is why it is off by default. A noise tracker then uses
        them all (a tighter estimate; see NOTE [ The prefix-sum estimator ]).
    batch_size, micro_batch_size : int, optional
        Instead of ``steps``: the batch each update should see, and the micro-batch the loop
        feeds (e.g. ``find_batch``'s ``recommended_batch_size``); ``steps`` becomes
        ``ceil(batch_size / micro_batch_size)`` and the report states all three.
    noise : NoiseTracker, optional
        Follows the losses and the gradient noise scale from each update's micro-batches, for
        two fused gradient norms and no host sync per update (pass ``model`` so it knows the
        micro-batch size); see NOTE [ What the noise tracker costs accumulate ]. Under DDP it
        uses, and records in ``grad_norms``, each micro-batch's norm.

    Returns
    -------
    Accumulator
        The context manager; ``acc.report`` is an ``AccumulationReport``, ``acc.is_sync_step``
        tells whether the next step is real, and ``acc.clip_grad_norm_(max_norm)`` clips the
        accumulated gradient (clipping partial sums would be wrong).

    Examples
    --------
    >>> with accumulate(optimizer, steps=4, scheduler=scheduler) as acc:   # doctest: +SKIP
    ...     for x, y in loader:
    ...         loss = loss_fn(model(x), y); loss.backward()
    ...         torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # once, per update
    ...         optimizer.step(); scheduler.step(); optimizer.zero_grad()
    >>> tracker = NoiseTracker(max_batch_size=1024)                     # doctest: +SKIP
    >>> with accumulate(optimizer, steps="auto", model=model,          # doctest: +SKIP
    ...                 noise=tracker) as acc:
    ...     train()
    >>> acc.report.schedule_changes                                     # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer should be a torch.optim.Optimizer, but got "
                        f"optimizer={optimizer!r}; pass the optimizer your loop steps.")
    auto = steps == "auto"
    if auto:
        if not isinstance(noise, NoiseTracker):
            raise ValueError(f"steps='auto' follows a noise tracker's schedule, but got "
                             f"noise={noise!r}; e.g. accumulate(optimizer, steps='auto', "
                             f"model=model, noise=bw.NoiseTracker()).")
        if batch_size is not None or micro_batch_size is not None:
            raise ValueError(f"give steps='auto' or batch_size with micro_batch_size, not both, "
                             f"but got batch_size={batch_size!r}; bound the schedule with "
                             f"NoiseTracker(max_batch_size=...).")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("steps='auto' is not supported under DDP yet (every rank would "
                             "have to change steps at the same update), but got a "
                             "DistributedDataParallel model; pass an int steps.")
        steps = AutoSteps.MIN_STEPS
    steps = _steps_for(steps, batch_size, micro_batch_size)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps should be an int >= 1 or 'auto', but got steps={steps!r}; e.g. "
                         f"steps=4 makes each update use 4 micro-batches.")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder should be one of {list(REMAINDERS)}, but got "
                         f"remainder={remainder!r}.")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got model={model!r}.")
    if noise is not None and not isinstance(noise, NoiseTracker):
        raise TypeError(f"noise should be a batchwidgets.NoiseTracker, but got noise={noise!r}; "
                        f"e.g. noise=bw.NoiseTracker().")
    return Accumulator(optimizer, steps, model, scaler, scheduler, remainder, track_grad_norms,
                       batch_size, micro_batch_size, noise=noise, auto=auto)


def _steps_for(steps: int, batch_size: int | None, micro_batch_size: int | None) -> int:
    if batch_size is None and micro_batch_size is None:
        return steps
    for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} should be a positive int (give batch_size and "
                             f"micro_batch_size together), but got {name}={value!r}.")
    if steps != 4:  # the default: batch_size decides
        raise ValueError(f"give steps or batch_size with micro_batch_size, not both, but got "
                         f"steps={steps!r} and batch_size={batch_size!r}.")
    if batch_size % micro_batch_size:
        warnings.warn(f"batch_size={batch_size} is not a multiple of micro_batch_size="
                      f"{micro_batch_size}: each update will see "
                      f"{-(-batch_size // micro_batch_size) * micro_batch_size} samples.",
                      BatchwidgetsWarning, stacklevel=3)
    return -(-batch_size // micro_batch_size)  # ceil
