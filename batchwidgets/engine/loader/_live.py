"""``live_loader``: the DataLoader of a training loop that is running, whose worker settings
switch at its next batch (from code, another thread or a panel) without losing the epoch's
place, with that loop's own samples/s and time waiting for data measured.

Usage:
    >>> import torch, batchwidgets as bw
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
    >>> live = bw.live_loader(data, batch_size=4)
    >>> [batch[0].tolist() for batch in live]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    >>> live.set(num_workers=1)              # takes effect at the next batch
    >>> live.report().n_batches
    3
"""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..._kernel_poll import WidgetPoll
from ..._warnings import BatchwidgetsWarning
from ...results import LiveLoaderReport, LoaderSegment, LoaderSwitch
from ._autotune import Autotune
from ._checks import check_workers_can_unpickle, usable_cpus
from ._epoch import Epoch
from ._live_settings import SWITCHABLE, check_types, resolve, setting, starting_loader
from ._timing import shutdown


class LiveLoader(DataLoader):
    """A DataLoader whose ``num_workers``, ``pin_memory``, ``prefetch_factor`` and
    ``persistent_workers`` change at the next batch of the running epoch; see ``live_loader``."""

    num_workers = setting("num_workers")
    pin_memory = setting("pin_memory")
    prefetch_factor = setting("prefetch_factor")
    persistent_workers = setting("persistent_workers")

    def __init__(self, loader_or_dataset: DataLoader | Any, *, autotune: bool = False,
                 **settings: Any) -> None:
        kwargs, context = starting_loader(loader_or_dataset, settings)
        self._settings: dict[str, Any] = {}
        self._lock = threading.RLock()
        if not kwargs.get("num_workers"):  # DataLoader rejects these without workers
            kwargs.update(prefetch_factor=None, persistent_workers=False)
        super().__init__(**kwargs, multiprocessing_context=context if kwargs.get("num_workers")
                         else None)
        self._context = context
        check_types(self.settings, self.settings)
        self._requested = self.settings  # the latest settings asked for (``requested``)
        self._iterable = isinstance(self.dataset, IterableDataset)
        # As the wrapped loader: with persistent workers, one base seed for all epochs.
        self._draw_every_epoch = not (self.num_workers and self.persistent_workers)
        self._pending: tuple[dict[str, Any], str, str] | None = None
        self._between: tuple[dict[str, Any], str] | None = None
        self._segments: list[dict[str, Any]] = []
        self._switches: list[LoaderSwitch] = []
        self._notes: list[str] = []
        self._epochs = 0
        self._epoch: Epoch | None = None
        self._kept: tuple[DataLoader, Any] | None = None  # persistent workers between epochs
        # Clicks on any widget, while the loop's cell runs, land between batches (in a kernel).
        self._poll = WidgetPoll().poll
        self._tuner: Any = None
        self._ready = True
        self._check_workers(self.settings)
        self.autotune = autotune

    @property
    def autotune(self) -> bool:
        """Whether the loader retunes its settings from the loop's data stall (``_autotune``);
        set it to start or stop. ``set()`` by hand turns it off."""
        return self._tuner is not None

    @autotune.setter
    def autotune(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"autotune should be True or False, but got autotune={on!r}.")
        if on and self._tuner is None:
            self._tuner = Autotune(self.settings, max_workers=usable_cpus(),
                                   pin_memory=torch.cuda.is_available())
        elif not on:
            self._tuner = None

    @property
    def autotune_status(self) -> str:
        """What autotune is doing, in a line ("exploring 2 workers, prefetch 2 (trial 2 of at
        most 6)", "settled on 2 workers, prefetch 2: ..."); "" when it is off."""
        tuner = self._tuner
        return tuner.status if tuner is not None else ""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SWITCHABLE and self.__dict__.get("_ready"):
            self.set(**{name: value})
        else:
            super().__setattr__(name, value)

    @property
    def settings(self) -> dict[str, Any]:
        """The worker settings in force: ``set`` keywords."""
        return {name: self._settings[name] for name in SWITCHABLE}

    @property
    def requested(self) -> dict[str, Any]:
        """The settings from the next batch on: the latest asked for (by ``set``, a panel or
        autotune), in force or about to be; a panel's controls show these. Unlike the pending
        request, it never reads the old settings while a switch is under way."""
        with self._lock:
            return dict(self._requested)

    # -- switching -------------------------------------------------------------------------------

    def set(self, **settings: Any) -> None:
        """Switch any of ``num_workers``, ``pin_memory``, ``prefetch_factor``,
        ``persistent_workers``, from any thread. The running epoch switches at its next batch
        and carries on from the same place (an IterableDataset at its next epoch); before an
        epoch, the next one starts with them. Bad settings raise here, in one line, and the
        loader carries on as it was. Setting by hand turns autotune off."""
        self._request(settings, by="set")
        if self._tuner is not None:
            self._tuner = None

    def _request(self, settings: dict[str, Any], by: str) -> None:
        unknown = sorted(set(settings) - set(SWITCHABLE))
        if unknown:
            raise TypeError(f"settings should be among {list(SWITCHABLE)}, but got {unknown}; "
                            f"batch_size, the sampler and the dataset fix the epoch's batches: "
                            f"make a new live_loader to change them.")
        with self._lock:  # over the latest asked for, also while a switch is under way
            base = dict(self._requested)
        new = resolve(base, settings)
        self._check_workers(new)
        note = ""
        if self._iterable and self._epoch is not None and not self._epoch.finished:
            note = ("an IterableDataset cannot resume at a position: these settings apply at "
                    "the next epoch")
            if note not in self._notes:
                self._notes.append(note)
                warnings.warn(note, BatchwidgetsWarning, stacklevel=3)
        with self._lock:
            self._requested = new
            if self._epoch is None or self._epoch.finished:  # between epochs: in force now
                if self._between is None and new != self.settings:
                    self._between = (self.settings, by)
                self._apply(new)
                self._pending = None
            else:
                self._pending = None if new == self.settings else (new, by, note)

    def _take_between(self) -> tuple[dict[str, Any], str] | None:
        """The settings in force before ``set`` calls made between epochs, and who made them."""
        with self._lock:
            between, self._between = self._between, None
        return between if between is not None and between[0] != self.settings else None

    def _check_workers(self, new: dict[str, Any]) -> None:
        """Workers started by spawn or forkserver must unpickle the dataset: a one-line error
        now, not a traceback from a worker in the middle of the epoch."""
        check_workers_can_unpickle(types.SimpleNamespace(
            num_workers=new["num_workers"], multiprocessing_context=self._context,
            dataset=self.dataset, collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn))

    def _take_pending(self, epoch_start: bool) -> tuple[dict[str, Any], str, str] | None:
        """The settings asked for, to apply now: at any batch, or at an epoch's start only for
        an IterableDataset (it cannot resume at a position)."""
        if self._pending is None or (self._iterable and not epoch_start):
            return None  # the common case, without the lock
        with self._lock:
            pending, self._pending = self._pending, None
        return None if pending is None or pending[0] == self.settings else pending

    def _apply(self, new: dict[str, Any]) -> None:
        with self._lock:
            self._settings.update(new)

    def _inner_loader(self, feed: Any, generator: torch.Generator) -> DataLoader:
        """A DataLoader with the settings in force over ``feed`` (the epoch's index batches), or
        over the dataset itself for an IterableDataset."""
        settings = self.settings
        workers = settings["num_workers"]
        kwargs: dict[str, Any] = {
            "num_workers": workers, "pin_memory": settings["pin_memory"],
            "prefetch_factor": settings["prefetch_factor"] if workers else None,
            "persistent_workers": settings["persistent_workers"] and workers > 0,
            "collate_fn": self.collate_fn, "worker_init_fn": self.worker_init_fn,
            "timeout": self.timeout, "generator": generator,
            "multiprocessing_context": self._context if workers else None}
        if hasattr(self, "in_order"):  # PyTorch >= 2.6; batches in order, always
            kwargs["in_order"] = True
        if feed is None:
            kwargs.update(batch_size=self.batch_size, drop_last=self.drop_last)
        elif self._auto_collation:
            kwargs["batch_sampler"] = feed
        else:
            kwargs.update(batch_size=None, sampler=feed)
        return DataLoader(self.dataset, **kwargs)

    def _keep(self, inner: DataLoader, feed: Any) -> None:
        self._drop_kept()
        self._kept = (inner, feed)

    def _take_kept(self, settings: dict[str, Any]) -> tuple[DataLoader, Any] | None:
        """The kept inner loader if its persistent workers run ``settings``; else stop them."""
        kept = self._kept
        if kept is not None and settings["persistent_workers"] and settings == {
                "num_workers": kept[0].num_workers, "pin_memory": kept[0].pin_memory,
                "prefetch_factor": kept[0].prefetch_factor, "persistent_workers": True}:
            self._kept = None
            return kept
        self._drop_kept()
        return None

    def _drop_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            shutdown(kept[0]._iterator)
            kept[0]._iterator = None

    # -- iterating -------------------------------------------------------------------------------

    def __iter__(self) -> Epoch:
        """One epoch. A new one ends the one before (its persistent workers carry on)."""
        if self._epoch is not None:
            self._epoch.close()
        self._epoch = Epoch(self, self._epochs)
        self._epochs += 1
        return self._epoch

    def close(self) -> None:
        """Stop every worker now, persistent ones too (also done when the loader is collected)."""
        if self.__dict__.get("_epoch") is not None:
            self._epoch._end(keep=False)
        if self.__dict__.get("_ready"):
            self._drop_kept()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the workers' finalizers do
            self.close()

    # -- measuring -------------------------------------------------------------------------------

    def _record(self, wall_s: float, wait_s: float, samples: int, epoch: int,
                batch: int) -> None:
        with self._lock:
            segment = self._segments[-1] if self._segments else None
            if segment is None or segment["settings"] != self._settings:
                segment = {"settings": dict(self._settings), "n_batches": 0, "n_samples": 0,
                           "wall_s": 0.0, "wait_s": 0.0, "epoch": epoch, "batch": batch}
                self._segments.append(segment)
            segment["n_batches"] += 1
            segment["n_samples"] += samples
            segment["wall_s"] += wall_s
            segment["wait_s"] += wait_s
        if self._tuner is not None:
            advice = self._tuner.advise(LoaderSegment(**segment), batch=batch)
            if advice:
                self._autotune_to(advice)

    def _autotune_to(self, advice: dict[str, Any]) -> None:
        """Switch at the next batch as autotune advises; a setting refused (workers that could
        not unpickle the dataset) stops autotune with a warning instead of failing the loop."""
        try:
            self._request(advice, by="autotune")
        except (TypeError, ValueError) as error:
            self._tuner = None
            note = f"autotune stopped: {error}"
            self._notes.append(note)
            warnings.warn(note, BatchwidgetsWarning, stacklevel=4)

    def _add_switch(self, **switch: Any) -> None:
        with self._lock:
            self._switches.append(LoaderSwitch(**switch))

    def report(self) -> LiveLoaderReport:
        """The loop's own numbers so far: samples/s and the data stall, overall and per
        setting, each switch with its cost (any thread)."""
        with self._lock:
            return LiveLoaderReport(
                segments=tuple(LoaderSegment(**dict(s, settings=dict(s["settings"])))
                               for s in self._segments),
                switches=tuple(self._switches), settings=self.settings, epoch=self._epochs,
                autotune=self.autotune,
                autotune_status=self.autotune_status, warnings=tuple(self._notes))

    @property
    def stats(self) -> LiveLoaderReport:
        """``report()``, as an attribute."""
        return self.report()


