"""The calls an ``accumulate`` block replaces (the optimizer's, scaler's and scheduler's
``step``, ``torch.Tensor.backward``, ``clip_grad_norm_``), and which thread they serve."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._own_steps import in_own_steps

# NOTE [ What accumulate intercepts, and from whom ]
# The patches are process-wide (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_) or on
# objects other code may share, but only the thread that entered the block is accumulating:
# calls from other threads (a data-loading or logging thread, a panel) pass straight through,
# and so do batchwidgets' own steps (find_batch's probe steps inside an accumulate block, which
# would otherwise count as micro-steps and leave gradients behind; see NOTE [ Own steps ] in
# engine/_own_steps.py).


# NOTE [ How accumulate intercepts an unchanged loop ]
# Inside the block, the optimizer's (and scaler's, scheduler's) own instance methods are shadowed:
# step() counts a micro-step and only every `steps`-th call reaches the real optimizer, after the
# summed gradients are divided by the count, so the update is the one of a batch `steps` times
# larger for a mean-reduced loss. zero_grad() is real only when no micro-gradients are pending,
# which suits both loop orders (zero_grad first or last). For DDP the model's
# require_backward_grad_sync flag (what no_sync() sets) is cleared before the forward of every
# micro-step but the last. torch.Tensor.backward is wrapped to record each micro-batch's loss.
# Everything is put back when the block ends, however it ends.


class InterceptedCalls:
    """The replacements ``Accumulator`` installs: each lets a call through, or hands it to
    the accumulator's bookkeeping (``_micro_step``, ``_record_loss``, ``_clip_now``), whose
    state (``_pending``, ``_in_real_step``, ...) it reads. Split from ``Accumulator`` to
    keep each module short; it is not used on its own."""

    # ---- who is accumulating -----------------------------------------------------------
    def _ours(self) -> bool:
        """Whether an intercepted call belongs to the block (NOTE [ What accumulate intercepts,
        and from whom ])."""
        return threading.get_ident() == self._thread and not in_own_steps()

    # ---- the replacements --------------------------------------------------------------
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
