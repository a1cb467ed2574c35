"""``live_loader``: the DataLoader of a training loop that is running, whose worker settings
switch at its next batch (from code, another thread or a panel) without losing the epoch's
place, with that loop's own samples/s and time waiting for data measured.
One object, one module: the LiveLoader runs its epochs itself; ``Epoch`` is only its iterator,
and its settings (``resolve``, ``starting_loader``) are those it starts with, the wrapped
loader's with the caller's over them, and those it switches to, checked as DataLoader would.

Usage:
    >>> import torch, batchwidgets as bw
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
    >>> live = bw.live_loader(data, batch_size=4)
    >>> [batch[0].tolist() for batch in live]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    >>> live.set(num_workers=1)              # takes effect at the next batch
    >>> live.report.n_batches
    3
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..._warnings import BatchwidgetsWarning
from ...results import LiveLoaderReport, LoaderSegment, LoaderSwitch
from .._util import check_int
from ._autotune import Autotune
from ._checks import check_workers_can_unpickle, usable_cpus
from ._timing import batch_samples, shutdown
from ._tune import DEFAULT_BATCH_SIZE, SETTINGS, check_source, source_kwargs

# -- the settings it starts with and switches to -------------------------------------------------

SWITCHABLE = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


def setting(name: str) -> property:
    """A DataLoader attribute that reads the setting in force (assigning it calls ``set``)."""
    def read(self: Any) -> Any:
        return self._settings[name]

    def write(self: Any, value: Any) -> None:  # DataLoader.__init__ only; then set()
        self._settings[name] = value

    return property(read, write, doc=f"The ``{name}`` in force (``set`` changes it).")


def starting_loader(source: Any, settings: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """DataLoader arguments of the loader to wrap (``source`` with ``settings`` over its own),
    and its multiprocessing context kept apart (DataLoader refuses one without workers)."""
    check_source(source)
    if isinstance(source, DataLoader):
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"settings should be among {list(SETTINGS)} for a DataLoader, but "
                            f"got {unknown}; set other options on the DataLoader you pass in.")
        kwargs = source_kwargs(source)
        if settings.get("batch_size") is not None:
            if "batch_sampler" in kwargs:
                raise ValueError(f"batch_size should be None for a DataLoader with its own "
                                 f"batch_sampler, but got batch_size={settings['batch_size']!r};"
                                 f" change the batch_sampler instead.")
            kwargs["batch_size"] = settings["batch_size"]
        kwargs.update({k: v for k, v in settings.items() if k != "batch_size"})
    else:  # a Dataset: any DataLoader argument, batch_size 32 by default (as make_loader)
        source_kwargs(source)  # the one-line error for what is no Dataset
        kwargs = {"dataset": source, "batch_size": DEFAULT_BATCH_SIZE, **settings}
    context = kwargs.pop("multiprocessing_context", None)
    if isinstance(context, str):
        context = torch.multiprocessing.get_context(context)
    return kwargs, context


def resolve(base: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``settings`` over it, checked and completed as DataLoader would."""
    new = {name: base[name] for name in SWITCHABLE}
    new.update(settings)
    check_types(new, settings)
    if new["num_workers"] == 0:
        for name, dropped in (("prefetch_factor", None), ("persistent_workers", False)):
            if settings.get(name) not in (None, False):
                raise ValueError(
                    f"{name} should be {dropped} with num_workers=0 (DataLoader takes it "
                    f"only with workers), but got {name}={settings[name]!r}; set workers "
                    f"too, e.g. set(num_workers=2, {name}={settings[name]!r}).")
        new.update(prefetch_factor=None, persistent_workers=False)
    elif new["prefetch_factor"] is None:
        new["prefetch_factor"] = 2  # DataLoader's default with workers
    return new


def check_types(new: dict[str, Any], given: dict[str, Any]) -> None:
    """One line naming the setting that is not what DataLoader takes (``given``: as typed)."""
    check_int("num_workers", new["num_workers"], 0, hint="; 0 loads in the main process")
    check_int("prefetch_factor", new["prefetch_factor"], 1, optional=True,
              hint="; DataLoader's default is 2")
    for name in ("pin_memory", "persistent_workers"):
        if not isinstance(new[name], bool):
            raise ValueError(f"{name} should be True or False, but got "
                             f"{name}={given.get(name, new[name])!r}.")


