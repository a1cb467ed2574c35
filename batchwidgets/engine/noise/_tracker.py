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
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport, CriticalBatchReport, NoisePoint, NoiseTrackerReport
from .._unsharded import unsharded
from .._util import check_int, check_number
from ._estimate import (
    DeferredUpdate,
    WeightedMoments,
    b_simple_of,
    check_measure,
    estimate,
    merge_moments,
    split_sq_norms,
    uneven_loader_warning,
    unshuffled_loader_warning,
)
from ._schedule import UpdateSampler

# See NOTE [ The two-batch-size estimator ] and NOTE [ The prefix-sum estimator ] in
# noise/_estimate.py.

_MAX_DEFERRED = 256  # updates kept on the device at most, listener or not (one sync each 256)


class NoiseTracker:
    """Follow per-batch losses and the gradient noise scale B_simple during training.

    Two ways to measure (see NOTE [ The two-batch-size estimator ]):

    * with micro-batches: ``accumulate(optimizer, steps=k, model=model, noise=tracker)`` gives
      one estimate per update, from the gradient of its first micro-batch and that of all
      ``k`` (two fused ``torch._foreach_norm`` per update, see NOTE [ The prefix-sum
      estimator ]), and records the losses, with no host sync per update: the numbers stay on
      the device until ``report`` is read, the block ends, or a listener is due. With
      ``accumulate(track_grad_norms=True)``, and under DDP, per-parameter hooks see every
      micro-batch gradient: the same estimate with less spread (for the same error bar, half
      the updates at B_simple >= 16 micro-batches, a 30th to a 50th at a quarter of one), for
      a Python hook and a reduction per parameter per micro-step.
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
    every_micro_batch : bool
        Under ``accumulate``: True takes the squared gradient norm of every micro-batch (a
        gradient hook and one reduction per parameter per micro-step), the tighter estimate;
        False only that of the first micro-batch of each update, read from ``.grad`` with one
        fused reduction per update (cheapest, for steps of a few milliseconds on a GPU), which
        needs about 2-10x more updates for the same error bar (NOTE [ The prefix-sum
        estimator ]). Under DDP every micro-batch is always used.
    flush_every : int
        With a listener attached, the updates ``accumulate`` leaves on the device are read
        (one host sync) and the listeners told once ``flush_every`` are waiting ...
    flush_interval_s : float
        ... or once this many seconds of ``clock`` have passed since the last read.
    clock : callable
        Seconds, for ``flush_interval_s``.
    max_batch_size : int, optional
        The largest batch ``report.schedule`` (and ``accumulate(steps="auto")``) may suggest.
    fits : BatchSizeReport or int, optional
        The largest batch that fits in memory (``find_batch``'s report: its
        ``recommended_batch_size``): the schedule says whether its batch needs accumulation.
    overhead_target : float or None
        Under ``accumulate``, measure 1 update in k, with k from the measured cost of the
        tracker, so that it takes at most this share of the training time (default 2%); None
        measures every update. See NOTE [ Sampling updates to keep the tracker cheap ].
    critical : CriticalBatchReport, optional
        ``critical_batch``'s: ``report.schedule`` and ``steps="auto"`` follow it, not B_simple;
        ``tracker.critical = bw.critical_batch(...)`` again at a checkpoint ramps the batch.

    Examples
    --------
    >>> tracker = NoiseTracker(ema=0.99)                               # doctest: +SKIP
    >>> with accumulate(optimizer, steps=4, model=model, noise=tracker):  # doctest: +SKIP
    ...     train()
    >>> tracker.report.advice                                           # doctest: +SKIP
    """

    def __init__(self, ema: float = 0.9, warmup_updates: int = 5, *, max_losses: int = 10_000,
                 every: int = 1, loader: DataLoader | None = None,
                 every_micro_batch: bool = True, flush_every: int = 16,
                 flush_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 max_batch_size: int | None = None, fits: BatchSizeReport | int | None = None,
                 overhead_target: float | None = 0.02,
                 critical: CriticalBatchReport | None = None) -> None:
        check_number("ema", ema, lambda v: 0 <= v < 1, "a number in [0, 1)",
                     "; e.g. ema=0.9 averages over about the last 10 updates")
        for name, value in (("warmup_updates", warmup_updates), ("max_losses", max_losses),
                            ("every", every), ("flush_every", flush_every)):
            check_int(name, value, 1)
        check_number("flush_interval_s", flush_interval_s, lambda v: v >= 0, "a number >= 0",
                     "; e.g. 1.0")
        check_int("max_batch_size", max_batch_size, 1, optional=True, hint="; e.g. 4096")
        fits = fits.recommended_batch_size if isinstance(fits, BatchSizeReport) else fits
        check_int("fits", fits, 1, optional=True, hint="; a find_batch report or an int, e.g. "
                  "fits=bw.find_batch(model, make_batch)")
        if overhead_target is not None:
            check_number("overhead_target", overhead_target, lambda v: 0 < v < 1,
                         "None or a share in (0, 1)", "; e.g. 0.02 for 2%")
        if loader is not None and not isinstance(loader, DataLoader):
            raise TypeError(f"loader should be a torch DataLoader, but got loader={loader!r}.")
        if not isinstance(every_micro_batch, bool):
            raise TypeError(f"every_micro_batch should be True or False, but got "
                            f"every_micro_batch={every_micro_batch!r}.")
        self.ema, self.warmup_updates, self.every = float(ema), warmup_updates, every
        self.every_micro_batch = every_micro_batch
        self.flush_every, self.flush_interval_s = flush_every, float(flush_interval_s)
        self._clock = clock
        self.max_batch_size, self.fits_batch_size = max_batch_size, fits
        self.overhead_target = None if overhead_target is None else float(overhead_target)
        self.sampler = UpdateSampler(self.overhead_target)  # accumulate's; see _schedule.py
        self._n_skipped = 0  # updates sampling left unmeasured
        self._stall_shares: deque[float] = deque(maxlen=max_losses)
        self._moments = WeightedMoments(self.ema)
        self._losses: deque[float] = deque(maxlen=max_losses)
        self._n_losses = 0
        self._history: list[NoisePoint] = []
        self._n_updates = self._n_single = self._n_calls = 0
        self._sizes: Counter[tuple[int | None, int]] = Counter()  # (micro-batch, n_micro) seen
        self._measured_by = "micro-batches"
        self._listeners: list[Callable[[NoiseTracker], None]] = []
        self.critical = critical
        self._examples: tuple[int, float, float] = (0, 0.0, 0.0)  # per-example losses: n, mean, M2
        # updates accumulate left on the device, oldest first; see flush()
        self._deferred: list[tuple[torch.Tensor, DeferredUpdate]] = []
        self._last_flush_s = clock()
        self._lock = threading.RLock()  # a panel may read the report from another thread
        self._warnings = tuple(filter(None, (unshuffled_loader_warning(loader),
                                             uneven_loader_warning(loader))))
        for message in self._warnings:
            warnings.warn(f"{message}.", BatchwidgetsWarning, stacklevel=2)

    def add_listener(self, listener: Callable[[NoiseTracker], None]) -> None:
        """Call ``listener(tracker)`` after every recorded loss and update (a live panel redraws
        from it; it should be cheap). Those from ``accumulate`` come in bursts, when they are
        read from the device: every ``flush_every`` updates or ``flush_interval_s``, and at the
        end of the block. A listener that raises is removed with a warning, so a broken display
        never stops training."""
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
        """Record one batch's loss: a float or a 0-dim tensor, or the per-example losses of
        ``reduction='none'`` (a tensor with one value per example), whose mean is the batch's
        loss and whose spread the report keeps (``example_loss_std``)."""
        if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() > 1:
            values = loss.detach().flatten().double()
            mean = values.mean()
            value, m2 = torch.stack([mean, (values - mean).square().sum()]).tolist()
            with self._lock:
                self._examples = merge_moments(self._examples, values.numel(), value, m2)
        else:
            value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        with self._lock:
            self.flush()  # the deferred updates came first
            self._add_loss(value)

    def observe_step_time(self, step_s: float, data_s: float) -> None:
        """Record one optimizer step's wall time and the part of it spent waiting for data
        (the trainer callbacks call this); the report keeps each step's share."""
        if step_s > 0:
            with self._lock:
                self._stall_shares.append(min(max(data_s / step_s, 0.0), 1.0))

    def skip_update(self) -> None:
        """An update that sampling left unmeasured (see UpdateSampler), told by a feed."""
        with self._lock:
            self._n_skipped += 1

    def _estimate(self) -> tuple[float | None, float | None, str]:
        """B_simple, its error and why it is None, from all the updates so far."""
        with self._lock:
            self.flush()
            return self._b_simple()

    def update(self, *, small_sq_norms: Sequence[float], big_sq_norm: float,
               micro_batch_size: int | None, n_micro: int) -> None:
        """Add one update: the squared gradient norms of its micro-batches (unscaled), that of
        their average, the micro-batch size (None: unknown, counted in micro-batches) and the
        number of micro-batches averaged (``k``, times the world size under DDP)."""
        with self._lock:
            self.flush()
            self._add_update(estimate, small_sq_norms, big_sq_norm, micro_batch_size, n_micro)

    def flush(self) -> None:
        """Read the updates ``accumulate`` left on the device (one host sync for all of them),
        fold them into the moving averages in order, and tell the listeners after each loss
        and update. Reading ``report`` does this first; so does the end of the block."""
        with self._lock:
            if not self._deferred:
                return
            deferred, self._deferred = self._deferred, []
            self._last_flush_s = self._clock()
            device = deferred[0][0].device
            values = torch.cat([v if v.device == device else v.to(device)
                                for v, _ in deferred]).tolist()
            start = 0
            for _, record in deferred:
                self._fold(values[start:start + record.n_values], record)
                start += record.n_values

    def defer(self, values: torch.Tensor, record: DeferredUpdate) -> None:
        """Keep one update's device values (see ``DeferredUpdate``) without a host sync: what a
        feed (accumulate's, a trainer callback's) hands the tracker each update."""
        with self._lock:
            self._deferred.append((values, record))
            waiting = len(self._deferred)
            if waiting >= _MAX_DEFERRED or (self._listeners and (
                    waiting >= self.flush_every
                    or self._clock() - self._last_flush_s >= self.flush_interval_s)):
                self.flush()

    def _fold(self, values: list[float], record: DeferredUpdate) -> None:
        for loss in values[:record.n_losses]:
            self._add_loss(loss)
        if record.small is None:
            return
        small = values[record.n_losses:-1]
        if record.small == "norms":
            small = [norm * norm for norm in small]
        self._add_update(estimate, small, values[-1], record.micro_batch_size, record.n_micro)

    def _add_loss(self, loss: float) -> None:
        self._losses.append(loss)
        self._n_losses += 1
        self._notify()

    def _add_update(self, estimator: Callable[..., tuple[float, float]], norms: Sequence[float],
                    big_sq_norm: float, micro_batch_size: int | None, n_micro: int) -> None:
        values = [*norms, big_sq_norm]
        if n_micro < 2 or not norms or not all(map(math.isfinite, values)):
            self._n_single += n_micro < 2  # nothing to compare; inf/NaN steps are skipped
            self._notify()
            return
        self._sizes[micro_batch_size, n_micro] += 1
        grad_norm_sq, trace_cov = estimator(norms, big_sq_norm, micro_batch_size or 1, n_micro)
        self._moments.add(grad_norm_sq, trace_cov)
        self._n_updates += 1
        b_simple, error, _ = self._b_simple()
        self._history.append(NoisePoint(self._n_updates, b_simple, *self._moments.means()[:2],
                                        b_simple_error=error))
        self._notify()

    def measure(self, model: torch.nn.Module,
                loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, batch: Any = None, *,
                parts: int = 2) -> bool:
        """Measure the noise scale from one batch when no micro-batches are at hand.

        On the first call and every ``every``-th after it, the batch's first ``parts * m``
        examples (``m`` = its examples // ``parts``) are split into ``parts`` parts of ``m``,
        and each part's gradient of the loss (mean-reduced) is computed with
        ``torch.autograd.grad``:
        part size ``m`` and the whole ``parts * m`` are the two batch sizes of the estimator.
        Cost: one extra forward and backward of the batch per measured step, about
        ``1/every`` of the training compute. The model's weights, ``.grad``, BatchNorm
        statistics and the random generators are left as they were; call it before the
        training step, so that it sees the weights the step sees.

        Parameters
        ----------
        model : torch.nn.Module
            The model (a DDP wrapper is measured through its ``.module``, without all-reduce).
        loss_fn : callable, optional
            ``loss_fn(output, target) -> scalar``, the mean over the examples; None (or
            ``measure(model, batch)``): the output's ``.loss`` (Hugging Face models).
        batch : (x, ..., y), dict or BatchEncoding
            The training batch, fed as ``find_batch`` feeds it (see "Batches and losses" in
            docs/find_batch.md) and split along the first dimension of its tensors.
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
        if batch is None and loss_fn is not None and not callable(loss_fn):
            loss_fn, batch = None, loss_fn  # measure(model, batch)
        size = check_measure(model, loss_fn, batch, parts)
        self._n_calls += 1
        if (self._n_calls - 1) % self.every:
            return False
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        model = unsharded(model)  # FSDP2: see NOTE [ An unsharded replica ]
        small, big = split_sq_norms(model, loss_fn, batch, parts)
        self._measured_by = "split batches"
        self.update(small_sq_norms=small, big_sq_norm=big, micro_batch_size=size // parts,
                    n_micro=parts)
        return True

    def _b_simple(self) -> tuple[float | None, float | None, str]:
        """(B_simple, its standard error, reason it is not measurable or '')."""
        return b_simple_of(self._moments, self._n_updates, self._n_single, self.warmup_updates)

    @property
    def report(self) -> NoiseTrackerReport:
        with self._lock:
            self.flush()
            return self._report()

    @property
    def critical(self) -> CriticalBatchReport | None:
        """The measured critical batch the schedule follows (``critical_batch``'s report)."""
        return self._critical

    @critical.setter
    def critical(self, report: CriticalBatchReport | None) -> None:
        if report is not None and not isinstance(report, CriticalBatchReport):
            raise TypeError(f"critical should be a CriticalBatchReport (bw.critical_batch(...)) "
                            f"or None, but got critical={report!r}.")
        self._critical = report
        self._notify()  # a panel shows it

    def _report(self) -> NoiseTrackerReport:
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
            n_micro=n_micro, ema=self.ema,
            n_losses=self._n_losses, measured_by=self._measured_by, every=self.every,
            warnings=self._warnings, n_examples=self._examples[0],
            example_loss_mean=self._examples[1] if self._examples[0] else None,
            example_loss_std=(math.sqrt(self._examples[2] / (self._examples[0] - 1))
                              if self._examples[0] > 1 else None),
            max_batch_size=self.max_batch_size, fits_batch_size=self.fits_batch_size,
            sample_every=self.sampler.every, overhead=self.sampler.overhead,
            overhead_target=self.overhead_target,
            n_updates_seen=self._n_updates + self._n_skipped,
            data_stall_shares=tuple(self._stall_shares), critical=self._critical)
