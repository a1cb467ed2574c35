"""The noise reports: ``NoiseReport`` (``measure_noise``) and ``NoiseTrackerReport``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _html
from ._noise_theory import (
    _ratio,
    batch_variance,
    examples_over_min,
    noise_advice,
    steps_over_min,
)


@dataclass(frozen=True)
class LayerNoise:
    """One parameter's share of the gradient noise: the totals are the sums over all layers."""

    name: str  # as in model.named_parameters()
    trace_cov: float  # tr of this block's per-example gradient covariance (population, /N)
    grad_norm_sq: float  # |G|^2 of this block of the mean gradient

    @property
    def b_simple(self) -> float:
        return _ratio(self.trace_cov, self.grad_norm_sq)




SIGNIFICANCE = 2.0  # |G|^2 - its noise floor must pass this many standard errors (as NoiseTracker)


@dataclass(frozen=True)
class NoiseReport:
    """What ``measure_noise`` found: gradient and loss noise over ``n_examples`` examples.

    ``grad_variance[B]`` is the variance (trace) of the mini-batch mean gradient at batch size B,
    for sampling with replacement if ``replacement`` else without (as a shuffling DataLoader
    does); both variants are there as ``grad_variance_with_replacement`` and
    ``grad_variance_without_replacement`` (the latter only for B <= n_examples).

    The N examples are a sample of the data, and |G|^2 of a sample carries a noise floor of
    about tr(Sigma)/N: ``measurable`` is False (with the ``reason``) when ``grad_norm_sq`` is
    not clearly above ``noise_floor``, where B_simple only reflects N. The errors are standard
    errors over the examples (delete-a-group jackknife), None when not computed.
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
    grad_norm_sq_error: float | None = None  # std. error of grad_norm_sq - noise_floor
    b_simple_error: float | None = None  # std. error of b_simple

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2 with both estimated without bias from the N examples (NOTE
        [ The error bars of measure_noise ]): tr(cov) N/(N-1) over |G_N|^2 - tr(cov)/(N-1).
        Before, |G_N|^2 itself was the denominator, whose +tr(Sigma)/N made B_simple grow with N
        (``b_simple_plain``); inf where |G_N|^2 does not rise above the floor."""
        n = self.n_examples
        if n < 2:
            return self.b_simple_plain
        return _ratio(self.trace_cov * n / (n - 1), self.grad_norm_sq - self.noise_floor)

    @property
    def b_simple_plain(self) -> float:
        """tr(cov) / |G_N|^2, biased toward N when the noise dominates (what ``b_simple`` was)."""
        return _ratio(self.trace_cov, self.grad_norm_sq)

    @property
    def noise_floor(self) -> float:
        """tr(cov) / (N - 1): what noise alone adds to |G|^2 of N examples, on average."""
        return self.trace_cov / (self.n_examples - 1) if self.n_examples > 1 else math.inf

    @property
    def reason(self) -> str:
        """Why B_simple is not measurable from these examples; '' when it is."""
        if not math.isfinite(self.b_simple_plain) or self.b_simple_plain <= 0:
            return (f"B_simple = {self.b_simple_plain} is not finite (the mean gradient "
                    f"vanishes here: a converged model, or too few examples)")
        signal = self.grad_norm_sq - self.noise_floor
        if signal > SIGNIFICANCE * (self.grad_norm_sq_error or 0.0):
            return ""
        number = _html.format_number
        return (f"not measurable from {self.n_examples} examples: |G|^2 = "
                f"{number(self.grad_norm_sq)} is not clearly above the noise floor "
                f"tr(cov)/(N-1) = {number(self.noise_floor)} that {self.n_examples} examples "
                f"give by themselves (difference {number(signal)} ± "
                f"{number(self.grad_norm_sq_error or 0.0, 2)}), so tr(cov)/|G|^2 ≈ "
                f"{number(self.b_simple_plain)} reflects N, not the noise; B_simple is larger "
                f"than these examples resolve: measure more (max_examples, more data)")

    @property
    def measurable(self) -> bool:
        return not self.reason

    @property
    def advice(self) -> str:
        """The critical batch size, the steps-versus-examples trade-off at the loader's batch
        size (else at each of ``batch_sizes``), and the learning rate for another batch size."""
        if not self.measurable:
            return " ".join([f"critical batch size: {self.reason}.",
                             *(f"Warning: {w}." for w in self.warnings)])
        text = noise_advice(self.b_simple, self.b_simple_error, "examples", self.batch_sizes,
                            self.batch_size)
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
        if not self.measurable:
            return f"B_simple: {self.reason}"
        return (f"B_simple {_html.format_estimate(self.b_simple, self.b_simple_error)} from "
                f"{self.n_examples} "
                f"examples "
                f"(tr cov {_html.format_number(self.trace_cov)}, "
                f"|G|^2 {_html.format_number(self.grad_norm_sq)})")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        return [
            ("B_simple = tr(Σ) / |G|^2 (both unbiased)",
             _html.format_estimate(self.b_simple, self.b_simple_error)
             + ("" if self.measurable else " (not measurable)")),
            ("|G|^2 - noise floor tr(cov)/(N-1)",
             _html.format_estimate(self.grad_norm_sq - self.noise_floor,
                                   self.grad_norm_sq_error)),
            ("tr(cov) per example", _html.format_number(self.trace_cov)),
            ("|G|^2", _html.format_number(self.grad_norm_sq)),
            ("plain tr(cov) / |G|^2 (biased toward N)", _html.format_number(self.b_simple_plain)),
            ("loss mean / variance", f"{_html.format_number(self.loss_mean)} / "
                                     f"{_html.format_number(self.loss_variance)}"),
            ("examples measured", f"{self.n_examples} of {self.n_available or '?'}"
                                  f"{' (sample)' if self.sampled else ''}"),
            ("per-example gradients", self.method),
            ("BatchNorm", "measured in eval mode" if self.eval_batchnorm else "-"),
            ("advice", self.advice),
        ]

    def _repr_html_(self) -> str:
        sampling = "with replacement" if self.replacement else "without replacement"
        with_r = self.grad_variance_with_replacement
        without_r = self.grad_variance_without_replacement
        losses = self.loss_variance_per_batch
        finite = self.measurable
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
        return _html.report_html(self, "batchwidgets: measure_noise", self.rows(), batches,
                                 layers)


# NoiseTrackerReport lived here before results/noise_tracker.py: the old import path still works
from .noise_tracker import LOSS_WINDOW, NoisePoint, NoiseTrackerReport  # noqa: E402

__all__ = ["LOSS_WINDOW", "LayerNoise", "NoisePoint", "NoiseReport", "NoiseTrackerReport"]
