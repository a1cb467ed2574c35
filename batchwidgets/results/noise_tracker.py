"""``NoiseTrackerReport``: what a ``NoiseTracker`` saw during training, one ``NoisePoint`` per
measured update."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import _html
from ._noise_theory import compare_estimates, examples_over_min, noise_advice, steps_over_min
from ._text import Short, TextForm
from .critical import CriticalBatchReport
from .schedule import BatchSchedule, accumulation_advice, plan_batch


@dataclass(frozen=True)
class NoisePoint(Short):
    """One measured update of the history: B_simple (None during the warm-up or while not
    measurable), its standard error, and the moving averages of |G|^2 and tr(Sigma) then. It
    unpacks and indexes as the 4-tuple the history held before:
    ``for update, b_simple, grad_norm_sq, trace_cov in report.history``."""

    update: int
    b_simple: float | None
    grad_norm_sq: float
    trace_cov: float
    b_simple_error: float | None = None

    def _as_tuple(self) -> tuple[int, float | None, float, float]:
        return self.update, self.b_simple, self.grad_norm_sq, self.trace_cov

    def __iter__(self) -> Iterator[object]:
        return iter(self._as_tuple())

    def __getitem__(self, index: int | slice) -> object:
        return self._as_tuple()[index]

    def __len__(self) -> int:
        return 4


LOSS_WINDOW = 100  # losses behind NoiseTrackerReport's rolling mean and std


@dataclass(frozen=True)
class NoiseTrackerReport(TextForm):
    """What ``NoiseTracker`` saw: per-batch losses and the online gradient noise scale.

    ``grad_norm_sq`` and ``trace_cov`` are the moving averages of the two-batch-size estimates
    (McCandlish et al. 2018, appendix A.1), in units of samples, or of micro-batches when the
    micro-batch size is unknown. ``b_simple`` is their ratio, None unless ``measurable``.
    """

    # one point per measured update; long series stay out of the repr (they print as a count)
    history: tuple[NoisePoint, ...] = field(repr=False)
    losses: tuple[float, ...] = field(repr=False)  # per batch, oldest first (bounded)
    b_simple: float | None  # trace_cov / grad_norm_sq; None while not measurable
    b_simple_error: float | None  # one standard error (delta method)
    grad_norm_sq: float | None  # moving average of the |G|^2 estimates (can dip below 0)
    trace_cov: float | None  # moving average of the tr(Sigma) estimates
    measurable: bool
    reason: str  # why b_simple is None; '' when measurable
    n_updates: int  # updates that gave an estimate
    micro_batch_size: int | None  # None: unknown, sizes are counted in micro-batches
    effective_batch_size: int | None  # samples per update
    grad_norm_sq_error: float | None = None  # standard errors of the moving averages
    trace_cov_error: float | None = None
    n_micro: int | None = None  # micro-batches averaged per update
    ema: float = 0.9
    # B_simple's standard error at each history point (the points' b_simple_error; given for a
    # history of plain 4-tuples, the form before NoisePoint)
    history_errors: tuple[float | None, ...] = field(default=(), repr=False)
    n_losses: int | None = None  # losses seen in all (``losses`` keeps the latest); None: len
    measured_by: str = "micro-batches"  # or "split batches": NoiseTracker.measure
    every: int = 1  # NoiseTracker.measure measured every ``every``-th call
    warnings: tuple[str, ...] = ()  # what makes these numbers less exact (e.g. no shuffling)
    # per-example losses given to observe_loss (reduction='none'): how many, their mean and
    # standard deviation (n - 1); a batch of B such examples has a loss std of about std/sqrt(B)
    n_examples: int = 0
    example_loss_mean: float | None = None
    example_loss_std: float | None = None
    # bounds of ``schedule`` (NoiseTracker(max_batch_size=..., fits=...)); see
    # NOTE [ The batch-size schedule ] in results/schedule.py
    max_batch_size: int | None = None
    fits_batch_size: int | None = None
    # sampling (NoiseTracker(overhead_target=...)): 1 update in ``sample_every`` measured, the
    # tracker's measured cost at that rate (a share of the step time) and the target it keeps
    sample_every: int = 1
    overhead: float | None = field(default=None, compare=False)  # a timing: never equal twice
    overhead_target: float | None = None
    n_updates_seen: int | None = None  # updates in all, measured or not; None: n_updates
    # per optimizer step, the share of its wall time spent waiting for data (trainer callbacks)
    data_stall_shares: tuple[float, ...] = field(default=(), repr=False)
    # the critical batch measured by critical_batch (NoiseTracker(critical=...)): the schedule
    # follows it instead of B_simple while it is measurable
    critical: CriticalBatchReport | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        errors = self.history_errors or (None,) * len(self.history)
        points = tuple(p if isinstance(p, NoisePoint) else NoisePoint(**p)
                       if isinstance(p, dict) else NoisePoint(*p, b_simple_error=e)
                       for p, e in zip(self.history, errors))  # a dict: from asdict
        object.__setattr__(self, "history", points)
        object.__setattr__(self, "history_errors", tuple(p.b_simple_error for p in points))

    @property
    def schedule(self) -> BatchSchedule:
        """The batch size to use from here and its learning-rate factor (NOTE [ The batch-size
        schedule ]), bounded by the tracker's ``max_batch_size``; ``fits_batch_size`` says
        whether it needs accumulation."""
        return plan_batch(self.b_simple, self.b_simple_error,
                          micro_batch_size=self.micro_batch_size, steps=self.n_micro or 1,
                          max_batch_size=self.max_batch_size,
                          fits_batch_size=self.fits_batch_size, reason=self.reason,
                          **(self.critical.schedule_options() if self.critical else {}))

    @property
    def measured_critical(self) -> CriticalBatchReport | None:
        """``critical`` when it holds a number (``critical_batch`` measured one), else None."""
        return self.critical if self.critical is not None and self.critical.measurable else None

    @property
    def accumulation_advice(self) -> str:
        """When the accumulated batch is well above B_simple: the steps it saves against the
        examples it spends, with numbers; '' otherwise."""
        return accumulation_advice(self.b_simple, self.b_simple_error, self.micro_batch_size,
                                   self.n_micro)

    @property
    def data_stall_share(self) -> float | None:
        """Mean share of a step's wall time spent waiting for data (trainer callbacks)."""
        shares = self.data_stall_shares
        return sum(shares) / len(shares) if shares else None

    @property
    def sampling(self) -> str:
        """Which updates were measured, and why (the error bar is over those alone)."""
        seen = self.n_updates_seen if self.n_updates_seen is not None else self.n_updates
        if self.sample_every == 1 and self.overhead_target is None:
            return f"every update ({self.n_updates} of {seen})"
        cost = (f", measured cost {100 * self.overhead:.2g}% of the step time"
                if self.overhead is not None else "")
        target = (f" to stay under {100 * self.overhead_target:.2g}%"
                  if self.overhead_target is not None else "")
        return (f"1 update in {self.sample_every}{target}{cost} ({self.n_updates} of {seen} "
                f"updates measured; B_simple's error bar is over those)")

    @property
    def n_losses_seen(self) -> int:
        """Losses recorded in all, the ones no longer kept included."""
        return self.n_losses if self.n_losses is not None else len(self.losses)

    @property
    def current_batch_size(self) -> int | None:
        """The batch of one update, in ``unit`` (micro-batches when their size is unknown)."""
        return self.effective_batch_size or self.n_micro

    @property
    def steps_over_min(self) -> float | None:
        """S / S_min at the current batch (see NOTE [ The steps-versus-examples trade-off ])."""
        if not self.measurable or not self.current_batch_size:
            return None
        return steps_over_min(self.b_simple, self.current_batch_size)

    @property
    def examples_over_min(self) -> float | None:
        """E / E_min at the current batch."""
        if not self.measurable or not self.current_batch_size:
            return None
        return examples_over_min(self.b_simple, self.current_batch_size)

    @property
    def loss_window(self) -> int:
        """The default window of ``rolling_loss``: a tenth of the losses kept, in [2, 100]."""
        return min(max(len(self.losses) // 10, 2), LOSS_WINDOW)

    def rolling_loss(self, window: int | None = None) -> tuple[tuple[float, ...],
                                                                tuple[float, ...]]:
        """Trailing mean and standard deviation (n - 1; 0 for a single loss) of ``losses`` over
        ``window`` batches (default ``loss_window``), one pair per loss."""
        n = len(self.losses)
        window = window or self.loss_window
        shift = self.losses[0] if n else 0.0  # shifted sums keep small spreads exact
        sums, squares, means, stds = [0.0], [0.0], [], []
        for i, loss in enumerate(self.losses):
            sums.append(sums[-1] + loss - shift)
            squares.append(squares[-1] + (loss - shift) ** 2)
            count = min(i + 1, window)
            total, total_sq = sums[-1] - sums[-1 - count], squares[-1] - squares[-1 - count]
            means.append(shift + total / count)
            variance = (total_sq - total * total / count) / (count - 1) if count > 1 else 0.0
            stds.append(math.sqrt(max(variance, 0.0)))
        return tuple(means), tuple(stds)

    @property
    def extra_compute(self) -> float | None:
        """NoiseTracker.measure's cost: one more forward and backward of a batch on 1 step in
        ``every``, a share of the training's compute; None under accumulate (no extra pass)."""
        return 1 / self.every if self.measured_by == "split batches" else None

    @property
    def measurement(self) -> str:
        """How the noise scale was measured, and what that costs."""
        if self.n_micro is None:
            return "not measured yet"
        if self.measured_by == "split batches":
            steps = "every step" if self.every == 1 else f"1 step in {self.every}"
            return (f"on {steps}, splitting the batch into {self.n_micro} parts: one extra "
                    f"forward and backward of the batch per measured step, about "
                    f"{100 * self.extra_compute:.3g}% more compute")
        return (f"from the {self.n_micro} micro-batches of each update: by default one "
                f"gradient-norm reduction per parameter per micro-step (with "
                f"every_micro_batch=False, one fused reduction per update), and no host sync "
                f"per update (the tracker reads the device when its report is read)")

    @property
    def n_losses_recent(self) -> int:
        """The losses behind ``loss_mean`` and ``loss_std``: the last ``LOSS_WINDOW``."""
        return len(self.losses[-LOSS_WINDOW:])

    @property
    def loss_mean(self) -> float | None:
        """Mean of the last ``LOSS_WINDOW`` losses."""
        window = self.losses[-LOSS_WINDOW:]
        return sum(window) / len(window) if window else None

    @property
    def loss_std(self) -> float | None:
        """Standard deviation (n - 1) of the last ``LOSS_WINDOW`` losses."""
        window = self.losses[-LOSS_WINDOW:]
        if len(window) < 2:
            return None
        mean = sum(window) / len(window)
        return math.sqrt(sum((x - mean) ** 2 for x in window) / (len(window) - 1))

    @property
    def unit(self) -> str:
        return "samples" if self.micro_batch_size is not None else "micro-batches"

    @property
    def advice(self) -> str:
        """The critical batch size, the steps-versus-examples trade-off at the current batch,
        the learning rate for another batch size, how it was measured and any warnings."""
        if self.measurable:
            text = noise_advice(self.b_simple, self.b_simple_error, self.unit, (),
                                self.current_batch_size)
            if self.accumulation_advice:
                text = f"{self.accumulation_advice} {text}"
            text += f" Schedule: {self.schedule.summary()}."
            if self.micro_batch_size is None:
                text += " (The micro-batch size is unknown: pass model= to accumulate.)"
        else:
            text = (f"critical batch size: {self.reason}. Learning rate: scale it linearly "
                    f"with the batch size up to about B_simple, with a warm-up over the first "
                    f"few epochs (Goyal et al. 2017).")
        if self.measured_critical is not None:
            text = (f"Measured (critical_batch): {self.measured_critical.summary()}; the "
                    f"schedule follows it, not B_simple, which only estimates it. {text}")
            if self.b_simple_comparison:
                text += f" {self.b_simple_comparison}."
            if not self.measurable:
                text += f" Schedule: {self.schedule.summary()}."
        if self.measured_by == "split batches":
            text += f" Measured {self.measurement}."
        return " ".join([text, *(f"Warning: {w}." for w in self.warnings)])

    @property
    def b_simple_basis(self) -> str:
        """What B_simple rests on, in words: "live, over 140 updates"."""
        return f"live, over {self.n_updates} updates"

    @property
    def b_simple_comparison(self) -> str:
        """The tracker's B_simple beside the one ``critical_batch`` measured at its weights,
        with whether they differ by more than their errors; '' without both (in samples)."""
        critical = self.critical
        if (critical is None or critical.b_simple is None or not self.measurable
                or self.unit != "samples"):
            return ""
        return compare_estimates(
            "B_simple", (self.b_simple, self.b_simple_error, self.b_simple_basis),
            (critical.b_simple, critical.b_simple_error,
             f"at critical_batch's weights, {critical.b_simple_basis}"))

    def batch_choice(self) -> list[tuple[str, object]]:
        """What batch to train at, with both numbers behind it and when to trust each: the
        rows of the NoisePanel's section."""
        number = _html.format_number
        critical = self.critical
        if critical is None:
            measured = ("not measured: %critical_batch MODEL DATA --noise NAME, or "
                        "tracker.critical = bw.critical_batch(model, data, optimizer=...)")
        elif not critical.measurable:
            measured = f"not measurable: {critical.reason}"
        else:
            estimate = _html.format_estimate(critical.critical_batch_size,
                                             critical.critical_batch_size_error)
            measured = (f"{estimate} samples, to loss {number(critical.target_loss)} from "
                        f"{number(critical.start_loss)} ({critical.examples} examples spent)")
        noise = (f"{_html.format_estimate(self.b_simple, self.b_simple_error)} {self.unit}, "
                 f"{self.b_simple_basis}" if self.measurable else self.reason)
        if self.b_simple_comparison:
            noise += f" ({self.b_simple_comparison})"
        schedule = self.schedule
        return [
            ("train at", schedule.summary() if schedule.source != "none" else
             "- (nothing measured yet)"),
            ("critical batch, measured (critical_batch)", measured),
            ("B_simple, the gradient noise scale", noise),
            ("which to trust", "the measured critical batch: it is the definition (twice the "
                               "fewest steps and examples to a loss), measured by training, at "
                               "the weights and target it names; it grows as the loss falls, so "
                               "measure it again at checkpoints. B_simple follows training for "
                               "a few percent of its time, but only estimates it (within 2x "
                               "early in training on our benchmarks, 2-6x off on plateaus): a "
                               "direction, not a number"),
        ]

    def summary(self) -> str:
        if not self.measurable:
            return f"B_simple: {self.reason} ({self.n_updates} updates, {len(self.losses)} losses)"
        return (f"B_simple {_html.format_number(self.b_simple)} ± "
                f"{_html.format_number(self.b_simple_error, 2)} {self.unit} "
                f"after {self.n_updates} updates")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        def plus_minus(value: float | None, error: float | None) -> str:
            if value is None:
                return "-"
            return f"{_html.format_number(value)} ± {_html.format_number(error, 2)}"

        return [
            (f"B_simple ({self.unit})", plus_minus(self.b_simple, self.b_simple_error)
             if self.measurable else self.reason),
            ("|G|^2 (moving average)", plus_minus(self.grad_norm_sq, self.grad_norm_sq_error)),
            ("tr(Sigma) (moving average)", plus_minus(self.trace_cov, self.trace_cov_error)),
            ("updates measured", self.n_updates),
            ("micro-batch size", self.micro_batch_size or "unknown"),
            ("effective batch size", self.effective_batch_size or "-"),
            ("steps / S_min, examples / E_min", f"{_html.format_number(self.steps_over_min)}, "
                                                f"{_html.format_number(self.examples_over_min)}"),
            (f"loss (last {self.n_losses_recent}): mean / std",
             f"{_html.format_number(self.loss_mean)} / {_html.format_number(self.loss_std)}"),
            ("per-example loss: mean / std (reduction='none')",
             f"{_html.format_number(self.example_loss_mean)} / "
             f"{_html.format_number(self.example_loss_std)} over {self.n_examples} examples"
             if self.n_examples else "-"),
            ("measured", self.measurement),
            ("updates measured (sampling)", self.sampling),
            ("critical batch (measured by critical_batch)",
             _html.format_estimate(self.measured_critical.critical_batch_size,
                                   self.measured_critical.critical_batch_size_error)
             if self.measured_critical is not None else "-"),
            ("schedule from here", self.schedule.summary()
             if self.measurable or self.measured_critical is not None else "-"),
            ("waiting for data (share of step)", f"{100 * self.data_stall_share:.3g}%"
             if self.data_stall_share is not None else "-"),
            ("advice", self.advice),
        ]

    def summary_table(self) -> str:
        """The report's HTML table without the picture (the live panel draws its own)."""
        return _html.table(self.rows(), caption="batchwidgets: NoiseTracker")

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: NoiseTracker", self.rows())
