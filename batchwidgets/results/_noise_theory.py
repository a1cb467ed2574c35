"""The noise theory behind the noise reports: B_simple, the variance at B, steps and examples over
the minimum, learning-rate scaling, and the advice prose. Standard library only."""

from __future__ import annotations

import math

from .. import _html


def _ratio(trace_cov: float, grad_norm_sq: float) -> float:
    """B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of Large-Batch
    Training", eq. 2.8); inf when the mean gradient vanishes, nan when both do."""
    if grad_norm_sq > 0:
        return trace_cov / grad_norm_sq
    return math.inf if trace_cov > 0 else math.nan


# NOTE [ B_simple of a finite data set ]
# B_simple is tr(Sigma)/|G|^2 of the data's population: the M examples of the data set, with
# Sigma their per-example gradient covariance normalised by M and G their mean gradient. From N
# of them drawn at random without replacement, with trace_cov normalised by N (Cochran,
# "Sampling Techniques", 1977, thm. 2.2 and 2.4: E s^2 = S^2 and Var(mean) = (1 - N/M) S^2/N):
#   tr(Sigma) ~ trace_cov * N/(N-1) * (M-1)/M          unbiased
#   |G|^2     ~ |G_N|^2 - trace_cov/(N-1) * (M-N)/M    unbiased (E|G_N|^2 = |G|^2 + Var(G_N))
# At N = M both are exact (trace_cov and |G_N|^2 themselves) and B_simple is their ratio; with M
# unknown (the first N items of an iterable dataset) M -> infinity, the rule for an infinite
# population. The jackknife's variance is that of sampling with replacement, so under the
# finite rule it is multiplied by 1 - N/M (0 at N = M: the whole data set has no sampling
# error). measure_noise picks N of M evenly spaced, not at random: it uses the finite rule as if
# they were drawn at random, and ``NoiseReport.population_rule`` says so.
def population_rule(n: int, m: int | None) -> str:
    """Which rule estimates the population's tr(Sigma) and |G|^2 from ``n`` of ``m`` examples
    (NOTE [ B_simple of a finite data set ]): "whole", "finite" or "infinite"."""
    if m is None:
        return "infinite"
    return "whole" if n >= m else "finite"


def noise_floor(trace_cov: float, n: int, m: int | None) -> float:
    """What sampling ``n`` of ``m`` examples adds to |G_N|^2 on average, estimated:
    tr(cov)/(N-1) (M-N)/M, tr(cov)/(N-1) for an infinite population, 0 for the whole."""
    if n < 2:
        return math.inf
    rule = population_rule(n, m)
    if rule == "whole":
        return 0.0
    floor = trace_cov / (n - 1)
    return floor if rule == "infinite" else floor * (m - n) / m


def population_estimates(trace_cov: float, grad_norm_sq: float, n: int,
                         m: int | None) -> tuple[float, float]:
    """(tr(Sigma), |G|^2) of the population of ``m`` examples (None: infinite), unbiased from
    ``n`` of them drawn at random without replacement (NOTE [ B_simple of a finite data
    set ]); exact at ``n == m``."""
    rule = population_rule(n, m)
    if rule == "whole" or n < 2:
        return trace_cov, grad_norm_sq
    trace = trace_cov * n / (n - 1)
    if rule == "finite":
        trace = trace * (m - 1) / m
    return trace, grad_norm_sq - noise_floor(trace_cov, n, m)


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
    sizes = (current,) if current else batch_sizes
    label = "the current batch" if current else "batch size"
    at = "; ".join(f"at {label} B = {b}: {number(steps_over_min(b_simple, b), 3)}× the fewest "
                   f"steps and {number(examples_over_min(b_simple, b), 3)}× the fewest examples"
                   for b in sizes)
    target = max(1, int(float(f"{b_simple:.2g}")))  # B_simple to 2 significant digits
    start = current or min(batch_sizes, default=1)
    estimate = _html.format_estimate(b_simple, error)
    return (f"critical batch size B_simple ≈ {estimate} {unit} (McCandlish et al. 2018)."
            f" Training at batch size B takes about S_min·(1 + B_simple/B) steps and "
            f"E_min·(1 + B/B_simple) examples, {at}; B ≈ B_simple balances the two (2× each), "
            f"and batches well above it spend many more examples to save few steps. "
            f"{lr_advice(b_simple, start, target)}")


# The learning-rate rules the advice names, each with the factor it gives from B to B'. Every
# factor in a piece of advice is written "from B = b to B' = b': ×F by <rule>", the rule's name
# as here, the noise-scale rule followed by "at B_noise = x" (or B_simple), so that a reader (and
# tests/results/test_report_consistency.py) can tell which rule gave which number from which inputs.
NOISE_SCALE_RULE = "the noise-scale rule"
LINEAR_SCALING = "linear scaling"


def lr_advice(b_simple: float, batch_size: int, new_batch_size: int) -> str:
    """The learning rate from B to B': the factor by the noise-scale rule (the optimum of
    McCandlish et al. 2018, eq. 2.7), and linear scaling's beside it, each named with its
    factor (see NOTE [ The steps-versus-examples trade-off ])."""
    number = _html.format_number
    return (f"Learning rate from B = {batch_size} to B' = {new_batch_size}: "
            f"×{number(lr_scale(b_simple, batch_size, new_batch_size))} by "
            f"{NOISE_SCALE_RULE} at B_simple = {number(b_simple)}, (1 + B_simple/B)/(1 + "
            f"B_simple/B') (McCandlish et al. 2018, eq. 2.7); "
            f"×{number(new_batch_size / batch_size)} by {LINEAR_SCALING} B'/B "
            f"(Goyal et al. 2017), which is close to it only while both batches are well below "
            f"B_simple: past B_simple the best rate stops growing. Warm the new rate up over "
            f"the first few epochs.")

AGREE_WITHIN = 2.0  # combined standard errors two estimates may differ by and still agree


def verdict(a: float | None, error_a: float | None, b: float | None,
            error_b: float | None) -> str:
    """Whether two estimates differ by more than their errors: by more than ``AGREE_WITHIN``
    standard errors of their difference, sqrt(e1^2 + e2^2)."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return "one of them is not a number, nothing to compare"
    if error_a is None or error_b is None:
        return "one has no error bar, so whether they differ cannot be said"
    spread = math.hypot(error_a, error_b)
    if spread == 0:
        return "equal" if a == b else "differ (both exact)"
    if abs(a - b) <= AGREE_WITHIN * spread:
        return "agree within their errors"
    return "differ by more than their errors"


def compare_estimates(name: str, first: tuple[float | None, float | None, str],
                      second: tuple[float | None, float | None, str]) -> str:
    """Two estimates of ``name``, each (value, standard error, basis such as "from 512
    examples"), in one line with the ``verdict`` and their difference."""
    number = _html.format_number
    (a, error_a, basis_a), (b, error_b, basis_b) = first, second
    both = " ".join(f"{name} {_html.format_estimate(a, error_a)} {basis_a} and "
                    f"{_html.format_estimate(b, error_b)} {basis_b}".split())
    said = verdict(a, error_a, b, error_b)
    if not said.endswith("their errors"):
        return f"{both}: {said}"
    spread = math.hypot(error_a, error_b)
    return (f"{both}: {said} (difference {number(abs(a - b))} ± {number(spread, 2)}, "
            f"{number(abs(a - b) / spread, 2)} standard errors)")
