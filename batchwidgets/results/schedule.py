"""The batch-size schedule from the measured noise scale: ``BatchSchedule`` (what to use from here),
``ScheduleChange`` (what ``accumulate(steps="auto")`` changed) and the rule behind both
(``plan_batch``), plus when accumulating does not pay (``accumulation_advice``). Standard library.

Usage:
    >>> s = plan_batch(b_simple=70.0, b_simple_error=5.0, micro_batch_size=8, steps=2)
    >>> s.batch_size, s.steps, round(s.lr_factor, 2)
    (64, 8, 2.57)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import _html
from ._noise_theory import NOISE_SCALE_RULE, examples_over_min, lr_scale, steps_over_min
from ._text import Short, TextForm

# NOTE [ The batch-size schedule ]
# McCandlish et al. 2018 (eq. 2.11): at batch B, training to a loss takes S_min(1 + B_noise/B)
# steps and E_min(1 + B/B_noise) examples; B ~ B_noise spends 2x each, the knee of the trade-off.
# B_noise (estimated by B_simple) grows as the loss falls, so the batch that balances the two
# grows during training; following it (a batch-size warm-up) took 43% fewer steps for the same
# loss in Merrill et al. 2025 ("Critical batch size revisited", Ai2). The rule here:
# * the batch to use is B_simple, rounded in log space to the micro-batch times a power of two
#   (within a factor sqrt(2) of B_simple, both costs within 2.5x of their minimum, and few
#   changes: one each time B_simple doubles);
# * bounded by the user's max_batch_size, and at least min_steps micro-batches (accumulate's
#   "auto" keeps 2, the fewest that measure the noise);
# * the learning rate follows eps_opt(B) ~ 1/(1 + B_simple/B) (their eq. 2.7; lr_scale in
#   _noise_theory.py): linear scaling well below B_simple, flat above;
# * accumulate(steps="auto") only ramps up (a warm-up, as in the paper): a B_simple that dips
#   with the noise of its estimate does not shrink the batch back.
# The largest batch that fits (find_batch) bounds the micro-batch, not the batch: above it, the
# batch needs accumulation; below it, one batch of that size needs none (``needs_accumulation``).
# A critical batch measured by its definition (``critical_batch``: branched runs to a target
# loss) takes B_simple's place wherever one is given: B_simple is a proxy for it, off by 2-3x
# either way on the project's benchmarks. ``source`` says which number the schedule used. The
# measured number holds for the weights it was measured at: measured again at checkpoints, it
# makes a batch ramp (benchmarks/batch_ramp.py).
WELL_ABOVE = 2.0  # a batch this many times B_simple is "well above": E >= 3 E_min, S <= 1.5 S_min


@dataclass(frozen=True)
class BatchSchedule(TextForm):
    """The batch size to use from here, from the measured noise scale (NOTE [ The batch-size
    schedule ]), in ``unit`` (samples, or micro-batches when their size is unknown)."""

    batch_size: int  # the batch per update to use from here
    steps: int  # micro-batches of micro_batch_size per update: accumulate(steps=...)
    lr_factor: float  # multiply the learning rate by this when going to batch_size
    current_batch_size: int | None  # the batch per update now
    micro_batch_size: int | None  # the loop's micro-batch; None: unknown (unit micro-batches)
    b_simple: float | None
    b_simple_error: float | None
    max_batch_size: int | None = None  # the user's bound
    fits_batch_size: int | None = None  # the largest batch that fits in memory (find_batch)
    unit: str = "samples"
    reason: str = ""
    # the critical batch measured by critical_batch, when one was given (samples)
    critical_batch_size: float | None = None
    critical_batch_size_error: float | None = None
    # the number the batch follows: "critical_batch" (measured), "critical_batch_bound" (B_simple
    # held to the side of the ladder critical_batch found it on), "b_simple", "none"
    source: str = "b_simple"
    # the batch the rule followed (samples, or micro-batches): the measured critical batch,
    # B_simple, or the bound critical_batch found; None when nothing was measured
    b_noise: float | None = None

    @property
    def changes(self) -> bool:
        return self.batch_size != self.current_batch_size

    @property
    def needs_accumulation(self) -> bool:
        """Whether ``batch_size`` needs accumulation: it does not fit in memory as one batch
        (unknown without ``fits_batch_size``: then whenever it is several micro-batches)."""
        if self.fits_batch_size is not None and self.unit == "samples":
            return self.batch_size > self.fits_batch_size
        return self.steps > 1

    def summary(self) -> str:
        micro = self.micro_batch_size or 1
        how = (f"{self.steps} micro-batches of {micro}" if self.needs_accumulation else
               f"one batch of {self.batch_size}, no accumulation needed")
        return (f"batch size {self.batch_size} {self.unit} ({how}), learning rate "
                f"{self.lr_text}: {self.reason}")

    @property
    def lr_text(self) -> str:
        """The learning-rate factor with its rule: "from B = 16 to B' = 64: ×2.57 by the
        noise-scale rule at B_noise = 70"."""
        if self.b_noise is None:
            return f"×{_html.format_number(self.lr_factor)} (nothing measured to follow)"
        return (f"from B = {self.current_batch_size} to B' = {self.batch_size}: "
                f"×{_html.format_number(self.lr_factor)} by {NOISE_SCALE_RULE} at B_noise = "
                f"{_html.format_number(self.b_noise)}")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        return [
            ("batch size from here", f"{self.batch_size} {self.unit}"),
            ("micro-batches per update (accumulate steps)", self.steps),
            ("learning-rate factor", self.lr_text),
            ("current batch size", self.current_batch_size or "-"),
            ("follows", {"critical_batch": "the measured critical batch",
                         "critical_batch_bound": "B_simple within critical_batch's bound",
                         "b_simple": "B_simple (the noise scale)"}.get(self.source,
                                                                        "nothing measured")),
            ("critical batch (measured)", _html.format_estimate(
                self.critical_batch_size, self.critical_batch_size_error)
             if self.critical_batch_size is not None else "-"),
            ("B_simple", _html.format_estimate(self.b_simple, self.b_simple_error)),
            ("bounds: max / fits in memory", f"{self.max_batch_size or '-'} / "
                                             f"{self.fits_batch_size or '-'}"),
            ("why", self.reason),
        ]

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: batch-size schedule", self.rows(),
                                 plot=False)