def _refused_without_workers(settings: dict[str, Any]) -> None:
    """``prefetch_factor`` or ``persistent_workers`` given without workers: the one-line error
    of ``resolve`` (DataLoader refuses them too), said for ``live_loader``."""
    given = {name: settings[name] for name in ("prefetch_factor", "persistent_workers")
             if name in settings}
    try:
        resolve({"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
                 "persistent_workers": False}, given)
    except ValueError as error:
        raise ValueError(str(error).replace("e.g. set(", "e.g. live_loader(data, ")) from None


OnBatch = Callable[[int, int], Any]  # on_batch(epoch, batch): before each batch is taken

# NOTE [ The same order across a switch ]
# A DataLoader's iterator does two things with randomness when it starts an epoch, in this order:
# it calls iter() on its index sampler (lazy for BatchSampler and RandomSampler), then draws its
# workers' base seed from ``loader.generator`` (the global generator when None); the sampler's own
# draws (RandomSampler's permutation) come after, at the first index. A live epoch does the same
# with the wrapped loader's own sampler and generator, so the batches, their order and the
# generator's state after the epoch are what the wrapped DataLoader gives, whatever the settings:
# - It takes the sampler's iterator itself and feeds its index batches to an inner DataLoader
#   (as its ``batch_sampler``, or ``sampler`` without automatic batching), recording each index
#   batch the inner loader takes. Workers take batches ahead (prefetch_factor x num_workers); at a
#   switch the batches taken but not yet yielded are fed first to the new inner loader, then the
#   rest of the sampler's iterator: no sample is skipped or repeated, and the order is kept
#   (inner loaders keep ``in_order=True``).
# - The base seed: the epoch saves the generator's state, advances the generator by the one draw
#   DataLoader makes (every epoch, or only the first with persistent workers, as the loader it
#   started with does), and gives every inner loader of the epoch a private generator holding
#   the saved state. So each inner loader draws the same base seed the wrapped loader would
#   (worker k seeds with base + k, as in PyTorch), and a switch draws nothing from the user's
#   generators. A dataset's own randomness inside workers still depends on which worker loads
#   which batch, so it changes with num_workers, as in PyTorch.
# - An IterableDataset has no index to carry over: its inner loader iterates the dataset itself,
#   so a switch waits for the next epoch.


class _Feed:
    """An inner loader's index batches: the source's, each recorded as taken until yielded."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.taken: deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                item = next(self.source)
            except StopIteration:
                return
            self.taken.append(item)
            yield item

    def rest(self) -> Iterator[Any]:
        """What is left of the epoch: the batches taken but not yielded, then the source's."""
        return itertools.chain(list(self.taken), self.source)


