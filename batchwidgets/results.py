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

    @property
    def b_simple(self) -> float:
        return _ratio(self.trace_cov, self.grad_norm_sq)

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
        ]
        summary = _html.table(rows, caption="batchwidgets: measure_noise")
        with_r = self.grad_variance_with_replacement
        without_r = self.grad_variance_without_replacement
        losses = self.loss_variance_per_batch
        batches = _html.table(
            [(b, _html.format_number(with_r.get(b)), _html.format_number(without_r.get(b)),
              _html.format_number(losses.get(b))) for b in self.batch_sizes],
            header=("batch size", "grad variance (with repl.)", "grad variance (without)",
                    f"loss variance ({sampling})"),
            caption="mini-batch gradient and loss variance")
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
        lr = ("learning rate: scale linearly with the batch size up to about B_simple, with a "
              "warm-up of a few hundred steps (Goyal et al. 2017).")
        if not self.measurable:
            return f"critical batch size: {self.reason}. {lr}"
        unknown = ("" if self.micro_batch_size is not None else
                   " (the micro-batch size is unknown: pass model= to accumulate)")
        current = (f"; the effective batch is {self.effective_batch_size}"
                   if self.effective_batch_size else "")
        return (f"critical batch size B_simple ~ {_html.format_number(self.b_simple)} ± "
                f"{_html.format_number(self.b_simple_error, 2)} {self.unit}{unknown}"
                f"{current} (McCandlish et al. 2018: batches well above it cost more samples "
                f"for little gain, well below it more steps). {lr}")

    def summary(self) -> str:
        if not self.measurable:
            return f"B_simple: {self.reason} ({self.n_updates} updates, {len(self.losses)} losses)"
        return (f"B_simple {_html.format_number(self.b_simple)} ± "
                f"{_html.format_number(self.b_simple_error, 2)} {self.unit} "
                f"after {self.n_updates} updates")

    def _repr_html_(self) -> str:
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
            (f"loss (last {LOSS_WINDOW}): mean / std",
             f"{_html.format_number(self.loss_mean)} / {_html.format_number(self.loss_std)}"),
            ("advice", self.advice),
        ]
        table = _html.table(rows, caption="batchwidgets: NoiseTracker")
        return f"<div>{table}{_html.inline_plot(self)}</div>"
