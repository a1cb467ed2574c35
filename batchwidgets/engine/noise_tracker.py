"""``NoiseTracker``: per-batch losses and the gradient noise scale, followed online during
ordinary training from the micro-batches that ``accumulate`` already produces, or, without
micro-batches, by splitting every K-th batch in parts (``tracker.measure``).

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
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import functional_call
from torch.utils.data import DataLoader, SequentialSampler

from .._warnings import BatchwidgetsWarning
from ..results import NoiseTrackerReport
from ._state import RngState

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
_SPLIT = ("or call tracker.measure(model, loss_fn, batch) in the loop, which splits every K-th "
          "batch (NoiseTracker(every=K)) in parts at one extra forward+backward of that batch")
NO_MICRO_BATCHES = ("the gradient noise scale is not measured without micro-batches: pass "
                    f"noise=tracker to accumulate(steps>=2), use DDP micro-batches, {_SPLIT}")


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


def _sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(
        g, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None,
    ).double().square() for g in grads]).sum()


def split_sq_norms(model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                   inputs: torch.Tensor, targets: Any, parts: int) -> tuple[list[float], float]:
    """Squared gradient norms of ``parts`` equal parts of a batch and of their mean, from
    ``torch.autograd.grad`` on detached aliases of the weights: no ``.grad``, parameter hook,
    buffer (BatchNorm statistics) or random generator of the user's changes."""
    size = inputs.shape[0] // parts
    weights = {name: p.detach().requires_grad_(True) for name, p in model.named_parameters()
               if p.requires_grad}
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = RngState()
    try:
        total, squares = None, []
        with torch.enable_grad():
            for i in range(parts):
                part = slice(i * size, (i + 1) * size)
                part_targets = targets[part] if isinstance(targets, torch.Tensor) else targets
                output = functional_call(model, weights, (inputs[part],))
                grads = torch.autograd.grad(loss_fn(output, part_targets),
                                            list(weights.values()), allow_unused=True)
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


