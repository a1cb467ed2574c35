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
            f"and batches well above it spend many more examples to save few steps. Learning "
            f"rate: when the batch changes from B to B', multiply it by B'/B (linear scaling) "
            f"and warm it up over the first few epochs (Goyal et al. 2017), while B' stays "
            f"below about B_simple; from B = {start} to {target}: "
            f"×{number(lr_scale(b_simple, start, target))} (linear scaling: "
            f"×{number(target / start)}; the optimum, ∝ 1/(1 + B_simple/B), stops growing past "
            f"B_simple).")
