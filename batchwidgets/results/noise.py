"""The noise reports: ``NoiseReport`` (``measure_noise``) and ``NoiseTrackerReport``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _html
from ._noise_theory import (
    _ratio,
    batch_variance,
    compare_estimates,
    examples_over_min,
    noise_advice,
    noise_floor,
    population_estimates,
    population_rule,
    steps_over_min,
)
from ._text import Short, TextForm


@dataclass(frozen=True)
class LayerNoise(Short):
    """One parameter's share of the gradient noise: the totals are the sums over all layers."""

    name: str  # as in model.named_parameters()
    trace_cov: float  # tr of this block's per-example gradient covariance (population, /N)
    grad_norm_sq: float  # |G|^2 of this block of the mean gradient

    @property
    def b_simple(self) -> float:
        return _ratio(self.trace_cov, self.grad_norm_sq)




SIGNIFICANCE = 2.0  # |G|^2 - its noise floor must pass this many standard errors (as NoiseTracker)


@dataclass(frozen=True)
class NoiseReport(TextForm):
    """What ``measure_noise`` found: gradient and loss noise over ``n_examples`` examples.

    ``grad_variance[B]`` is the variance (trace) of the mini-batch mean gradient at batch size B,
    for sampling with replacement if ``replacement`` else without (as a shuffling DataLoader
    does); both variants are there as ``grad_variance_with_replacement`` and
    ``grad_variance_without_replacement`` (the latter only for B <= n_examples).

    ``b_simple`` is tr(Sigma)/|G|^2 of the data's population: exactly trace_cov / grad_norm_sq
    when the whole data set was measured, else estimated by the rule ``population_rule`` names
    (NOTE [ B_simple of a finite data set ]). |G|^2 of a sample carries a noise floor of about
    tr(Sigma)/N (less as N nears the data's size): ``measurable`` is False (with the ``reason``)
    when ``grad_norm_sq`` is not clearly above ``noise_floor``, where B_simple only reflects N.
    The errors are standard errors over the examples (delete-a-group jackknife, times the
    finite-population correction), None when not computed.
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
    grad_norm_sq_error: float | None = None  # std. error of population_grad_norm_sq
    b_simple_error: float | None = None  # std. error of b_simple

    @property
    def population_rule(self) -> str:
        """How the data's tr(Sigma) and |G|^2 are estimated from the N examples (NOTE [ B_simple
        of a finite data set ]): "whole" (N = M: exact), "finite" (N of M, as if drawn at
        random without replacement: measure_noise picks them evenly spaced) or "infinite" (M
        unknown: the first N items of an iterable dataset)."""
        return population_rule(self.n_examples, self.n_available)

    @property
    def population_note(self) -> str:
        """``population_rule`` in words, with N and M."""
        n, m = self.n_examples, self.n_available
        return {
            "whole": f"the whole data set ({n} examples): exact, no sampling error",
            "finite": f"{n} of {m} examples, evenly spaced, estimated as if drawn at random "
                      f"without replacement (finite-population rule)",
            "infinite": f"the first {n} examples of data of unknown size: estimated as a random "
                        f"sample of an infinite population",
        }[self.population_rule]

    @property
    def population_trace_cov(self) -> float:
        """tr(Sigma) of the data (normalised by its size M), estimated without bias by
        ``population_rule``; ``trace_cov`` itself when the whole data set was measured."""
        return population_estimates(self.trace_cov, self.grad_norm_sq, self.n_examples,
                                    self.n_available)[0]

    @property
    def population_grad_norm_sq(self) -> float:
        """|G|^2 of the data's mean gradient, estimated without bias by ``population_rule``:
        ``grad_norm_sq`` less ``noise_floor``."""
        return population_estimates(self.trace_cov, self.grad_norm_sq, self.n_examples,
                                    self.n_available)[1]

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2 of the data, both estimated without bias from the N examples (NOTE
        [ B_simple of a finite data set ]): exactly trace_cov / grad_norm_sq when the whole data
        set was measured. Before issue 27, |G_N|^2 itself was the denominator of a sample, whose
        +tr(Sigma)/N made B_simple grow with N (``b_simple_plain``); inf where |G_N|^2 does not
        rise above the floor."""
        return _ratio(self.population_trace_cov, self.population_grad_norm_sq)

    @property
    def b_simple_plain(self) -> float:
        """tr(cov) / |G_N|^2, biased toward N when the noise dominates a sample."""
        return _ratio(self.trace_cov, self.grad_norm_sq)

    @property
    def noise_floor(self) -> float:
        """What sampling alone adds to |G_N|^2 on average: tr(cov)/(N - 1) × (M - N)/M (× 1 for
        an infinite population; 0 for the whole data set)."""
        return noise_floor(self.trace_cov, self.n_examples, self.n_available)

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
        return (f"not measurable from {self.n_examples} examples ({self.population_short}): "
                f"|G|^2 = "
                f"{number(self.grad_norm_sq)} is not clearly above the noise floor "
                f"{number(self.noise_floor)} that {self.n_examples} examples "
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

    @property
    def steps_over_min(self) -> dict[int, float]:
        """S / S_min at each of ``batch_sizes`` (NOTE [ The steps-versus-examples trade-off ]);
        empty while B_simple is not measurable."""
        if not self.measurable:
            return {}
        return {b: steps_over_min(self.b_simple, b) for b in self.batch_sizes}

    @property
    def examples_over_min(self) -> dict[int, float]:
        """E / E_min at each of ``batch_sizes``; empty while B_simple is not measurable."""
        if not self.measurable:
            return {}
        return {b: examples_over_min(self.b_simple, b) for b in self.batch_sizes}

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

    @property
    def population_short(self) -> str:
        """``population_rule`` in a few words, for the summary."""
        return {"whole": "the whole data set, exact",
                "finite": f"of {self.n_available}, finite-population rule",
                "infinite": "of data of unknown size, infinite-population rule",
                }[self.population_rule]

    def summary(self) -> str:
        if not self.measurable:
            return f"B_simple: {self.reason}"
        return (f"B_simple {_html.format_estimate(self.b_simple, self.b_simple_error)} from "
                f"{self.n_examples} examples ({self.population_short}; tr cov "
                f"{_html.format_number(self.trace_cov)}, |G|^2 "
                f"{_html.format_number(self.grad_norm_sq)})")

    @property
    def b_simple_basis(self) -> str:
        """What B_simple rests on, in words: "from 512 examples"."""
        return f"from {self.n_examples} examples"

    def compare(self, other: object) -> str:
        """Whether ``other``'s B_simple (a NoiseReport, a CriticalBatchReport, a
        NoiseTrackerReport) and this one differ by more than their errors, in one line."""
        return compare_estimates(
            "B_simple", (self.b_simple, self.b_simple_error, self.b_simple_basis),
            (getattr(other, "b_simple", None), getattr(other, "b_simple_error", None),
             getattr(other, "b_simple_basis", "")))

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        number = _html.format_number
        return [
            ("B_simple = tr(Σ) / |G|^2 of the data",
             _html.format_estimate(self.b_simple, self.b_simple_error)
             + ("" if self.measurable else " (not measurable)")),
            ("estimated from", self.population_note),
            ("tr(Σ) of the data", number(self.population_trace_cov)),
            ("|G|^2 of the data: |G_N|^2 less the noise floor",
             f"{_html.format_estimate(self.population_grad_norm_sq, self.grad_norm_sq_error)}"
             f" (floor {number(self.noise_floor)})"),
            ("tr(cov), |G_N|^2 of the examples measured",
             f"{number(self.trace_cov)}, {number(self.grad_norm_sq)}"),
            ("plain tr(cov) / |G_N|^2 (biased toward N in a sample)",
             number(self.b_simple_plain)),
            ("loss mean / variance", f"{number(self.loss_mean)} / "
                                     f"{number(self.loss_variance)}"),
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
        steps, examples = self.steps_over_min, self.examples_over_min
        batches = _html.table(
            [(b, _html.format_number(with_r.get(b)), _html.format_number(without_r.get(b)),
              _html.format_number(losses.get(b)), _html.format_number(steps.get(b)),
              _html.format_number(examples.get(b)))
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
