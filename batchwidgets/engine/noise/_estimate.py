"""The arithmetic behind ``NoiseTracker``: unbiased per-update estimates of |G|^2 and tr(Sigma)
from squared gradient norms at several batch sizes, their moving averages with error bars, the
squared gradient norms of an update (from the fused norms of ``_grads.py``, or of a split
batch), and the loaders that bias them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.func import functional_call
from torch.utils.data import DataLoader, SequentialSampler

from .._batches import batch_length, forward_and_loss, slice_batch
from .._grads import (
    grad_norms,
    group_by_device_and_dtype,
    loss_scale,
    sum_of_squares,
    unscale_divisor,
)
from .._state import RngState
from .._util import check_int

# NOTE [ The two-batch-size estimator ]
# McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1: for a
# mini-batch of size B, E|G_B|^2 = |G|^2 + tr(Sigma)/B. With the k micro-batches of one update
# (B_small = b, each with its own squared gradient norm) and their average (B_big = k*b):
#   G2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)   unbiased for |G|^2
#   S  = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)             unbiased for tr(Sigma)
# Each update gives one noisy (G2, S) pair. The paper averages G2 and S separately and only then
# takes the ratio B_simple = S/G2, since the ratio of single noisy estimates is biased and wild.
# Here the averages are bias-corrected exponential moving averages (as Adam's moments):
# weighted sums divided by the sum of the weights beta^(t-i). The error bar is the standard
# error of those weighted means (the weights' sum of squares gives the effective sample count),
# carried to the ratio with the delta method, the covariance of S and G2 included.

# NOTE [ The prefix-sum estimator ]
# Seeing each micro-batch gradient g_j takes a hook per parameter per micro-step. Without hooks,
# accumulate sees only running sums: at the j-th intercepted optimizer.step(), .grad holds A_j = g_1
# + ... + g_j (times the GradScaler's scale). A_j / j is the gradient of a batch of j*b samples, so
# by NOTE [ The two-batch-size estimator ] y_j = |A_j / j|^2 has E y_j = |G|^2 + tr(Sigma) x_j with
# x_j = 1/(j b), j = 1 .. k-1, and the update's averaged gradient is one more point, at x = 1/(n b)
# for the n micro-batches it averages (n = k, or k*W after DDP's all-reduce over W ranks). The
# ordinary least-squares line through such points gives |G|^2 and tr(Sigma) as its intercept and
# slope (an estimator tried and left out). Both are fixed linear combinations sum_j w_j y_j whose
# weights depend on the x's only (intercept: sum w = 1, sum w x = 0; slope: sum w = 0, sum w x = 1),
# so their expectations are exactly |G|^2 and tr(Sigma): unbiased although the y's are correlated
# (A_2 contains A_1). The correlation costs variance only, and the error bars stay right: they come
# from the spread of the per-update estimates, and different updates use different batches. Which
# points: nested sums repeat one another. In simulations (Gaussian micro-batch gradients, k = 4 and
# 8, B_simple from b/4 to 64 b) the first point alone with the last, which is the two-batch-size
# estimator with one small norm, |g_1|^2, in place of the mean of k, varies less than the line
# through all k points (which has 1.03-1.9x its variance) and is within 11% of the best linear
# unbiased fit of all k (generalised least squares with the true covariance). So accumulate reads
# .grad after the first micro-step only: one extra gradient norm per update. The price, against the
# k separate norms of the hooks: B_simple's per-update variance is 2x at B_simple >= 16 b, 3x at 4
# b, 7-11x at b, and 28-52x when B_simple is b/4 (a batch already far beyond the critical one), at k
# = 4-8; the same error bar takes that many times the updates. On
# tests/engine/noise/test_noise_tracker.py's regression (k = 4, B_simple about 0.7 b) it is 29x:
# 9000 updates at ema=1-1/3000 give what 300 at ema=0.99 give with the hooks.

def grad_sq_norm(params: Sequence[torch.Tensor], scaler: Any, optimizer: torch.optim.Optimizer,
                 groups: Sequence[Sequence[torch.Tensor]] | None = None) -> torch.Tensor | None:
    """|G_big|^2: the squared norm of the (averaged) gradient, unscaled, float32, left on the
    device (no host sync). ``groups``: ``params`` already grouped, to save the grouping."""
    with torch.no_grad():
        norms = grad_norms(group_by_device_and_dtype(params) if groups is None else groups)
        if not norms:
            return None
        total = sum_of_squares(norms)
        divisor = unscale_divisor(scaler, optimizer, total.device)
    return total if divisor is None else total / divisor


def first_sq_norm(norms: Sequence[torch.Tensor], scaler: Any) -> torch.Tensor | None:
    """|g_1|^2, unscaled, from the per-parameter norms taken after the first micro-step (see
    NOTE [ The prefix-sum estimator ]); None without gradients."""
    if not norms:
        return None
    with torch.no_grad():
        total = sum_of_squares(norms)
        # taken scaled, even if the loop unscales the last micro-step's gradient; the scale has
        # not changed since, as the scaler updates on real steps only
        scale = loss_scale(scaler, total.device)
        if scale is not None:
            total = total / scale.square()
    return total


class WeightedMoments:
    """Exponentially weighted means of x, y, x^2, y^2 and x*y, with bias correction."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.weight = self.weight_sq = 0.0
        self.sums = [0.0] * 5  # x, y, xx, yy, xy

    def add(self, x: float, y: float) -> None:
        b = self.beta
        self.weight = b * self.weight + 1.0
        self.weight_sq = b * b * self.weight_sq + 1.0
        for i, value in enumerate((x, y, x * x, y * y, x * y)):
            self.sums[i] = b * self.sums[i] + value

    def means(self) -> tuple[float, ...]:
        return tuple(s / self.weight for s in self.sums)

    def standard_errors(self) -> tuple[float, float, float]:
        """Standard errors of the weighted means of x and y, and their covariance."""
        mx, my, mxx, myy, mxy = self.means()
        n_eff = self.weight**2 / self.weight_sq  # Kish's effective sample size
        if n_eff <= 1:
            return math.inf, math.inf, 0.0
        spread = n_eff / (n_eff - 1)  # unbiased variance of the individual estimates
        var_x = max(mxx - mx * mx, 0.0) * spread
        var_y = max(myy - my * my, 0.0) * spread
        return math.sqrt(var_x / n_eff), math.sqrt(var_y / n_eff), (mxy - mx * my) * spread / n_eff


