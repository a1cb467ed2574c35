"""Lightning's ``Trainer``: ``BatchSizeCallback`` sets the batch size and
``accumulate_grad_batches`` so the global batch stays, and ``NoiseCallback`` follows the
gradient noise scale, the losses and the data-stall share of each step from Lightning's own
``accumulate_grad_batches``.

Usage:
    >>> from batchwidgets.integrations.lightning import BatchSizeCallback  # doctest: +SKIP
    >>> trainer = Trainer(callbacks=[BatchSizeCallback(256, budget="8GiB")])  # doctest: +SKIP
    >>> from batchwidgets.integrations.lightning import NoiseCallback      # doctest: +SKIP
    >>> callback = NoiseCallback()                                          # doctest: +SKIP
    >>> trainer = Trainer(accumulate_grad_batches=4, callbacks=[callback])  # doctest: +SKIP
    >>> trainer.fit(module, loader)                                         # doctest: +SKIP
    >>> callback.tracker.report.schedule                                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..engine import as_batch_maker, to_device
from ..engine.noise import NoiseTracker
from ..engine.probe import find_batch
from ..results import BatchSplitReport
from ._feed import feeding
from ._fit import check_global, fit_options, split_report

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.parsing import (
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )
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


# NOTE [ The loop Lightning runs ]
# BatchSizeCallback probes, in ``on_fit_start`` (the model on its device, the optimizers made,
# the train dataloader not yet), the step the fit loop will run: batches of the train
# dataloader's dataset through its collate_fn (the largest sample: NOTE [ The worst case of
# varying inputs ]), moved by the strategy, ``training_step`` inside the precision plugin's
# context (autocast for "bf16-mixed" and "16-mixed"), backward (through the plugin's
# GradScaler), the trainer's first optimizer's step and zero_grad; ``self.log`` does nothing
# during the probe (no loop records it). It is find_batch's ``step=`` form on the
# LightningModule, so the module, the optimizer, the scaler and the RNGs are as they were
# afterwards. Then the module's (or datamodule's, or hparams') ``batch_size`` and
# ``trainer.accumulate_grad_batches`` are set, and the fit loop builds its dataloader with them.


class BatchSizeCallback(Callback):
    """Train at the global batch you meant, at the per-device batch that fits.

    At the start of ``fit`` probes the loop Lightning runs (NOTE [ The loop Lightning runs ])
    with ``find_batch``, which remembers its answer (a resumed run gets the same batch at
    once), then sets the ``batch_size`` attribute the train dataloader reads (on the module, its
    hparams or the datamodule) and ``trainer.accumulate_grad_batches`` so that batch size x
    accumulation x world size equals the global batch, the batch size the largest divisor of
    global batch / world size that fits (``batchwidgets.split_batch``); the learning rate stays.
    ``callback.report`` is the ``BatchSplitReport``.

    Parameters
    ----------
    global_batch_size : int, optional
        Examples per optimizer update over all devices. Default: what the run gives now
        (``batch_size x accumulate_grad_batches x world_size``).
    **options
        ``find_batch``'s options (``budget="8GiB"``, ``headroom=0.8``, ``refresh=True``...).

    Examples
    --------
    >>> callback = BatchSizeCallback(global_batch_size=256, budget="8GiB")  # doctest: +SKIP
    >>> Trainer(callbacks=[callback]).fit(module, datamodule=data)         # doctest: +SKIP
    >>> callback.report.summary()                                          # doctest: +SKIP
    """

    def __init__(self, global_batch_size: int | None = None, **options: Any) -> None:
        check_global(global_batch_size)
        self.global_batch_size = global_batch_size
        self.options = fit_options(options, "BatchSizeCallback")
        self.report: BatchSplitReport | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not lightning_hasattr(pl_module, "batch_size"):
            raise AttributeError(
                "BatchSizeCallback sets the batch_size its train dataloader reads, but the "
                "LightningModule, its hparams and the datamodule have none; give the one "
                "whose train_dataloader() builds the DataLoader a batch_size attribute and "
                "use it there (a DataLoader passed to fit() cannot be changed).")
        source = trainer.fit_loop._data_source  # what setup_data reads the loader from
        if not source.is_module():
            raise ValueError("BatchSizeCallback sets the batch_size a train_dataloader() reads, "
                             "but fit() was given a DataLoader, whose batch size is fixed; give "
                             "the LightningModule (or a datamodule) a train_dataloader() that "
                             "builds it with self.batch_size.")
        loader = source.dataloader()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError(f"BatchSizeCallback reads the train dataloader's dataset, but "
                            f"train_dataloader() gave a {type(loader).__name__}; return a "
                            f"torch DataLoader.")
        world = trainer.world_size
        global_batch_size = self.global_batch_size or (
            lightning_getattr(pl_module, "batch_size") * trainer.accumulate_grad_batches * world)
        optimizer = trainer.optimizers[0]
        plugin = trainer.strategy.precision_plugin
        step = _training_step(trainer, pl_module, as_batch_maker(loader), optimizer)
        options = {"scaler": getattr(plugin, "scaler", None), **self.options}
        with _without_logging(pl_module):
            probe = find_batch(pl_module, step=step, optimizer=optimizer, **options)
        self.report = split_report(probe, global_batch_size, world, stacklevel=1)
        lightning_setattr(pl_module, "batch_size", self.report.per_device_batch_size)
        trainer.accumulate_grad_batches = self.report.accumulation_steps


def _training_step(trainer: Any, pl_module: Any, make: Callable[[int], Any],
                   optimizer: torch.optim.Optimizer) -> Callable[[int], None]:
    """One step of Lightning's fit loop at ``batch_size`` (NOTE [ The loop Lightning runs ])."""
    plugin = trainer.strategy.precision_plugin
    scaler = getattr(plugin, "scaler", None)

    def step(batch_size: int) -> None:
        pl_module.train()
        batch = to_device(make(batch_size), pl_module.device)
        with plugin.train_step_context():
            output = pl_module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, Mapping) else output
        del output
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@contextlib.contextmanager
def _without_logging(pl_module: Any) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing while the probe runs training_step."""
    def ignore(*_args: Any, **_kwargs: Any) -> None:
        return None

    pl_module.log = pl_module.log_dict = ignore
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
