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

import warnings
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from .._options import REMAINDERS, Remainder
from .._util import check_int
from ..noise import AutoSteps, NoiseTracker
from ._accumulator import Accumulator
from ._options import ACCUMULATE


def accumulate(optimizer: torch.optim.Optimizer, steps: int | str = ACCUMULATE.steps,
               model: torch.nn.Module | None = ACCUMULATE.model,
               scaler: Any = ACCUMULATE.scaler, scheduler: Any = ACCUMULATE.scheduler, *,
               remainder: Remainder = ACCUMULATE.remainder,
               track_grad_norms: bool = ACCUMULATE.track_grad_norms,
               batch_size: int | None = ACCUMULATE.batch_size,
               micro_batch_size: int | None = ACCUMULATE.micro_batch_size,
               noise: NoiseTracker | None = ACCUMULATE.noise) -> Accumulator:
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
                        f"{_given('optimizer', optimizer)}; pass the optimizer your loop steps.")
    auto = steps == "auto"
    if auto:
        if not isinstance(noise, NoiseTracker):
            raise ValueError(f"steps='auto' follows a noise tracker's schedule, but got "
                             f"{_given('noise', noise)}; e.g. accumulate(optimizer, "
                             f"steps='auto', model=model, noise=bw.NoiseTracker()).")
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
        raise TypeError(f"model should be a torch.nn.Module, but got {_given('model', model)}.")
    if scaler is not None and not all(callable(getattr(scaler, name, None))
                                      for name in ("scale", "unscale_", "step", "update")):
        raise TypeError(f"scaler should be a torch.amp.GradScaler (scale, unscale_, step, "
                        f"update), but got {_given('scaler', scaler)}; pass the GradScaler your "
                        f"loop uses, or leave it out.")
    if scheduler is not None and (isinstance(scheduler, torch.optim.Optimizer)
                                  or not callable(getattr(scheduler, "step", None))):
        raise TypeError(f"scheduler should be an LR scheduler with step(), but got "
                        f"{_given('scheduler', scheduler)}; pass the scheduler your loop steps, "
                        f"or leave it out.")
    if noise is not None and not isinstance(noise, NoiseTracker):
        raise TypeError(f"noise should be a batchwidgets.NoiseTracker, but got "
                        f"{_given('noise', noise)}; e.g. noise=bw.NoiseTracker().")
    return Accumulator(optimizer, steps, model, scaler, scheduler, remainder, track_grad_norms,
                       batch_size, micro_batch_size, noise=noise, auto=auto)


def _given(name: str, value: Any) -> str:
    """``name=value`` as an error says it, or the value's type where its repr is long (an
    optimizer's spans lines)."""
    shown = repr(value)
    if "\n" in shown or len(shown) > 80:
        return f"{name} of type {type(value).__name__}"
    return f"{name}={shown}"


def _steps_for(steps: int, batch_size: int | None, micro_batch_size: int | None) -> int:
    if batch_size is None and micro_batch_size is None:
        return steps
    for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        check_int(name, value, 1, hint="; give batch_size and micro_batch_size together")
    if steps != 4:  # the default: batch_size decides
        raise ValueError(f"give steps or batch_size with micro_batch_size, not both, but got "
                         f"steps={steps!r} and batch_size={batch_size!r}.")
    if batch_size % micro_batch_size:
        warnings.warn(f"batch_size={batch_size} is not a multiple of micro_batch_size="
                      f"{micro_batch_size}: each update will see "
                      f"{-(-batch_size // micro_batch_size) * micro_batch_size} samples.",
                      BatchwidgetsWarning, stacklevel=3)
    return -(-batch_size // micro_batch_size)  # ceil