def estimate(small_sq_norms: Sequence[float], big_sq_norm: float, micro_batch_size: int,
             n_micro: int) -> tuple[float, float]:
    """One update's (|G|^2, tr Sigma) estimate; see NOTE [ The two-batch-size estimator ]."""
    b_small, b_big = micro_batch_size, micro_batch_size * n_micro
    small = sum(small_sq_norms) / len(small_sq_norms)
    grad_norm_sq = (b_big * big_sq_norm - b_small * small) / (b_big - b_small)
    trace_cov = (small - big_sq_norm) / (1 / b_small - 1 / b_big)
    return grad_norm_sq, trace_cov


_SIGNIFICANCE = 2.0  # |G|^2 must exceed this many standard errors to give a B_simple
_SPLIT = ("or call tracker.measure(model, loss_fn, batch) in the loop, which splits every K-th "
          "batch (NoiseTracker(every=K)) in parts at one extra forward+backward of that batch")
NO_MICRO_BATCHES = ("the gradient noise scale is not measured without micro-batches: pass "
                    f"noise=tracker to accumulate(steps>=2), use DDP micro-batches, {_SPLIT}")


def b_simple_of(moments: WeightedMoments, n_updates: int, n_single: int,
                warmup_updates: int) -> tuple[float | None, float | None, str]:
    """A tracker's (B_simple, its standard error, the reason it is not measurable or ''): from
    the moving averages of ``n_updates`` estimates (``n_single`` updates had one micro-batch)."""
    if n_updates == 0:
        return None, None, (NO_MICRO_BATCHES if not n_single else
                            f"every update had one micro-batch: use accumulate(steps>=2), "
                            f"{_SPLIT}")
    if n_updates < warmup_updates:
        return None, None, (f"not measurable yet: {n_updates} of "
                            f"{warmup_updates} warm-up updates")
    g2, s = moments.means()[:2]
    se_g2, se_s, cov = moments.standard_errors()
    if g2 <= _SIGNIFICANCE * se_g2:
        return None, None, (f"not measurable yet: |G|^2 = {g2:.3g} ± {se_g2:.2g} is not "
                            f"clearly above 0 (the noise dominates; B_simple is larger than "
                            f"these batches can resolve, or training has converged)")
    if s <= 0:
        return None, None, f"not measurable yet: tr(Sigma) estimate {s:.3g} <= 0"
    ratio = s / g2
    relative_var = (se_s / s) ** 2 + (se_g2 / g2) ** 2 - 2 * cov / (s * g2)
    return ratio, ratio * math.sqrt(max(relative_var, 0.0)), ""


