"""Decisions ``accumulate`` takes from the noise tracker while the loop runs: which updates to
measure (``UpdateSampler``: every k-th, k from the measured cost) and, with ``steps="auto"``, how
many micro-batches per update and the learning-rate factor (``AutoSteps``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ...results import ScheduleChange, plan_batch

# NOTE [ Sampling updates to keep the tracker cheap ]
# The tracker's cost per measured update (gradient hooks, norms, the deferred stack) is timed
# with perf_counter around its own code, and the rest of the update (forward, backward, step,
# data) as the update's wall time minus that. The first CALIBRATION updates are all measured
# (the estimate needs them most, and short runs stay exact); after them, 1 update in
# k = ceil(cost / (rest * target)) is measured, so the tracker's share of the time stays under
# the target; both are moving averages, so k follows a change of step time. On a GPU the timed
# cost is the host's (launches, Python hooks): the kernels are memory-bound norms of the
# gradients, a small part of a backward. Unmeasured updates cost nothing but the losses (no
# hooks, no norms). The estimate's moving averages and error bar then run over the measured
# updates alone: the same ema spans k times more training, and the error bar is that of the
# measured updates (wider for the same wall time, which the report states with
# ``sample_every``). Under DDP every rank must measure the same updates (an all_gather), so
# sampling is off there; with track_grad_norms=True the hooks run anyway, so it is off too.
CALIBRATION = 32  # measured updates before the first k > 1
_SMOOTH = 0.8  # weight of the past in the two moving averages of seconds
MAX_SAMPLE_EVERY = 1000


class UpdateSampler:
    """Measure 1 update in ``every``, with ``every`` from the measured cost (NOTE [ Sampling
    updates to keep the tracker cheap ]); ``target`` None: every update."""

    def __init__(self, target: float | None, clock: Callable[[], float] = time.perf_counter):
        self.target, self.clock = target, clock
        self.every, self.measuring = 1, True
        self._cost_s = 0.0  # the tracker's seconds in this update
        self._cost_avg: float | None = None  # per measured update
        self._rest_avg: float | None = None  # the update's seconds without the tracker
        self._n_measured = self._since = 0
        self._last: float | None = None

    def start(self) -> None:
        self._last, self._cost_s = self.clock(), 0.0

    def charge(self, started: float) -> None:
        """Count the seconds since ``started`` (a ``clock()`` reading) as the tracker's."""
        self._cost_s += self.clock() - started

    @property
    def overhead(self) -> float | None:
        """The tracker's share of the training time at the current ``every``."""
        if self._cost_avg is None or not self._rest_avg:
            return None
        return self._cost_avg / self.every / self._rest_avg

    def end_update(self) -> bool:
        """Close an update (at its optimizer step); True when the next one is measured."""
        now = self.clock()
        if self._last is not None:
            rest = max(now - self._last - self._cost_s, 1e-9)
            self._rest_avg = rest if self._rest_avg is None else (
                _SMOOTH * self._rest_avg + (1 - _SMOOTH) * rest)
            if self.measuring:
                self._n_measured += 1
                self._cost_avg = self._cost_s if self._cost_avg is None else (
                    _SMOOTH * self._cost_avg + (1 - _SMOOTH) * self._cost_s)
        self._last, self._cost_s = now, 0.0
        if (self.target is not None and self._n_measured >= CALIBRATION
                and self._cost_avg is not None and self._rest_avg):
            share = self._cost_avg / self._rest_avg  # at every = 1
            self.every = min(max(1, math.ceil(share / self.target)), MAX_SAMPLE_EVERY)
        self._since += 1
        self.measuring = self._since >= self.every
        if self.measuring:
            self._since = 0
        return self.measuring


class AutoSteps:
    """``accumulate(steps="auto")``: after every ``check_every`` updates, read the tracker and
    ramp the micro-batches per update up to its schedule (NOTE [ The batch-size schedule ]),
    with the learning-rate factor of the rule; every change is kept, with the number it
    followed (the tracker's measured ``critical`` batch when it has one, else B_simple). Following
    a measured batch, the factor is capped by the rate ``critical_batch`` found fastest at that
    batch (``lr_scale_at``): the rule's factor knows nothing of the stability edge."""

    MIN_STEPS = 2  # the fewest micro-batches that measure the noise

    def __init__(self, tracker: Any, steps: int, check_every: int) -> None:
        self.tracker, self.steps, self.check_every = tracker, steps, check_every
        self.lr_factor = 1.0
        self.changes: list[ScheduleChange] = []

    def after_update(self, updates: int, micro_batch_size: int | None) -> int:
        """The micro-batches for the next update (``updates`` made so far)."""
        if updates % self.check_every:
            return self.steps
        b_simple, error, reason = self.tracker._estimate()
        critical = self.tracker.critical
        schedule = plan_batch(b_simple, error, micro_batch_size=micro_batch_size,
                              steps=self.steps, max_batch_size=self.tracker.max_batch_size,
                              fits_batch_size=self.tracker.fits_batch_size,
                              min_steps=self.MIN_STEPS, reason=reason,
                              **(critical.schedule_options() if critical else {}))
        if schedule.steps <= self.steps:  # a ramp: only up
            return self.steps
        self.lr_factor *= schedule.lr_factor
        measured = (critical.lr_scale_at(schedule.batch_size)
                    if critical is not None and schedule.source.startswith("critical_batch")
                    else None)
        if measured is not None:  # no faster than critical_batch found stable at that batch
            self.lr_factor = min(self.lr_factor, measured)
        self.changes.append(ScheduleChange(
            update=updates, steps_before=self.steps, steps_after=schedule.steps,
            batch_size=schedule.batch_size if micro_batch_size is not None else None,
            b_simple=b_simple, b_simple_error=error, lr_factor=self.lr_factor,
            source=schedule.source, critical_batch_size=schedule.critical_batch_size
            if schedule.source == "critical_batch" else None))
        self.steps = schedule.steps
        return self.steps
