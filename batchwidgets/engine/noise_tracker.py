"""``NoiseTracker``: per-batch losses and the gradient noise scale, followed online during
ordinary training from the micro-batches that ``accumulate`` already produces.

Usage:
    >>> import batchwidgets as bw
    >>> tracker = bw.NoiseTracker(ema=0.9, warmup_updates=2)
    >>> for _ in range(2):  # |G|^2 = 1 and tr(Sigma) = 6, exactly
    ...     tracker.update(small_sq_norms=[1.75, 1.70, 1.80, 1.75], big_sq_norm=1.1875,
    ...                    micro_batch_size=8, n_micro=4)
    >>> round(tracker.report.b_simple, 2)
    6.0
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._warnings import BatchwidgetsWarning
from ..results import NoiseTrackerReport

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

_SIGNIFICANCE = 2.0  # |G|^2 must exceed this many standard errors to give a B_simple
NO_MICRO_BATCHES = ("the gradient noise scale is not measured without micro-batches: pass "
                    "noise=tracker to accumulate(steps>=2), or use DDP micro-batches")


def grad_sq_norm(params: Sequence[torch.Tensor], scaler: Any,
                 optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """|G_big|^2: the squared norm of the (averaged) gradient, unscaled, left on the device."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return None
    device = grads[0].device
    total = torch.stack([torch.linalg.vector_norm(
        g, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None,
    ).float().square().to(device) for g in grads]).sum()
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    # GradScaler keeps a stage per optimizer; after unscale_(optimizer) the grads are unscaled
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    if isinstance(scale, torch.Tensor) and getattr(state.get("stage"), "name", "") != "UNSCALED":
        total = total / scale.to(device).float().pow(2)
    return total


class _WeightedMoments:
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


class NoiseTracker:
    """Follow per-batch losses and the gradient noise scale B_simple during training.

    Attach it with ``accumulate(optimizer, steps=k, model=model, noise=tracker)``: every real
    update then gives one two-batch-size estimate from its ``k`` micro-batches (see
    NOTE [ The two-batch-size estimator ]), for one extra gradient-norm reduction per parameter
    per micro-step and one host sync per update. Losses are recorded by ``accumulate`` too, or
    by calling ``observe_loss`` in a plain loop.

    Parameters
    ----------
    ema : float
        Weight of the past in the moving averages of |G|^2 and tr(Sigma), in [0, 1).
    warmup_updates : int
        Updates needed before B_simple is reported.
    max_losses : int
        Losses kept (the oldest are dropped).

    Examples
    --------
    >>> tracker = NoiseTracker(ema=0.99)                               # doctest: +SKIP
    >>> with accumulate(optimizer, steps=4, model=model, noise=tracker):  # doctest: +SKIP
    ...     train()
    >>> tracker.report.advice                                           # doctest: +SKIP
    """

    def __init__(self, ema: float = 0.9, warmup_updates: int = 5, *,
                 max_losses: int = 10_000) -> None:
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 <= ema < 1:
            raise ValueError(f"ema should be a number in [0, 1), but got ema={ema!r}; e.g. "
                             f"ema=0.9 averages over about the last 10 updates.")
        for name, value in (("warmup_updates", warmup_updates), ("max_losses", max_losses)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} should be an int >= 1, but got {name}={value!r}.")
        self.ema, self.warmup_updates = float(ema), warmup_updates
        self._moments = _WeightedMoments(self.ema)
        self._losses: deque[float] = deque(maxlen=max_losses)
        self._history: list[tuple[int, float | None, float, float]] = []
        self._n_updates = self._n_single = 0
        self._micro_batch_size: int | None = None
        self._n_micro: int | None = None
        self._listeners: list[Callable[[NoiseTracker], None]] = []

    def add_listener(self, listener: Callable[[NoiseTracker], None]) -> None:
        """Call ``listener(tracker)`` after every recorded loss and update (a live panel redraws
        from it; it should be cheap). A listener that raises is removed with a warning, so a
        broken display never stops training."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[NoiseTracker], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            try:
                listener(self)
            except Exception as error:
                self.remove_listener(listener)
                warnings.warn(f"NoiseTracker: the listener {listener!r} raised {error!r} and "
                              f"was removed; training goes on", BatchwidgetsWarning, stacklevel=2)

    def observe_loss(self, loss: Any) -> None:
        """Record one batch's loss (a float or a 0-dim tensor, read with ``float``)."""
        self._losses.append(float(loss))
        self._notify()

    def update(self, *, small_sq_norms: Sequence[float], big_sq_norm: float,
               micro_batch_size: int | None, n_micro: int) -> None:
        """Add one update: the squared gradient norms of its micro-batches (unscaled), that of
        their average, the micro-batch size (None: unknown, counted in micro-batches) and the
        number of micro-batches averaged (``k``, times the world size under DDP)."""
        values = [*small_sq_norms, big_sq_norm]
        if n_micro < 2 or not small_sq_norms or not all(map(math.isfinite, values)):
            self._n_single += n_micro < 2  # nothing to compare; inf/NaN steps are skipped
            self._notify()
            return
        self._micro_batch_size, self._n_micro = micro_batch_size, n_micro
        grad_norm_sq, trace_cov = estimate(small_sq_norms, big_sq_norm, micro_batch_size or 1,
                                           n_micro)
        self._moments.add(grad_norm_sq, trace_cov)
        self._n_updates += 1
        self._history.append((self._n_updates, self._b_simple()[0], *self._moments.means()[:2]))
        self._notify()

    def _b_simple(self) -> tuple[float | None, float | None, str]:
        """(B_simple, its standard error, reason it is not measurable or '')."""
        if self._n_updates == 0:
            return None, None, (NO_MICRO_BATCHES if not self._n_single else
                                "every update had one micro-batch: use accumulate(steps>=2)")
        if self._n_updates < self.warmup_updates:
            return None, None, (f"not measurable yet: {self._n_updates} of "
                                f"{self.warmup_updates} warm-up updates")
        g2, s = self._moments.means()[:2]
        se_g2, se_s, cov = self._moments.standard_errors()
        if g2 <= _SIGNIFICANCE * se_g2:
            return None, None, (f"not measurable yet: |G|^2 = {g2:.3g} ± {se_g2:.2g} is not "
                                f"clearly above 0 (the noise dominates; B_simple is larger than "
                                f"these batches can resolve, or training has converged)")
        if s <= 0:
            return None, None, f"not measurable yet: tr(Sigma) estimate {s:.3g} <= 0"
        ratio = s / g2
        relative_var = (se_s / s) ** 2 + (se_g2 / g2) ** 2 - 2 * cov / (s * g2)
        return ratio, ratio * math.sqrt(max(relative_var, 0.0)), ""

    @property
    def report(self) -> NoiseTrackerReport:
        b_simple, error, reason = self._b_simple()
        measured = self._n_updates > 0
        g2, s = self._moments.means()[:2] if measured else (None, None)
        se_g2, se_s, _ = self._moments.standard_errors() if measured else (None, None, None)
        b = self._micro_batch_size
        return NoiseTrackerReport(
            history=tuple(self._history), losses=tuple(self._losses), b_simple=b_simple,
            b_simple_error=error, grad_norm_sq=g2, grad_norm_sq_error=se_g2, trace_cov=s,
            trace_cov_error=se_s, measurable=b_simple is not None, reason=reason,
            n_updates=self._n_updates, micro_batch_size=b,
            effective_batch_size=None if b is None or self._n_micro is None else b * self._n_micro,
            n_micro=self._n_micro, ema=self.ema)
