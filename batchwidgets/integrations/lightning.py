"""``NoiseCallback`` for Lightning's ``Trainer``: the gradient noise scale, the losses and the
data-stall share of each step from Lightning's own ``accumulate_grad_batches``.

Usage:
    >>> from batchwidgets.integrations.lightning import NoiseCallback      # doctest: +SKIP
    >>> callback = NoiseCallback()                                          # doctest: +SKIP
    >>> trainer = Trainer(accumulate_grad_batches=4, callbacks=[callback])  # doctest: +SKIP
    >>> trainer.fit(module, loader)                                         # doctest: +SKIP
    >>> callback.tracker.report.schedule                                    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..engine.noise import NoiseTracker
from ._feed import feeding

try:
    from lightning.pytorch import Callback
except ImportError as error:  # an optional extra
    raise ImportError("batchwidgets.integrations.lightning needs lightning: pip install "
                      "lightning (or 'batchwidgets[test]')") from error


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    values = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (list, tuple)) else ())
    for value in values:
        size = _batch_size(value)
        if size is not None:
            return size
    return None


class NoiseCallback(Callback):
    """Follow the gradient noise scale of a Lightning run in a ``NoiseTracker``.

    With ``Trainer(accumulate_grad_batches=k >= 2)``, each update gives one estimate from
    Lightning's own micro-batches (see NOTE [ Feeding the tracker from a trainer's
    accumulation ]): the gradient after the first micro-batch's backward, and the update's
    gradient in ``on_before_optimizer_step`` (before Lightning clips). The losses come from
    ``on_before_backward`` (times k, Lightning having divided by it), the data-stall share of
    each step from the time between a micro-step's end and the next batch's start. The tracker
    samples updates to stay under its ``overhead_target``. Nothing of the training changes.

    ``NoiseCallback(tracker=None, *, panel=None)``: the ``NoiseTracker`` to feed (kept as
    ``callback.tracker``; a new one if None), and whether to show a live ``NoisePanel`` (None:
    when running in a notebook).

    Examples
    --------
    >>> callback = NoiseCallback()                                       # doctest: +SKIP
    >>> trainer = Trainer(accumulate_grad_batches=4, callbacks=[callback])  # doctest: +SKIP
    >>> trainer.fit(module, data)                                        # doctest: +SKIP
    >>> callback.tracker.report.advice                                   # doctest: +SKIP
    """

    def __init__(self, tracker: NoiseTracker | None = None, *, panel: bool | None = None) -> None:
        feeding(self, tracker, panel)
        self._stepped = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._feed.start(list(pl_module.parameters()), scaler=scaler)
        self._micro, self._stepped = 0, False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._feed.data_ready()
        self._feed.micro_batch_size = _batch_size(batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._feed.loss(loss.detach() * trainer.accumulate_grad_batches)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.accumulate_grad_batches > 1:  # else no estimate: nothing to read
            self._feed.after_backward(self._micro)
        else:
            self._feed.n_micro = 1

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning divides each loss by k = accumulate_grad_batches, also in an epoch's
        # shorter last update of n micro-batches: .grad_1 = g_1 / k, .grad = mean * n / k; a
        # GradScaler has unscaled .grad by now, not .grad_1
        k = trainer.accumulate_grad_batches
        self._feed.before_optimizer_step(first_scale=k, mean_scale=k / (self._micro + 1),
                                         big_is_scaled=False)
        self._stepped = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._feed.micro_step_done()
        if self._stepped:
            self._feed.update_done()
            self._micro, self._stepped = 0, False
        else:
            self._micro += 1

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._feed.finish()