class NoiseTracker:
    """Follow per-batch losses and the gradient noise scale B_simple during training.

    Two ways to measure (see NOTE [ The two-batch-size estimator ]):

    * with micro-batches: ``accumulate(optimizer, steps=k, model=model, noise=tracker)`` gives
      one estimate per update from its ``k`` micro-batches, for one extra gradient-norm
      reduction per parameter per micro-step and one host sync per update; losses are recorded
      too. DDP micro-batches count as well.
    * without: call ``tracker.measure(model, loss_fn, (x, y))`` in the loop. Every ``every``-th
      call splits that batch into ``parts`` and computes each part's gradient again with
      ``torch.autograd.grad``: one extra forward and backward of the batch per measured step,
      so about ``1/every`` more compute (10% at ``every=10``). Record losses with
      ``observe_loss(loss)``.

    Parameters
    ----------
    ema : float
        Weight of the past in the moving averages of |G|^2 and tr(Sigma), in [0, 1).
    warmup_updates : int
        Estimates needed before B_simple is reported.
    max_losses : int
        Losses kept (the oldest are dropped).
    every : int
        ``measure`` measures on its first call and then on every ``every``-th.
    loader : DataLoader, optional
        The loader training reads; one that does not shuffle gives a ``BatchwidgetsWarning``
        (consecutive batches are not random samples), also kept in ``report.warnings``.

    Examples
    --------
    >>> tracker = NoiseTracker(ema=0.99)                               # doctest: +SKIP
    >>> with accumulate(optimizer, steps=4, model=model, noise=tracker):  # doctest: +SKIP
    ...     train()
    >>> tracker.report.advice                                           # doctest: +SKIP
    """

    def __init__(self, ema: float = 0.9, warmup_updates: int = 5, *, max_losses: int = 10_000,
                 every: int = 1, loader: DataLoader | None = None) -> None:
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 <= ema < 1:
            raise ValueError(f"ema should be a number in [0, 1), but got ema={ema!r}; e.g. "
                             f"ema=0.9 averages over about the last 10 updates.")
        for name, value in (("warmup_updates", warmup_updates), ("max_losses", max_losses),
                            ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} should be an int >= 1, but got {name}={value!r}.")
        if loader is not None and not isinstance(loader, DataLoader):
            raise TypeError(f"loader should be a torch DataLoader, but got loader={loader!r}.")
        self.ema, self.warmup_updates, self.every = float(ema), warmup_updates, every
        self._moments = _WeightedMoments(self.ema)
        self._losses: deque[float] = deque(maxlen=max_losses)
        self._n_losses = 0
        self._history: list[tuple[int, float | None, float, float]] = []
        self._history_errors: list[float | None] = []
        self._n_updates = self._n_single = self._n_calls = 0
        self._sizes: Counter[tuple[int | None, int]] = Counter()  # (micro-batch, n_micro) seen
        self._measured_by = "micro-batches"
        self._listeners: list[Callable[[NoiseTracker], None]] = []
        self._warnings = tuple(filter(None, (unshuffled_loader_warning(loader),
                                             uneven_loader_warning(loader))))
        for message in self._warnings:
            warnings.warn(f"{message}.", BatchwidgetsWarning, stacklevel=2)

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
        self._losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
        self._n_losses += 1
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
        self._sizes[micro_batch_size, n_micro] += 1
        grad_norm_sq, trace_cov = estimate(small_sq_norms, big_sq_norm, micro_batch_size or 1,
                                           n_micro)
        self._moments.add(grad_norm_sq, trace_cov)
        self._n_updates += 1
        b_simple, error, _ = self._b_simple()
        self._history.append((self._n_updates, b_simple, *self._moments.means()[:2]))
        self._history_errors.append(error)
        self._notify()

    def measure(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                batch: tuple[Any, Any], *, parts: int = 2) -> bool:
        """Measure the noise scale from one batch when no micro-batches are at hand.

        On the first call and every ``every``-th after it, the batch's first ``parts * m``
        examples (``m = len(batch) // parts``) are split into ``parts`` parts of ``m``, and each
        part's gradient of ``loss_fn`` (mean-reduced) is computed with ``torch.autograd.grad``:
        part size ``m`` and the whole ``parts * m`` are the two batch sizes of the estimator.
        Cost: one extra forward and backward of the batch per measured step, about
        ``1/every`` of the training compute. The model's weights, ``.grad``, BatchNorm
        statistics and the random generators are left as they were; call it before the
        training step, so that it sees the weights the step sees.

        Parameters
        ----------
        model : torch.nn.Module
            The model (a DDP wrapper is measured through its ``.module``, without all-reduce).
        loss_fn : callable
            ``loss_fn(output, target) -> scalar``, the mean over the examples.
        batch : (inputs, targets)
            The training batch; ``inputs`` is a tensor split along its first dimension.
        parts : int
            Parts of the batch, >= 2.

        Returns
        -------
        bool
            True when this call measured, False when it was skipped (``every``).

        Examples
        --------
        >>> tracker = NoiseTracker(every=10)                              # doctest: +SKIP
        >>> for x, y in loader:                                             # doctest: +SKIP
        ...     tracker.measure(model, loss_fn, (x, y))
        ...     loss = loss_fn(model(x), y); loss.backward(); tracker.observe_loss(loss)
        ...     optimizer.step(); optimizer.zero_grad()
        """
        inputs, targets = _check_measure(model, loss_fn, batch, parts)
        self._n_calls += 1
        if (self._n_calls - 1) % self.every:
            return False
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        small, big = split_sq_norms(model, loss_fn, inputs, targets, parts)
        self._measured_by = "split batches"
        self.update(small_sq_norms=small, big_sq_norm=big,
                    micro_batch_size=inputs.shape[0] // parts, n_micro=parts)
        return True

    def _b_simple(self) -> tuple[float | None, float | None, str]:
        """(B_simple, its standard error, reason it is not measurable or '')."""
        if self._n_updates == 0:
            return None, None, (NO_MICRO_BATCHES if not self._n_single else
                                f"every update had one micro-batch: use accumulate(steps>=2), "
                                f"{_SPLIT}")
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
        # the usual sizes: a smaller last batch or remainder group does not change them
        (b, n_micro), _ = self._sizes.most_common(1)[0] if measured else ((None, None), 0)
        return NoiseTrackerReport(
            history=tuple(self._history), losses=tuple(self._losses), b_simple=b_simple,
            b_simple_error=error, grad_norm_sq=g2, grad_norm_sq_error=se_g2, trace_cov=s,
            trace_cov_error=se_s, measurable=b_simple is not None, reason=reason,
            n_updates=self._n_updates, micro_batch_size=b,
            effective_batch_size=None if b is None or n_micro is None else b * n_micro,
            n_micro=n_micro, ema=self.ema, history_errors=tuple(self._history_errors),
            n_losses=self._n_losses, measured_by=self._measured_by, every=self.every,
            warnings=self._warnings)


def _check_measure(model: Any, loss_fn: Any, batch: Any, parts: Any) -> tuple[Any, Any]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got model={model!r}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn should be a callable loss_fn(output, target) -> scalar, but "
                        f"got loss_fn={loss_fn!r}; e.g. torch.nn.functional.cross_entropy.")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
        raise ValueError(f"parts should be an int >= 2, but got parts={parts!r}; e.g. parts=2.")
    if (not isinstance(batch, (tuple, list)) or len(batch) != 2
            or not isinstance(batch[0], torch.Tensor)):
        raise TypeError(f"batch should be an (inputs, targets) pair with a tensor of inputs, "
                        f"but got batch of type {type(batch).__name__}; e.g. "
                        f"tracker.measure(model, loss_fn, (x, y)).")
    if batch[0].dim() == 0 or batch[0].shape[0] < parts:
        raise ValueError(f"the batch should hold at least parts={parts} examples, but its inputs "
                         f"have shape {tuple(batch[0].shape)}; use fewer parts.")
    return batch[0], batch[1]
