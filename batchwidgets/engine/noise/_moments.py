"""The running sums behind ``measure_noise``: per-parameter sums of shifted per-example
gradients in float64, and per-group sums for the delete-a-group jackknife of its error bars."""

from __future__ import annotations

import math

import torch

from ...results import LayerNoise, population_estimates, population_rule

MAX_GROUPS = 16  # example groups the jackknife leaves out in turn


# NOTE [ Why the float64 sums are shifted ]
# tr(cov) = (1/N) sum |g_i|^2 - |G|^2 cancels badly when the noise is small next to |G|^2. We
# accumulate d_i = g_i - s for a shift s near G (the first chunk's mean gradient), so that
# tr(cov) = (1/N) sum |d_i|^2 - |mean d|^2, exact for any s and well conditioned when s ~ G
# (the "shifted data" algorithm; Chan, Golub & LeVeque 1983). Memory: one float64 copy of the
# parameters for the shift and one for sum d_i, plus one chunk of per-example gradients.

# NOTE [ The error bars of measure_noise ]
# The N examples are a sample of the data. Their mean gradient's squared norm overestimates the
# data's |G|^2: E|G_N|^2 = |G|^2 + tr(Sigma)/N (McCandlish et al. 2018, A.1; times (M-N)/(M-1)
# for N of M examples), so where the noise dominates, |G_N|^2 is about tr(Sigma)/N and
# B_simple = tr(cov)/|G_N|^2 comes out close to N whatever the model: it measures the sample,
# not the noise. The report keeps the noise floor (tr(cov)/(N - 1), times (M - N)/M for N of M;
# NOTE [ B_simple of a finite data set ] in results/_noise_theory.py) and calls B_simple
# measurable only when |G_N|^2 - floor, an unbiased estimate of |G|^2, is more than twice its
# standard error, the rule NoiseTracker uses. B_simple itself is the ratio of the two unbiased
# parts, so it no longer grows with N (the plain tr(cov)/|G_N|^2 stays as b_simple_plain); a
# ratio keeps a bias of order 1/N, inside its error bar. The whole data set (N = M) has no
# floor and no sampling error: B_simple is tr(cov)/|G_N|^2 exactly, its error 0. Standard
# errors come from the delete-a-group jackknife (Efron & Stein 1981; Shao & Tu 1995, sec. 2.1):
# example i goes to group i mod K (K = min(16, N // 2)), each group's sum of shifted gradients
# is kept (K float32 copies of the parameters, and a float64 sum of squares), and each statistic
# is recomputed with one group left out from dot products of the kept sums:
# se^2 = (K - 1)/K sum_k (theta_k - mean theta)^2, times 1 - N/M for N of M examples.
class Moments:
    """Running per-parameter sums of shifted per-example gradients, in float64 (see NOTE
    [ Why the float64 sums are shifted ]), and per-group sums for NOTE [ The error bars of
    measure_noise ]."""

    def __init__(self, n_expected: int) -> None:
        self.count = 0
        self.n_groups = min(MAX_GROUPS, n_expected // 2)
        self.shift: dict[str, torch.Tensor] = {}
        self.sum: dict[str, torch.Tensor] = {}
        self.sum_sq: dict[str, torch.Tensor] = {}
        self.group_sum: dict[str, torch.Tensor] = {}
        self.group_sq = torch.zeros(max(self.n_groups, 1), dtype=torch.float64)
        self.group_count = torch.zeros(max(self.n_groups, 1), dtype=torch.float64)
        self.losses: list[torch.Tensor] = []

    def add(self, grads: dict[str, torch.Tensor], losses: torch.Tensor) -> None:
        if not self.shift:
            self.shift = {n: g.double().mean(0) for n, g in grads.items()}
            self.sum = {n: torch.zeros_like(s) for n, s in self.shift.items()}
            self.sum_sq = {n: s.new_zeros(()) for n, s in self.shift.items()}
            self.group_sum = {n: s.new_zeros((len(self.group_sq), *s.shape), dtype=torch.float32)
                              for n, s in self.shift.items()}
            self.group_sq = self.group_sq.to(next(iter(self.shift.values())).device)
            self.group_count = self.group_count.to(self.group_sq.device)
        m = losses.shape[0]
        group = (torch.arange(self.count, self.count + m) % len(self.group_sq)).to(
            self.group_sq.device)
        for name, g in grads.items():
            d = g.double() - self.shift[name]
            self.sum[name] += d.sum(0)
            squares = d.square().reshape(m, -1).sum(1)
            self.sum_sq[name] += squares.sum()
            self.group_sq.index_add_(0, group, squares)
            self.group_sum[name].index_add_(0, group, d.float())
        self.group_count.index_add_(0, group, torch.ones(m, dtype=torch.float64,
                                                         device=group.device))
        self.count += m
        self.losses.append(losses.detach().double().reshape(-1).cpu())

    def layers(self) -> tuple[LayerNoise, ...]:
        n, result = self.count, []
        for name, total in self.sum.items():
            mean_d = total / n
            trace_cov = max((self.sum_sq[name] / n - mean_d.square().sum()).item(), 0.0)
            grad_norm_sq = (self.shift[name] + mean_d).square().sum().item()
            result.append(LayerNoise(name, trace_cov, grad_norm_sq))
        return tuple(result)

    def errors(self, population: int | None = None) -> tuple[float | None, float | None]:
        """Jackknife standard errors of (|G|^2, B_simple) of the data, both estimated as the
        report does from the examples of a population of ``population`` (None: infinite; NOTE
        [ B_simple of a finite data set ]): 0 for the whole data set, else times the
        finite-population correction sqrt(1 - N/M); None without groups, or where a group left
        out leaves no signal above the floor."""
        if population_rule(self.count, population) == "whole":
            return 0.0, 0.0
        if self.n_groups < 2:
            return None, None
        dots = torch.zeros(6, len(self.group_sq), dtype=torch.float64, device=self.group_sq.device)
        for name, total in self.sum.items():  # per group: s.D_k, D.D_k, |D_k|^2; and s.s, s.D, D.D
            groups, shift = self.group_sum[name].double().flatten(1), self.shift[name].flatten()
            total = total.flatten()
            dots[0] += groups @ shift
            dots[1] += groups @ total
            dots[2] += groups.square().sum(1)
            dots[3:] += torch.stack([shift @ shift, shift @ total, total @ total])[:, None]
        s_dk, d_dk, dk_dk, s_s, s_d, d_d = dots.tolist()
        sq, group_sq = math.fsum(v.item() for v in self.sum_sq.values()), self.group_sq.tolist()
        counts = self.group_count.tolist()
        signals, ratios = [], []
        for k in range(len(counts)):
            n = self.count - counts[k]
            left = d_d[k] - 2 * d_dk[k] + dk_dk[k]  # |D - D_k|^2
            grad_norm_sq = s_s[k] + 2 * (s_d[k] - s_dk[k]) / n + left / n**2
            trace_cov = max((sq - group_sq[k]) / n - left / n**2, 0.0)
            trace, signal = population_estimates(trace_cov, grad_norm_sq, round(n), population)
            signals.append(signal)
            ratios.append(trace / signal if signal > 0 else math.inf)
        # the jackknife estimates the variance of sampling with replacement
        correction = math.sqrt(1 - self.count / population) if population else 1.0
        return _scaled(_jackknife(signals), correction), _scaled(_jackknife(ratios), correction)


def _scaled(error: float | None, factor: float) -> float | None:
    return None if error is None else error * factor


def _jackknife(values: list[float]) -> float | None:
    k = len(values)
    if not all(map(math.isfinite, values)):
        return None
    mean = math.fsum(values) / k
    return math.sqrt((k - 1) / k * math.fsum((v - mean) ** 2 for v in values))