def live_loader(loader_or_dataset: DataLoader | Any, /, *, autotune: bool = False,
                **settings: Any) -> LiveLoader:
    """Wrap a DataLoader (or a Dataset) for a training loop whose loader settings can be
    switched while it runs.

    Use it where the DataLoader was: ``for batch in live:`` epoch after epoch, ``len(live)``,
    ``live.dataset``, ``live.batch_size``, ``live.sampler.set_epoch(epoch)``, and
    ``isinstance(live, DataLoader)`` holds. It yields the batches, in the order, that the
    wrapped loader gives with the settings it started with, epoch after epoch, whatever is
    switched later (NOTE [ The same order across a switch ]).

    Parameters
    ----------
    loader_or_dataset : DataLoader or Dataset
        Its dataset, sampler (and so shuffling), batch_sampler, collate_fn, generator,
        worker_init_fn and multiprocessing_context are used as they are.
    autotune : bool
        Retune num_workers and prefetch_factor (and pin_memory with CUDA) while training, from
        the data stall the loop shows.
    **settings
        The starting settings, over the loader's: ``num_workers``, ``pin_memory``,
        ``prefetch_factor``, ``persistent_workers``, ``batch_size``; for a Dataset, any
        DataLoader argument (``shuffle=True``, ``collate_fn=...``; ``batch_size`` 32 unless
        given).

    Returns
    -------
    LiveLoader
        ``live.set(num_workers=2)`` (any thread) switches at the next batch; ``live.report()``
        returns a ``LiveLoaderReport``; ``live.close()`` stops every worker.

    Examples
    --------
    >>> data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    >>> live = live_loader(data, batch_size=4, shuffle=True)
    >>> len(live), isinstance(live, DataLoader)
    (2, True)
    """
    return LiveLoader(loader_or_dataset, autotune=autotune, **settings)