@dataclass(frozen=True)
class ScheduleChange(Short):
    """One change ``accumulate(steps="auto")`` made: at which update, from and to how many
    micro-batches, the B_simple behind it and the learning-rate factor in force after it."""

    update: int  # optimizer updates made before the change
    steps_before: int
    steps_after: int
    batch_size: int | None  # samples per update after the change (None: micro-batch unknown)
    b_simple: float | None
    b_simple_error: float | None
    lr_factor: float  # on the loop's learning rate, from this update on (cumulative)
    source: str = "b_simple"  # the number followed: "critical_batch" or "b_simple"
    critical_batch_size: float | None = None  # the measured one, when followed


def _nearest_power_of_two(x: float) -> int:
    return 2 ** max(0, round(math.log2(x))) if x >= 1 else 1


def plan_batch(b_simple: float | None, b_simple_error: float | None, *,
               micro_batch_size: int | None, steps: int, max_batch_size: int | None = None,
               fits_batch_size: int | None = None, min_steps: int = 1,
               reason: str = "", critical_batch_size: float | None = None,
               critical_batch_size_error: float | None = None,
               critical_bound: tuple[str, float] | None = None) -> BatchSchedule:
    """The schedule's batch from here (see NOTE [ The batch-size schedule ]): for a loop that
    feeds micro-batches of ``micro_batch_size`` (None: sizes in micro-batches) ``steps`` at a
    time, B_simple in the same unit. ``reason``: why B_simple is None, if it is. A measured
    ``critical_batch_size`` (samples) is followed instead of B_simple when given; a
    ``critical_bound`` (``("above", 512)``: critical_batch found it past its ladder) bounds
    B_simple (or stands for it)."""
    micro = micro_batch_size or 1
    unit = "samples" if micro_batch_size is not None else "micro-batches"
    current = micro * steps
    common: dict[str, Any] = {
        "current_batch_size": current, "micro_batch_size": micro_batch_size,
        "b_simple": b_simple, "b_simple_error": b_simple_error,
        "max_batch_size": max_batch_size, "fits_batch_size": fits_batch_size, "unit": unit,
        "critical_batch_size": critical_batch_size,
        "critical_batch_size_error": critical_batch_size_error}
    number = _html.format_number
    measured = critical_batch_size is not None and math.isfinite(critical_batch_size) and (
        critical_batch_size > 0)
    has_b_simple = b_simple is not None and math.isfinite(b_simple) and b_simple > 0
    if measured and micro_batch_size is not None:
        b_noise, source = critical_batch_size, "critical_batch"
        why = (f"the measured critical batch ≈ "
               f"{_html.format_estimate(critical_batch_size, critical_batch_size_error)} "
               f"samples (critical_batch)")
    elif critical_bound is not None and micro_batch_size is not None:
        side, edge = critical_bound
        pick = max if side == "above" else min
        b_noise = pick(b_simple, edge) if has_b_simple else edge
        source = "critical_batch_bound"
        why = (f"critical_batch found the critical batch {side} {number(edge)} samples"
               + (f"; B_simple ≈ {number(b_simple)} {unit}" if has_b_simple else "")
               + (f", so {number(b_noise)}" if b_noise == edge else ", within it"))
    elif b_simple is None or not math.isfinite(b_simple) or b_simple <= 0:
        unknown = (" (a measured critical batch is in samples: pass model= to accumulate so "
                   "the micro-batch size is known)" if measured else "")
        return BatchSchedule(batch_size=current, steps=steps, lr_factor=1.0,
                             reason=f"keep the batch: {reason or 'B_simple is not measured'}"
                                    f"{unknown}", source="none", **common)
    else:
        b_noise, source = b_simple, "b_simple"
        why = f"B_simple ≈ {number(b_simple)} {unit}"
        if measured:
            why += (" (the measured critical batch is in samples and the micro-batch size is "
                    "unknown)")
    target = max(_nearest_power_of_two(b_noise / micro), min_steps)
    why += f", rounded to {micro} × a power of two"
    if max_batch_size is not None and target * micro > max_batch_size:
        target = max(max_batch_size // micro, 1)
        why += f", bounded by max_batch_size={max_batch_size}"
    batch = target * micro
    return BatchSchedule(batch_size=batch, steps=target,
                         lr_factor=lr_scale(b_noise, current, batch), reason=why, source=source,
                         b_noise=b_noise, **common)


def accumulation_advice(b_simple: float | None, b_simple_error: float | None,
                        micro_batch_size: int | None, n_micro: int | None) -> str:
    """When a batch made of ``n_micro`` micro-batches is well above B_simple (``WELL_ABOVE``):
    the steps it saves against the examples it spends, in numbers; else ''."""
    if b_simple is None or not n_micro or n_micro < 2 or not b_simple > 0:
        return ""
    micro = micro_batch_size or 1
    unit = "samples" if micro_batch_size is not None else "micro-batches"
    batch = micro * n_micro
    if batch < WELL_ABOVE * b_simple:
        return ""
    number = _html.format_number
    fewer = plan_batch(b_simple, b_simple_error, micro_batch_size=micro_batch_size,
                       steps=n_micro).steps
    alone = (f"; a micro-batch of {micro} alone (no accumulation): "
             f"{number(steps_over_min(b_simple, micro), 3)}× the steps and "
             f"{number(examples_over_min(b_simple, micro), 3)}× the examples"
             if fewer > 1 and micro < WELL_ABOVE * b_simple else "")
    return (f"Accumulating to this batch does not pay: B = {batch} {unit} ({n_micro} "
            f"micro-batches) is {number(batch / b_simple)}× B_simple ≈ {number(b_simple)} ± "
            f"{number(b_simple_error, 2)}, so it takes S_min·(1 + B_simple/B) = "
            f"{number(steps_over_min(b_simple, batch), 3)}× the fewest steps for "
            f"E_min·(1 + B/B_simple) = {number(examples_over_min(b_simple, batch), 3)}× the "
            f"fewest examples. With {fewer} micro-batch{'es' if fewer > 1 else ''} (B = "
            f"{fewer * micro}): {number(steps_over_min(b_simple, fewer * micro), 3)}× the steps "
            f"and {number(examples_over_min(b_simple, fewer * micro), 3)}× the examples{alone}. "
            f"Use fewer micro-batches per update (or none), with the learning rate from B = "
            f"{batch} to B' = {fewer * micro}: ×{number(lr_scale(b_simple, batch, fewer * micro))}"
            f" by {NOISE_SCALE_RULE} at B_simple = {number(b_simple)}.")