def _generator(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


class Epoch:
    """What ``iter(live)`` returns: one epoch's iterator, as a DataLoader's; the live loader runs
    it, and it holds the epoch's place. Dropped, it ends the epoch (NOTE [ An abandoned epoch ])."""

    def __init__(self, live: LiveLoader, index: int) -> None:
        self.live, self.index, self.batch = live, index, 0  # batch: the next one's position
        self.finished = False
        self.source: Iterator[Any] | None = None  # the sampler's iterator; None: iterable
        self.seed_state: torch.Tensor | None = None
        self.feed: _Feed | None = None
        self.inner: DataLoader | None = None
        self.iterator: Iterator[Any] | None = None
        self.switch: dict[str, Any] | None = None  # a switch whose first batch is pending
        self.last = self.extra_wait = 0.0  # the loop's clock (perf_counter seconds)

    def __iter__(self) -> Epoch:
        return self

    def __len__(self) -> int:
        return len(self.live)

    def __next__(self) -> Any:
        return self.live._next(self)

    def close(self) -> None:
        """Abandon the epoch: its workers stop, persistent ones are kept for the next epoch (as
        a DataLoader keeps them after a ``break``); ``live.close()`` stops them too."""
        self.live._end(self, keep=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a half-made epoch, or at interpreter exit
            self.live._end(self, keep=True)


# NOTE [ An abandoned epoch ]
# A DataLoader's iterator stops its workers when it is collected, which CPython does at once when
# the loop lets go of it: at a `break`, a `del`, and when an exception (a KeyboardInterrupt too)
# leaves the loop's body, since unwinding a frame drops what its `for` was iterating even while a
# notebook keeps the traceback. Persistent workers belong to the DataLoader and carry on. A live
# epoch does the same: the loader holds its running epoch only weakly, and ``Epoch.__del__`` ends
# it (persistent workers kept for the next epoch). An exception inside ``next()`` itself (a
# KeyboardInterrupt while waiting for a batch, a worker that died, a hook that failed) ends the
# epoch at once, workers and all: the traceback then holds the epoch's frame, which would keep a
# DataLoader's workers running as long as the notebook keeps that traceback.


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
        if not kwargs.get("num_workers"):  # DataLoader rejects these without workers: given
            _refused_without_workers(settings)  # here, refused as set() refuses them
            kwargs.update(prefetch_factor=None, persistent_workers=False)
        super().__init__(**kwargs, multiprocessing_context=context if kwargs.get("num_workers")
                         else None)
        self._context = context
        check_types(self.settings, self.settings)
        self._requested = self.settings  # the latest settings asked for (``requested``)
        self._iterable = isinstance(self.dataset, IterableDataset)
        # As the wrapped loader: with persistent workers, one base seed for all epochs.
        self._draw_every_epoch = not (self.num_workers and self.persistent_workers)
        self._seed_state: torch.Tensor | None = None  # the base seed's draw of epoch 0
        self._pending: tuple[dict[str, Any], str, str] | None = None
        self._between: tuple[dict[str, Any], str] | None = None
        self._segments: list[dict[str, Any]] = []
        self._switches: list[LoaderSwitch] = []
        self._notes: list[str] = []
        self._epochs = 0
        self._epoch: weakref.ref[Epoch] | None = None  # NOTE [ An abandoned epoch ]
        self._kept: tuple[DataLoader, Any] | None = None  # persistent workers between epochs
        self._on_batch: tuple[OnBatch, ...] = ()  # replaced whole: read without the lock
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

    def on_batch(self, callback: OnBatch, remove: bool = False) -> None:
        """Run ``callback(epoch, batch)`` in the loop's thread before each batch is taken (the
        position of the batch about to come); ``remove=True`` unregisters it. A panel bound to
        the loader dispatches widget clicks there. What the callback raises ends the epoch and
        reaches the loop."""
        if not callable(callback):
            raise TypeError(f"callback should be a function of (epoch, batch), but got "
                            f"callback={callback!r}; pass e.g. lambda epoch, batch: None.")
        with self._lock:
            if remove:
                self._on_batch = tuple(c for c in self._on_batch if c != callback)
            else:
                self._on_batch = (*self._on_batch, callback)

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
        running = self._running()
        if self._iterable and running is not None:
            note = ("an IterableDataset cannot resume at a position: these settings apply at "
                    "the next epoch")
            if note not in self._notes:
                self._notes.append(note)
                warnings.warn(note, BatchwidgetsWarning, stacklevel=3)
        with self._lock:
            self._requested = new
            if running is None:  # between epochs: in force now
                if self._between is None and new != self.settings:
                    self._between = (self.settings, by)
                self._apply(new)
                self._pending = None
                self._kept = self._take_kept(new)  # workers of other settings stop now
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

    # -- iterating: the loader runs its epochs; ``Epoch`` is their iterator -----------------------

    def __iter__(self) -> Epoch:
        """One epoch. A new one ends the one before (its persistent workers carry on); one that
        is dropped, broken off or fails stops its workers (NOTE [ An abandoned epoch ])."""
        running = self._running()
        if running is not None:
            self._end(running, keep=True)
        epoch = Epoch(self, self._epochs)
        self._epochs += 1
        self._epoch = weakref.ref(epoch)
        self._start(epoch)
        return epoch

    def _running(self) -> Epoch | None:
        """The epoch under way: made, neither over nor dropped."""
        epoch = self._epoch() if self._epoch is not None else None
        return None if epoch is None or epoch.finished else epoch

    def _start(self, epoch: Epoch) -> None:
        """As DataLoader's iter(): the sampler's iterator, then the base seed (NOTE [ The same
        order across a switch ]); then any switch asked for between epochs, and the workers."""
        started = time.perf_counter()
        epoch.source = None if self._iterable else iter(self._index_sampler)
        generator = self.generator if self.generator is not None else torch.default_generator
        epoch.seed_state = generator.get_state()
        if self._draw_every_epoch or epoch.index == 0:
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            self._seed_state = epoch.seed_state
        else:  # persistent workers: every epoch's new workers get epoch 0's base seed
            epoch.seed_state = self._seed_state
        between = self._take_between()
        if between is not None:
            self._begin_switch(epoch, self.settings, between[1], "", started, old=between[0])
        pending = self._take_pending(epoch_start=True)  # an IterableDataset's, deferred
        if pending is not None:
            self._begin_switch(epoch, *pending, started, old=between[0] if between else None)
        kept = self._take_kept(self.settings)
        if kept is not None:  # persistent workers that still run these settings
            epoch.inner, epoch.feed = kept
            if epoch.feed is not None:
                epoch.feed.source, epoch.feed.taken = epoch.source, deque()
        else:
            epoch.feed = None if epoch.source is None else _Feed(epoch.source)
            epoch.inner = self._inner_loader(epoch.feed, _generator(epoch.seed_state))
        epoch.iterator = iter(epoch.inner)
        epoch.last = started  # the loop's clock: the first batch's wait includes the start
        epoch.extra_wait = time.perf_counter() - started

    def _next(self, epoch: Epoch) -> Any:
        """The epoch's next batch: the callbacks, a switch asked for, the batch, its time."""
        called = time.perf_counter()
        if epoch.finished:
            raise StopIteration
        try:
            for callback in self._on_batch:
                callback(epoch.index, epoch.batch)
            pending = self._take_pending(epoch_start=False)
            if pending is not None:
                self._switch_now(epoch, *pending, called)
            batch = next(epoch.iterator)
            self._count(epoch, batch, called)
        except StopIteration:
            self._end(epoch, keep=True)
            raise
        except (EOFError, ConnectionError) as error:  # see NOTE [ A worker that dies ]
            dead = _dead_workers(epoch.iterator)
            self._end(epoch, keep=False)
            raise RuntimeError(f"DataLoader worker {dead}exited unexpectedly: the main process "
                               f"lost its connection to it ({type(error).__name__}); a worker "
                               "killed for memory is the usual cause, try fewer workers or a "
                               "smaller prefetch_factor") from error
        except BaseException:  # NOTE [ An abandoned epoch ]: nothing left running
            self._end(epoch, keep=False)
            raise
        return batch

    def _count(self, epoch: Epoch, batch: Any, called: float) -> None:
        """The batch came: the loop's time for it (``called``: when it asked), a switch's cost."""
        now = time.perf_counter()
        indices = epoch.feed.taken.popleft() if epoch.feed is not None else None
        samples = len(indices) if self._auto_collation and indices is not None \
            else batch_samples(batch)[0]
        if epoch.switch is not None:
            self._end_switch(epoch, now)
        self._record(wall_s=now - epoch.last, wait_s=now - called + epoch.extra_wait,
                     samples=samples, epoch=epoch.index, batch=epoch.batch)
        epoch.last, epoch.extra_wait = now, 0.0
        epoch.batch += 1

    def _begin_switch(self, epoch: Epoch, new: dict[str, Any], by: str, note: str,
                      started: float, shutdown_s: float = 0.0,
                      old: dict[str, Any] | None = None) -> None:
        old = self.settings if old is None else old
        self._apply(new)
        epoch.switch = {"old": old, "new": dict(new), "epoch": epoch.index,
                        "batch": epoch.batch, "by": by, "note": note, "shutdown_s": shutdown_s,
                        "started": started}

    def _end_switch(self, epoch: Epoch, now: float) -> None:
        """The first batch after a switch came (or the epoch ended): what the switch cost."""
        switch, epoch.switch = epoch.switch, None
        started = switch.pop("started")
        with self._lock:
            self._switches.append(LoaderSwitch(**switch, cost_s=now - started))

    def _switch_now(self, epoch: Epoch, new: dict[str, Any], by: str, note: str,
                    started: float) -> None:
        """Stop the inner loader's workers; the rest of the epoch, from the batches it took but
        did not yield, goes to a new inner loader with the new settings."""
        rest = epoch.feed.rest()
        stopping = time.perf_counter()
        shutdown(epoch.iterator)
        shutdown_s = time.perf_counter() - stopping
        self._begin_switch(epoch, new, by, note, started, shutdown_s)
        epoch.feed = _Feed(rest)
        epoch.inner = self._inner_loader(epoch.feed, _generator(epoch.seed_state))
        epoch.iterator = iter(epoch.inner)

    def _end(self, epoch: Epoch, keep: bool) -> None:
        """The epoch is over (or abandoned, or failed): persistent workers are kept for the next
        epoch when ``keep``; every other worker is stopped now."""
        if epoch.finished:
            return
        epoch.finished = True
        if epoch.switch is not None:  # the epoch ended right after a switch
            self._end_switch(epoch, time.perf_counter())
        if keep and epoch.inner is not None and epoch.inner.persistent_workers:
            self._keep(epoch.inner, epoch.feed)
        else:
            shutdown(epoch.iterator)
        epoch.iterator = epoch.inner = None

    def close(self) -> None:
        """Stop every worker now, persistent ones too (also done when the loader is collected)."""
        running = self._running() if self.__dict__.get("_epoch") is not None else None
        if running is not None:
            self._end(running, keep=False)
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

    @property
    def report(self) -> LiveLoaderReport:
        """The loop's own numbers so far: samples/s and the data stall, overall and per
        setting, each switch with its cost (any thread). A property, as ``acc.report`` and
        ``panel.report`` are; ``live.report`` still gives it, with a DeprecationWarning."""
        with self._lock:
            return LiveLoaderReport(
                segments=tuple(LoaderSegment(**dict(s, settings=dict(s["settings"])))
                               for s in self._segments),
                switches=tuple(self._switches), settings=self.settings, epoch=self._epochs,
                autotune=self.autotune,
                autotune_status=self.autotune_status, warnings=tuple(self._notes))


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
        ``live.set(num_workers=2)`` (any thread) switches at the next batch; ``live.report``
        returns a ``LiveLoaderReport``; ``live.close()`` stops every worker.

    Examples
    --------
    >>> data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    >>> live = live_loader(data, batch_size=4, shuffle=True)
    >>> len(live), isinstance(live, DataLoader)
    (2, True)
    """
    return LiveLoader(loader_or_dataset, autotune=autotune, **settings)


# NOTE [ A worker that dies ]
# When a worker process dies (the OOM killer, os._exit in a dataset), what PyTorch raises depends
# on when the main process notices: DataLoader's own RuntimeError "worker (pid ...) exited
# unexpectedly" if it was waiting on the queue, but an EOFError or ConnectionError if it was
# receiving a batch the worker shares by file descriptor at that moment (the worker's resource
# sharer is gone). A live epoch raises the same RuntimeError in every case, naming the workers
# found dead, so a loop's `except RuntimeError` sees one error, with the lost connection chained.


def _dead_workers(iterator: Any) -> str:
    """'(pid(s) 123) ' for the iterator's workers that have exited, or '' when none is seen yet."""
    workers = getattr(iterator, "_workers", None) or []
    pids = [str(w.pid) for w in workers if not w.is_alive()]
    return f"(pid(s) {', '.join(pids)}) " if pids else ""
