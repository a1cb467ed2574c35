"""Reports: frozen dataclasses that display themselves. Standard library only (no torch/Jupyter).

Usage:
    >>> from batchwidgets.results import Attempt, BatchSizeReport
    >>> r = BatchSizeReport(max_batch_size=96, first_oom_batch_size=97,
    ...                     attempts=(Attempt(96, True, 2**20, 0.1),
    ...                               Attempt(97, False, None, None)),
    ...                     device="cpu", budget_bytes=2**20)
    >>> r.recommended_batch_size
    86
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass

from . import _html


@dataclass(frozen=True)
class Attempt:
    """One trial of the probe: did ``batch_size`` train, and what did it cost."""

    batch_size: int
    fits: bool
    peak_memory_bytes: int | None  # tensor bytes at the peak of the step (None if unmeasured)
    step_time_s: float | None  # one steady-state step (the last of the trial); None on OOM
    peak_reserved_bytes: int | None = None  # CUDA caching allocator's peak; None elsewhere
    activation_peak_bytes: int | None = None  # forward+backward peak, what the model is fitted on
    error: str = ""  # first line of the out-of-memory message when it did not fit

    @property
    def samples_per_s(self) -> float | None:
        if not self.fits or not self.step_time_s:
            return None
        return self.batch_size / self.step_time_s


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory as ``fixed_bytes + per_sample_bytes * batch_size``, fitted on measured steps."""

    fixed_bytes: float
    per_sample_bytes: float

    def predict_bytes(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def largest_batch_size(self, limit_bytes: float, multiple_of: int = 1) -> int | None:
        """Largest multiple of ``multiple_of`` predicted to fit in ``limit_bytes``, or None."""
        if self.per_sample_bytes <= 0:
            return None
        size = int((limit_bytes - self.fixed_bytes) // self.per_sample_bytes)
        return max(0, size // multiple_of * multiple_of)


def attempts_table(attempts: tuple[Attempt, ...] | list[Attempt]) -> str:
    """The probe's attempts as an escaped HTML table (the report's and the live panel's)."""
    rows = [(a.batch_size, "yes" if a.fits else "OOM", _html.format_bytes(a.peak_memory_bytes),
             _html.format_number(a.step_time_s), _html.format_number(a.samples_per_s, 4))
            for a in attempts]
    return _html.table(rows, caption="attempts, in order",
                       header=("batch size", "fits", "peak memory", "step s", "samples/s"))


# A smaller size must beat the largest one by this much (samples/s) to be preferred: fewer
# trials than a throughput curve needs, so small timing noise must not flip the recommendation.
FASTER_BY = 1.10


@dataclass(frozen=True)
class BatchSizeReport:
    """What ``find_batch`` found: the largest batch size that trained, and every attempt."""

    max_batch_size: int  # largest size that ran (0 only inside NoBatchSizeFits)
    first_oom_batch_size: int | None  # smallest size that ran out of memory, None if none did
    attempts: tuple[Attempt, ...]
    device: str
    budget_bytes: int | None  # the cap the user asked for, None for the whole device
    limit_bytes: int | None = None  # the memory the search aimed at: budget or device capacity
    baseline_bytes: int | None = None  # memory held before the first step (weights, state)
    memory_model: MemoryModel | None = None
    headroom: float = 0.9  # recommended size is at most headroom * max_batch_size
    multiple_of: int = 1
    amp: str | None = None
    stop_reason: str = "boundary"  # boundary | max_batch_size | ceiling | nothing fits

    @property
    def n_attempts(self) -> int:
        return len(self.attempts)

    @property
    def n_ooms(self) -> int:
        return sum(not a.fits for a in self.attempts)

    @property
    def _headroom_batch_size(self) -> int:
        m = self.multiple_of
        return max(min(m, self.max_batch_size), int(self.headroom * self.max_batch_size) // m * m)

    @property
    def _faster_smaller_attempt(self) -> Attempt | None:
        if self.device.startswith("cpu"):
            return None  # CPU step times include the probe's op-by-op memory tracking
        ran = [a for a in self.attempts if a.fits and a.samples_per_s]
        if not ran:
            return None
        fastest = max(ran, key=lambda a: a.samples_per_s)
        largest = max(ran, key=lambda a: a.batch_size)
        if (fastest.batch_size < self._headroom_batch_size
                and fastest.samples_per_s >= FASTER_BY * largest.samples_per_s):
            return fastest
        return None

    @property
    def recommended_batch_size(self) -> int:
        faster = self._faster_smaller_attempt
        return faster.batch_size if faster else self._headroom_batch_size

    @property
    def recommendation_rule(self) -> str:
        if self._faster_smaller_attempt:
            return (f"the fastest size measured: it ran at least {FASTER_BY - 1:.0%} more "
                    f"samples/s than the largest, so larger batches buy no throughput here")
        return (f"headroom {self.headroom:g} x max_batch_size, rounded down to a multiple of "
                f"{self.multiple_of}"
                + ("" if not self.device.startswith("cpu") else
                   " (on the CPU, step times include the probe's memory tracking, so they do "
                   "not rank throughput)"))

    @property
    def headroom_bytes(self) -> float | None:
        """Memory left under the limit at the recommended size, by the fitted model."""
        if self.memory_model is None or self.limit_bytes is None:
            return None
        return self.limit_bytes - self.memory_model.predict_bytes(self.recommended_batch_size)

    def with_headroom(self, headroom: float) -> BatchSizeReport:
        """The same measurements with another headroom (no re-probing)."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom should be in (0, 1], but got headroom={headroom!r}; "
                             f"use e.g. 0.9 to keep 10% of the memory free.")
        return dataclasses.replace(self, headroom=headroom)

    def summary(self) -> str:
        # one short line: the panel shows it beside its progress bar
        return (f"max_batch_size={self.max_batch_size}, "
                f"recommended_batch_size={self.recommended_batch_size} ({self.device}, "
                f"{self.n_attempts} tries, {self.n_ooms} OOM)")

    def _summary_rows(self) -> list[tuple[str, object]]:
        model = self.memory_model
        return [
            ("device", self.device),
            ("budget", _html.format_bytes(self.budget_bytes) if self.budget_bytes
             else "whole device"),
            ("max_batch_size", self.max_batch_size),
            ("first_oom_batch_size", self.first_oom_batch_size),
            ("recommended_batch_size", self.recommended_batch_size),
            ("rule", self.recommendation_rule),
            ("headroom at recommended", _html.format_bytes(self.headroom_bytes)),
            ("memory model", "-" if model is None else
             f"{_html.format_bytes(model.fixed_bytes)} + "
             f"{_html.format_bytes(model.per_sample_bytes)} per sample"),
            ("amp", self.amp or "off"),
            ("attempts",
             f"{self.n_attempts} ({self.n_ooms} out of memory); stop: {self.stop_reason}"),
        ]

    def _repr_html_(self) -> str:
        summary = _html.table(self._summary_rows(), caption="batchwidgets: find_batch")
        attempts = attempts_table(self.attempts)
        return f"<div>{summary}{attempts}{_html.inline_plot(self)}</div>"


@dataclass(frozen=True)
class AccumulationReport:
    """What ``accumulate`` did: micro-steps, real optimizer steps, and per micro-batch numbers."""

    steps: int  # micro-steps per real optimizer step
    micro_steps: int
    real_steps: int  # optimizer updates made, the remainder step included
    skipped_steps: int = 0  # real steps a GradScaler skipped for inf/NaN gradients
    remainder: str = "none"  # none | applied | dropped: micro-steps left when the block ended
    remainder_micro_steps: int = 0
    micro_batch_size: int | None = None  # first dimension of the model's input, else as planned
    world_size: int = 1
    target_batch_size: int | None = None  # the batch_size asked for, when steps was derived
    skips_allreduce: bool = False  # DDP all-reduce skipped on the first steps-1 micro-steps
    losses: tuple[float, ...] = ()  # per micro-batch, from loss.backward()
    grad_norms: tuple[float, ...] = ()  # L2 norm of each micro-batch's own gradient

    @property
    def effective_batch_size(self) -> int | None:
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.steps * self.world_size

    def summary(self) -> str:
        return (f"{self.micro_steps} micro-steps -> {self.real_steps} optimizer steps "
                f"(steps={self.steps}, effective batch {self.effective_batch_size or '?'}, "
                f"remainder {self.remainder})")

    def _repr_html_(self) -> str:
        rows = [
            ("micro-steps per update", self.steps),
            ("micro-steps", self.micro_steps),
            ("optimizer steps", self.real_steps),
            ("skipped by the GradScaler", self.skipped_steps),
            ("left over at the end", f"{self.remainder_micro_steps} ({self.remainder})"),
            ("micro-batch size", self.micro_batch_size or "-"),
            ("world size", self.world_size),
            ("effective batch size", self.effective_batch_size or "-"),
            ("asked for", self.target_batch_size or "-"),
            ("DDP all-reduce on micro-steps", "skipped" if self.skips_allreduce else "-"),
            ("last loss", _html.format_number(self.losses[-1] if self.losses else None)),
        ]
        table = _html.table(rows, caption="batchwidgets: accumulate")
        return f"<div>{table}{_html.inline_plot(self)}</div>"


@dataclass(frozen=True)
class LayerNoise:
    """One parameter's share of the gradient noise: the totals are the sums over all layers."""

    name: str  # as in model.named_parameters()
    trace_cov: float  # tr of this block's per-example gradient covariance (population, /N)
    grad_norm_sq: float  # |G|^2 of this block of the mean gradient

    @property
    def b_simple(self) -> float:
        return _ratio(self.trace_cov, self.grad_norm_sq)


def _ratio(trace_cov: float, grad_norm_sq: float) -> float:
    """B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of Large-Batch
    Training", eq. 2.8); inf when the mean gradient vanishes, nan when both do."""
    if grad_norm_sq > 0:
        return trace_cov / grad_norm_sq
    return math.inf if trace_cov > 0 else math.nan


def batch_variance(variance: float, n: int, batch_size: int, replacement: bool) -> float:
    """Variance of the mean of ``batch_size`` draws from ``n`` values of population variance
    ``variance``: ``variance / B`` with replacement, times the finite-population correction
    ``(N - B) / (N - 1)`` without (Cochran, "Sampling Techniques", 1977, thm. 2.2)."""
    if replacement:
        return variance / batch_size
    if not 1 <= batch_size <= n or n < 2:
        raise ValueError(f"batch_size should be between 1 and n={n} without replacement, but got "
                         f"batch_size={batch_size!r}; sample with replacement or use fewer.")
    return variance / batch_size * (n - batch_size) / (n - 1)


# NOTE [ The steps-versus-examples trade-off ]
# McCandlish et al. 2018, eq. 2.11: training to a given loss at batch size B takes about
#   S = S_min (1 + B_noise / B) optimizer steps and E = E_min (1 + B / B_noise) examples,
# with S_min the fewest steps (B -> infinity) and E_min the fewest examples (B -> 0); B_simple
# estimates B_noise. At B = B_simple both are twice their minimum: the critical batch size.
# Their eq. 2.7 gives the best SGD learning rate as eps_max / (1 + B_noise / B): linear in B
# well below B_noise (Goyal et al. 2017's linear scaling rule), flat well above it.
def steps_over_min(b_simple: float, batch_size: float) -> float:
    """S / S_min = 1 + B_simple / B: steps needed at batch size B over the fewest possible."""
    return 1 + b_simple / batch_size


def examples_over_min(b_simple: float, batch_size: float) -> float:
    """E / E_min = 1 + B / B_simple: examples needed at batch size B over the fewest possible."""
    return 1 + batch_size / b_simple


def lr_scale(b_simple: float, batch_size: float, new_batch_size: float) -> float:
    """Factor on the learning rate when the batch goes from B to B', from eps_opt(B) ~
    1 / (1 + B_simple / B); about B' / B (linear scaling) while both are well below B_simple."""
    return steps_over_min(b_simple, batch_size) / steps_over_min(b_simple, new_batch_size)


def noise_advice(b_simple: float, error: float | None, unit: str,
                 batch_sizes: tuple[int, ...], current: int | None) -> str:
    """The advice of both noise reports: the critical batch size, the steps-versus-examples
    trade-off at ``current`` (else at each of ``batch_sizes``) and the learning rate to use
    when changing the batch size. See NOTE [ The steps-versus-examples trade-off ]."""
    number = _html.format_number
    spread = f" ± {number(error, 2)}" if error is not None else ""
    sizes = (current,) if current else batch_sizes
    label = "the current batch" if current else "batch size"
    at = "; ".join(f"at {label} B = {b}: {number(steps_over_min(b_simple, b), 3)}× the fewest "
                   f"steps and {number(examples_over_min(b_simple, b), 3)}× the fewest examples"
                   for b in sizes)
    target = max(1, int(float(f"{b_simple:.2g}")))  # B_simple to 2 significant digits
    start = current or min(batch_sizes, default=1)
    return (f"critical batch size B_simple ≈ {number(b_simple)}{spread} {unit} (McCandlish et "
            f"al. 2018). Training at batch size B takes about S_min·(1 + B_simple/B) steps and "
            f"E_min·(1 + B/B_simple) examples, {at}; B ≈ B_simple balances the two (2× each), "
            f"and batches well above it spend many more examples to save few steps. Learning "
            f"rate: when the batch changes from B to B', multiply it by B'/B (linear scaling) "
            f"and warm it up over the first few epochs (Goyal et al. 2017), while B' stays "
            f"below about B_simple; from B = {start} to {target}: "
            f"×{number(lr_scale(b_simple, start, target))} (linear scaling: "
            f"×{number(target / start)}; the optimum, ∝ 1/(1 + B_simple/B), stops growing past "
            f"B_simple).")


@dataclass(frozen=True)
class NoiseReport:
    """What ``measure_noise`` found: gradient and loss noise over ``n_examples`` examples.

    ``grad_variance[B]`` is the variance (trace) of the mini-batch mean gradient at batch size B,
    for sampling with replacement if ``replacement`` else without (as a shuffling DataLoader
    does); both variants are there as ``grad_variance_with_replacement`` and
    ``grad_variance_without_replacement`` (the latter only for B <= n_examples).
    """

    trace_cov: float  # (1/N) sum_i |g_i - G|^2, population-normalised
    grad_norm_sq: float  # |G|^2, G = mean per-example gradient
    loss_mean: float  # mean per-example loss
    loss_variance: float  # (1/N) sum_i (l_i - mean)^2, population-normalised
    n_examples: int  # N, the examples measured
    n_available: int | None  # examples in the data (None: an iterable dataset not read to the end)
    sampled: bool  # True when N < the data's size (an evenly spaced, deterministic sample)
    batch_sizes: tuple[int, ...]
    replacement: bool = False  # which variant grad_variance and loss_variance_per_batch give
    method: str = "vmap"  # vmap | loop: how per-example gradients were computed
    layers: tuple[LayerNoise, ...] = ()
    eval_batchnorm: bool = False  # BatchNorm layers in train mode were measured in eval mode
    batch_size: int | None = None  # the DataLoader's batch size, when data was one
    warnings: tuple[str, ...] = ()  # what makes these numbers less exact (e.g. no shuffling)

    @property
    def b_simple(self) -> float:
        return _ratio(self.trace_cov, self.grad_norm_sq)

    @property
    def advice(self) -> str:
        """The critical batch size, the steps-versus-examples trade-off at the loader's batch
        size (else at each of ``batch_sizes``), and the learning rate for another batch size."""
        if not math.isfinite(self.b_simple) or self.b_simple <= 0:
            return (f"critical batch size: B_simple = {self.b_simple} is not finite (the mean "
                    f"gradient vanishes here: a converged model, or too few examples).")
        text = noise_advice(self.b_simple, None, "examples", self.batch_sizes, self.batch_size)
        return " ".join([text, *(f"Warning: {w}." for w in self.warnings)])

    def _per_batch(self, variance: float, replacement: bool) -> dict[int, float]:
        return {b: batch_variance(variance, self.n_examples, b, replacement)
                for b in self.batch_sizes if replacement or b <= self.n_examples}

    @property
    def grad_variance_with_replacement(self) -> dict[int, float]:
        return self._per_batch(self.trace_cov, True)

    @property
    def grad_variance_without_replacement(self) -> dict[int, float]:
        return self._per_batch(self.trace_cov, False)

    @property
    def grad_variance(self) -> dict[int, float]:
        return self._per_batch(self.trace_cov, self.replacement)

    @property
    def loss_variance_per_batch(self) -> dict[int, float]:
        """Variance of the mini-batch mean loss at each batch size (same sampling as above)."""
        return self._per_batch(self.loss_variance, self.replacement)

    def summary(self) -> str:
        return (f"B_simple {_html.format_number(self.b_simple)} from {self.n_examples} examples "
                f"(tr cov {_html.format_number(self.trace_cov)}, "
                f"|G|^2 {_html.format_number(self.grad_norm_sq)})")

    def _repr_html_(self) -> str:
        sampling = "with replacement" if self.replacement else "without replacement"
        rows = [
            ("B_simple = tr(cov) / |G|^2", _html.format_number(self.b_simple)),
            ("tr(cov) per example", _html.format_number(self.trace_cov)),
            ("|G|^2", _html.format_number(self.grad_norm_sq)),
            ("loss mean / variance", f"{_html.format_number(self.loss_mean)} / "
                                     f"{_html.format_number(self.loss_variance)}"),
            ("examples measured", f"{self.n_examples} of {self.n_available or '?'}"
                                  f"{' (sample)' if self.sampled else ''}"),
            ("per-example gradients", self.method),
            ("BatchNorm", "measured in eval mode" if self.eval_batchnorm else "-"),
            ("advice", self.advice),
        ]
        summary = _html.table(rows, caption="batchwidgets: measure_noise")
        with_r = self.grad_variance_with_replacement
        without_r = self.grad_variance_without_replacement
        losses = self.loss_variance_per_batch
        finite = math.isfinite(self.b_simple) and self.b_simple > 0
        batches = _html.table(
            [(b, _html.format_number(with_r.get(b)), _html.format_number(without_r.get(b)),
              _html.format_number(losses.get(b)),
              _html.format_number(steps_over_min(self.b_simple, b) if finite else None),
              _html.format_number(examples_over_min(self.b_simple, b) if finite else None))
             for b in self.batch_sizes],
            header=("batch size", "grad variance (with repl.)", "grad variance (without)",
                    f"loss variance ({sampling})", "steps / S_min", "examples / E_min"),
            caption="mini-batch gradient and loss variance; steps and examples to a given "
                    "loss, over their minimum")
        layers = _html.table(
            [(layer.name, _html.format_number(layer.trace_cov),
              _html.format_number(layer.grad_norm_sq), _html.format_number(layer.b_simple))
             for layer in self.layers],
            header=("parameter", "tr(cov)", "|G|^2", "B_simple"), caption="per layer")
        return f"<div>{summary}{batches}{layers}{_html.inline_plot(self)}</div>"


LOSS_WINDOW = 100  # losses behind NoiseTrackerReport's rolling mean and std


@dataclass(frozen=True)
class NoiseTrackerReport:
    """What ``NoiseTracker`` saw: per-batch losses and the online gradient noise scale.

    ``grad_norm_sq`` and ``trace_cov`` are the moving averages of the two-batch-size estimates
    (McCandlish et al. 2018, appendix A.1), in units of samples, or of micro-batches when the
    micro-batch size is unknown. ``b_simple`` is their ratio, None unless ``measurable``.
    """

    history: tuple[tuple[int, float | None, float, float], ...]  # (update, B_simple, |G|^2, trS)
    losses: tuple[float, ...]  # per batch, oldest first (bounded)
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
    history_errors: tuple[float | None, ...] = ()  # B_simple's standard error at each history entry
    n_losses: int | None = None  # losses seen in all (``losses`` keeps the latest); None: len
    measured_by: str = "micro-batches"  # or "split batches": NoiseTracker.measure
    every: int = 1  # NoiseTracker.measure measured every ``every``-th call
    warnings: tuple[str, ...] = ()  # what makes these numbers less exact (e.g. no shuffling)
    # per-example losses given to observe_loss (reduction='none'): how many, their mean and
    # standard deviation (n - 1); a batch of B such examples has a loss std of about std/sqrt(B)
    n_examples: int = 0
    example_loss_mean: float | None = None
    example_loss_std: float | None = None

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
    def measurement(self) -> str:
        """How the noise scale was measured, and what that costs."""
        if self.n_micro is None:
            return "not measured yet"
        if self.measured_by == "split batches":
            steps = "every step" if self.every == 1 else f"1 step in {self.every}"
            return (f"on {steps}, splitting the batch into {self.n_micro} parts: one extra "
                    f"forward and backward of the batch per measured step, about "
                    f"{100 / self.every:.3g}% more compute")
        return (f"from the {self.n_micro} micro-batches of each update: by default one "
                f"gradient-norm reduction per parameter per micro-step (with "
                f"every_micro_batch=False, one fused reduction per update), and no host sync "
                f"per update (the tracker reads the device when its report is read)")

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
            if self.micro_batch_size is None:
                text += " (The micro-batch size is unknown: pass model= to accumulate.)"
        else:
            text = (f"critical batch size: {self.reason}. Learning rate: scale it linearly "
                    f"with the batch size up to about B_simple, with a warm-up over the first "
                    f"few epochs (Goyal et al. 2017).")
        if self.measured_by == "split batches":
            text += f" Measured {self.measurement}."
        return " ".join([text, *(f"Warning: {w}." for w in self.warnings)])

    def summary(self) -> str:
        if not self.measurable:
            return f"B_simple: {self.reason} ({self.n_updates} updates, {len(self.losses)} losses)"
        return (f"B_simple {_html.format_number(self.b_simple)} ± "
                f"{_html.format_number(self.b_simple_error, 2)} {self.unit} "
                f"after {self.n_updates} updates")

    def summary_table(self) -> str:
        """The report's HTML table without the picture (the live panel draws its own)."""
        def plus_minus(value: float | None, error: float | None) -> str:
            if value is None:
                return "-"
            return f"{_html.format_number(value)} ± {_html.format_number(error, 2)}"

        rows = [
            (f"B_simple ({self.unit})", plus_minus(self.b_simple, self.b_simple_error)
             if self.measurable else self.reason),
            ("|G|^2 (moving average)", plus_minus(self.grad_norm_sq, self.grad_norm_sq_error)),
            ("tr(Sigma) (moving average)", plus_minus(self.trace_cov, self.trace_cov_error)),
            ("updates measured", self.n_updates),
            ("micro-batch size", self.micro_batch_size or "unknown"),
            ("effective batch size", self.effective_batch_size or "-"),
            ("steps / S_min, examples / E_min", f"{_html.format_number(self.steps_over_min)}, "
                                                f"{_html.format_number(self.examples_over_min)}"),
            (f"loss (last {LOSS_WINDOW}): mean / std",
             f"{_html.format_number(self.loss_mean)} / {_html.format_number(self.loss_std)}"),
            ("per-example loss: mean / std (reduction='none')",
             f"{_html.format_number(self.example_loss_mean)} / "
             f"{_html.format_number(self.example_loss_std)} over {self.n_examples} examples"
             if self.n_examples else "-"),
            ("measured", self.measurement),
            ("advice", self.advice),
        ]
        return _html.table(rows, caption="batchwidgets: NoiseTracker")

    def _repr_html_(self) -> str:
        return f"<div>{self.summary_table()}{_html.inline_plot(self)}</div>"


@dataclass(frozen=True)
class LoaderTrial:
    """One DataLoader setting, measured by ``measure_loader``: steady-state throughput over a
    bounded time, with the warm-up (worker start to the first batch) reported apart."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None  # None when num_workers == 0
    persistent_workers: bool
    batch_size: int | None  # None: the loader's own batch_sampler (or no batching) decides
    samples_per_s: float  # steady state, warm-up excluded; 0.0 when it failed
    batches_per_s: float
    bytes_per_s: float  # bytes of the batches' tensors (copied to the device when one is given)
    first_batch_s: float  # warm-up: from creating the iterator (worker start) to the first batch
    n_batches: int  # batches timed after the warm-up
    n_samples: int
    duration_s: float  # time spent timing, warm-up excluded
    device: str  # where batches were copied ("cpu": no copy)
    error: str = ""  # one line when this setting failed (a worker raised, pickling...)
    n_epoch_ends: int = 0  # times the loader ran out inside the timed window and was restarted
    cancelled: bool = False  # should_stop ended the timing before duration_s
    warnings: tuple[str, ...] = ()  # what measure_loader warned about for this setting

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def settings(self) -> dict[str, object]:
        """The DataLoader keyword arguments of this setting (``batch_size`` only when known)."""
        settings: dict[str, object] = {
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers}
        if self.batch_size is not None:
            settings["batch_size"] = self.batch_size
        return settings

    @property
    def bytes_per_batch(self) -> float:
        return self.bytes_per_s / self.batches_per_s if self.batches_per_s else 0.0

    @property
    def label(self) -> str:
        """Short name of the setting, e.g. ``'4 workers, pinned, prefetch 4, persistent'``."""
        parts = ["no workers" if self.num_workers == 0 else
                 f"{self.num_workers} worker{'s' if self.num_workers > 1 else ''}"]
        if self.pin_memory:
            parts.append("pinned")
        if self.num_workers:
            parts.append(f"prefetch {self.prefetch_factor}")
        if self.persistent_workers:
            parts.append("persistent")
        return ", ".join(parts)

    def summary(self) -> str:
        if not self.ok:
            return f"{self.label}: failed: {self.error}"
        return (f"{self.label}: {_html.format_number(self.samples_per_s)} samples/s, first batch "
                f"after {self.first_batch_s:.3f} s{' (cancelled)' if self.cancelled else ''}")


@dataclass(frozen=True)
class DataStallReport:
    """What ``data_stall`` found: how much of a training step waits on the input pipeline."""

    stall_fraction: float  # share of the step's time spent waiting on data, in [0, 1]
    step_time_s: float  # per step with the real loader
    replay_step_time_s: float  # per step with one batch replayed from the device
    data_wait_s: float  # per step: step_time_s - replay_step_time_s, at least 0
    n_steps: int  # steps timed with each
    device: str

    def summary(self) -> str:
        return (f"{self.stall_fraction:.0%} of each step waits on data "
                f"({self.data_wait_s * 1e3:.3g} ms of {self.step_time_s * 1e3:.3g} ms, "
                f"{self.n_steps} steps on {self.device})")

    def _rows(self) -> list[tuple[str, object]]:
        return [("data stall", f"{self.stall_fraction:.1%} of the step time"),
                ("step with the loader", f"{_html.format_number(self.step_time_s * 1e3)} ms"),
                ("step on a replayed batch",
                 f"{_html.format_number(self.replay_step_time_s * 1e3)} ms"),
                ("waiting on data per step", f"{_html.format_number(self.data_wait_s * 1e3)} ms"),
                ("steps timed", f"{self.n_steps} of each on {self.device}")]

    def _repr_html_(self) -> str:
        return f"<div>{_html.table(self._rows(), caption='batchwidgets: data_stall')}</div>"


@dataclass(frozen=True)
class LoaderReport:
    """What ``tune_loader`` (or a ``LoaderPanel``) measured: every DataLoader setting tried, the
    fastest, and the one this report is about (``current``: the best, or the panel's latest)."""

    trials: tuple[LoaderTrial, ...]  # in the order measured
    best_index: int  # fastest trial that ran
    current_index: int
    device: str
    grid_size: int  # settings in the full grid, of which the search measured len(trials)
    search_time_s: float
    warnings: tuple[str, ...] = ()
    stall: DataStallReport | None = None  # with tune_loader(step=...): for the best setting
    source: object = dataclasses.field(default=None, compare=False, repr=False)  # for make_loader

    @property
    def best(self) -> LoaderTrial:
        return self.trials[self.best_index]

    @property
    def current(self) -> LoaderTrial:
        return self.trials[self.current_index]

    @property
    def samples_per_s(self) -> float:
        return self.current.samples_per_s

    @property
    def baseline(self) -> LoaderTrial | None:
        """The first trial with no workers that ran (what ``speedup`` compares against)."""
        return next((t for t in self.trials if t.num_workers == 0 and t.ok), None)

    @property
    def speedup(self) -> float | None:
        """samples/s of the best setting over that with no workers; None without that trial."""
        base = self.baseline
        if base is None or not base.samples_per_s:
            return None
        return self.best.samples_per_s / base.samples_per_s

    def make_loader(self, **overrides: object) -> object:
        """A ``torch.utils.data.DataLoader`` over the same data with the best settings found;
        ``overrides`` (e.g. ``num_workers=2``) replace single settings."""
        if self.source is None:
            raise ValueError("source should be the loader or dataset measured, but got "
                             "source=None (a report rebuilt without it); call batchwidgets."
                             "engine.loader.make_loader(data, **report.best.settings).")
        engine = importlib.import_module("batchwidgets.engine.loader")  # results.py has no torch
        return engine.make_loader(self.source, **{**self.best.settings, **overrides})

    def summary(self) -> str:
        best = self.best
        faster = (f", {self.speedup:.2g}x no workers" if self.speedup and best.num_workers
                  else "")
        return (f"best: {best.label} at {_html.format_number(best.samples_per_s)} samples/s"
                f"{faster} ({len(self.trials)} of {self.grid_size} settings tried in "
                f"{self.search_time_s:.1f} s on {self.device})")

    def _summary_rows(self) -> list[tuple[str, object]]:
        best = self.best
        rows: list[tuple[str, object]] = [
            ("device", self.device),
            ("best setting", ", ".join(f"{k}={v!r}" for k, v in best.settings.items())),
            ("samples/s (best)", _html.format_number(best.samples_per_s)),
            ("speedup over no workers", "-" if self.speedup is None
             else f"{self.speedup:.2f}x"),
            ("time to first batch (best)", f"{best.first_batch_s:.3f} s"),
            ("settings tried", f"{len(self.trials)} of {self.grid_size} in the full grid, "
                               f"{self.search_time_s:.1f} s"),
        ]
        if self.current_index != self.best_index:
            current = f"{self.current.label}: {_html.format_number(self.samples_per_s)} samples/s"
            rows.insert(1, ("current setting", current))
        if self.stall is not None:
            rows.append(("data stall (best setting)", self.stall.summary()))
        rows += [("warning", text) for text in self.warnings]
        return rows

    def _trial_rows(self) -> list[tuple[object, ...]]:
        rows = []
        for i, t in enumerate(self.trials):
            mark = "best" if i == self.best_index else ("current" if i == self.current_index
                                                        else "")
            rows.append((i + 1, mark, t.num_workers, t.pin_memory, t.prefetch_factor or "-",
                         t.persistent_workers, _html.format_number(t.samples_per_s, 4),
                         _html.format_number(t.batches_per_s), _html.format_bytes(t.bytes_per_s),
                         f"{t.first_batch_s:.3f}", t.error or ("cancelled" if t.cancelled else "")))
        return rows

    def _repr_html_(self) -> str:
        summary = _html.table(self._summary_rows(), caption="batchwidgets: tune_loader")
        trials = _html.table(self._trial_rows(), caption="settings, in the order measured",
                             header=("#", "", "num_workers", "pin_memory", "prefetch_factor",
                                     "persistent_workers", "samples/s", "batches/s",
                                     "bytes/s", "first batch s", "error"))
        return f"<div>{summary}{trials}{_html.inline_plot(self)}</div>"