class DeferredUpdate(NamedTuple):
    """What one update's values, left on the device by accumulate, hold: ``n_losses`` losses,
    then the small batches' norms (``small``) and |G_big|^2 last, for the two-batch-size
    estimator with ``micro_batch_size`` and ``n_micro``."""

    n_values: int
    n_losses: int
    small: str | None  # "norms" (square them) or "squares"; None: the losses only
    micro_batch_size: int | None
    n_micro: int


def uneven_loader_warning(loader: Any) -> str:
    """Why a DataLoader whose last batch is smaller biases the tracker's estimate, or ''."""
    if not isinstance(loader, DataLoader) or loader.drop_last or not loader.batch_size:
        return ""
    try:
        size = len(loader.dataset)
    except TypeError:  # an iterable dataset without a length
        return ""
    last = size % loader.batch_size
    if not last:
        return ""
    return (f"the DataLoader's last batch of each epoch has {last} examples, not "
            f"batch_size={loader.batch_size} ({size} examples): the two-batch-size estimate "
            f"assumes equal micro-batches, so the updates that include it are off. Pass "
            f"drop_last=True to the DataLoader")


def unshuffled_loader_warning(loader: Any) -> str:
    """Why a DataLoader that reads its dataset in order biases noise measurements, or ''."""
    if not isinstance(loader, DataLoader):
        return ""
    batches = loader.batch_sampler  # a custom batch sampler replaces loader.sampler
    sampler = loader.sampler if batches is None else getattr(batches, "sampler", None)
    if not isinstance(sampler, SequentialSampler):
        return ""
    return (f"the DataLoader does not shuffle: it reads its {len(sampler)} examples in order "
            f"(SequentialSampler, batch_size={loader.batch_size}), so consecutive batches hold "
            f"neighbouring examples, which are often alike (sorted by class, time or source); "
            f"the batches are then not random samples, and the per-batch loss noise and "
            f"B_simple, which assume random batches, are biased. Pass shuffle=True to the "
            f"DataLoader")


def _sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(
        g, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None,
    ).double().square() for g in grads]).sum()


def check_measure(model: Any, loss_fn: Any, batch: Any, parts: Any) -> int:
    """NoiseTracker.measure's arguments checked: the batch's number of examples."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got model={model!r}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn should be a callable loss_fn(output, target) -> scalar or "
                        f"None (the output's .loss), but got loss_fn={loss_fn!r}; e.g. "
                        f"torch.nn.functional.cross_entropy.")
    check_int("parts", parts, 2, hint="; e.g. parts=2")
    if batch is None:
        raise TypeError("batch should be given: tracker.measure(model, loss_fn, (x, y)), or "
                        "tracker.measure(model, batch) when the output carries .loss.")
    size = batch_length(batch)
    if size < parts:
        raise ValueError(f"the batch should hold at least parts={parts} examples, but it holds "
                         f"{size}; use fewer parts.")
    return size


def split_sq_norms(model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                   batch: Any, parts: int) -> tuple[list[float], float]:
    """Squared gradient norms of ``parts`` equal parts of a batch and of their mean, from
    ``torch.autograd.grad`` on detached aliases of the weights: no ``.grad``, parameter hook,
    buffer (BatchNorm statistics) or random generator of the user's changes."""
    size = batch_length(batch) // parts
    weights = {name: p.detach().requires_grad_(True) for name, p in model.named_parameters()
               if p.requires_grad}
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = RngState()
    try:
        total, squares = None, []
        with torch.enable_grad():
            for i in range(parts):
                def call(*args: Any, **kwargs: Any) -> Any:
                    return functional_call(model, weights, args, kwargs)

                loss = forward_and_loss(model, slice_batch(batch, i * size, (i + 1) * size),
                                        loss_fn, call=call, surrogate=False)
                grads = torch.autograd.grad(loss, list(weights.values()), allow_unused=True)
                grads = [torch.zeros_like(w) if g is None else g
                         for g, w in zip(grads, weights.values())]
                squares.append(_sq_norm(grads))
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
        big = _sq_norm([t / parts for t in total])
        values = torch.stack([*squares, big]).tolist()  # one host sync
    finally:
        rng.restore()
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    return values[:-1], values[-1]


def merge_moments(moments: tuple[int, float, float], n: int, mean: float,
                  m2: float) -> tuple[int, float, float]:
    """(count, mean, sum of squared deviations) of two groups merged (Chan et al. 1979, the
    pairwise form of Welford's update: no cancellation over long runs)."""
    n_a, mean_a, m2_a = moments
    total = n_a + n
    delta = mean - mean_a
    return total, mean_a + delta * n / total, m2_a + m2 + delta**2 * n_a * n / total
