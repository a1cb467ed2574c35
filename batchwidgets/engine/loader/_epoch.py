"""One epoch of a live loader: its index batches fed to an inner DataLoader with the settings in
force, a switch at a batch boundary, and the loop's own time measured around each ``next()``."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from ._timing import _size, shutdown

if TYPE_CHECKING:
    from ._live import LiveLoader

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
    """What ``iter(live)`` returns: the wrapped loader's batches for one epoch, switching the
    inner loader at a batch boundary when new settings are pending."""

    def __init__(self, live: LiveLoader, index: int) -> None:
        started = time.perf_counter()
        self.live, self.index, self.batch = live, index, 0
        self.finished = False
        self.feed: _Feed | None = None
        self.inner: DataLoader | None = None
        self.iterator: Iterator[Any] | None = None
        self._switch: dict[str, Any] | None = None  # a switch whose first batch is pending
        # NOTE [ The same order across a switch ]: the sampler's iterator, then the base seed.
        self.source = None if live._iterable else iter(live._index_sampler)
        generator = live.generator if live.generator is not None else torch.default_generator
        self.seed_state = generator.get_state()
        if live._draw_every_epoch or index == 0:
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        between = live._take_between()
        if between is not None:
            self._begin_switch(live.settings, between[1], "", started, old=between[0])
        pending = live._take_pending(epoch_start=True)  # an IterableDataset's, deferred
        if pending is not None:
            self._begin_switch(*pending, started, old=between[0] if between else None)
        self._start()
        self.last = started  # the loop's clock: the first batch's wait includes the start
        self.extra_wait = time.perf_counter() - started

    def _start(self) -> None:
        """The inner loader for the settings in force: the one kept from the last epoch when its
        persistent workers still match, else a new one."""
        live = self.live
        kept = live._take_kept(self.live.settings)
        if kept is not None:
            self.inner, self.feed = kept
            if self.feed is not None:
                self.feed.source, self.feed.taken = self.source, deque()
        else:
            self.feed = None if self.source is None else _Feed(self.source)
            self.inner = live._inner_loader(self.feed, _generator(self.seed_state))
        self.iterator = iter(self.inner)

    def __iter__(self) -> Epoch:
        return self

    def __len__(self) -> int:
        return len(self.live)

    def __next__(self) -> Any:
        called = time.perf_counter()
        if self.finished:
            raise StopIteration
        live = self.live
        live._poll()
        pending = live._take_pending(epoch_start=False)
        if pending is not None:
            self._switch_now(*pending, called)
        try:
            batch = next(self.iterator)
        except StopIteration:
            self._end(keep=True)
            raise
        except (EOFError, ConnectionError) as error:  # see NOTE [ A worker that dies ]
            dead = _dead_workers(self.iterator)
            self._end(keep=False)
            raise RuntimeError(f"DataLoader worker {dead}exited unexpectedly: the main process "
                               f"lost its connection to it ({type(error).__name__}); a worker "
                               "killed for memory is the usual cause, try fewer workers or a "
                               "smaller prefetch_factor") from error
        except BaseException:  # a worker died, the loop was interrupted: nothing left running
            self._end(keep=False)
            raise
        now = time.perf_counter()
        indices = self.feed.taken.popleft() if self.feed is not None else None
        samples = len(indices) if live._auto_collation and indices is not None \
            else _size(batch)[0]
        if self._switch is not None:
            self._end_switch(now)
        live._record(wall_s=now - self.last, wait_s=now - called + self.extra_wait,
                     samples=samples, epoch=self.index, batch=self.batch)
        self.last, self.extra_wait = now, 0.0
        self.batch += 1
        return batch

    # -- switching -------------------------------------------------------------------------------

    def _begin_switch(self, new: dict[str, Any], by: str, note: str, started: float,
                      shutdown_s: float = 0.0, old: dict[str, Any] | None = None) -> None:
        old = self.live.settings if old is None else old
        self.live._apply(new)
        self._switch = {"old": old, "new": dict(new), "epoch": self.index, "batch": self.batch,
                        "by": by, "note": note, "shutdown_s": shutdown_s, "started": started}

    def _end_switch(self, now: float) -> None:
        """The first batch after a switch came (or the epoch ended): what the switch cost."""
        switch, self._switch = self._switch, None
        started = switch.pop("started")
        self.live._add_switch(**switch, cost_s=now - started)

    def _switch_now(self, new: dict[str, Any], by: str, note: str, started: float) -> None:
        """Stop the inner loader's workers; the rest of the epoch, from the batches it took but
        did not yield, goes to a new inner loader with the new settings."""
        rest = self.feed.rest()
        stopping = time.perf_counter()
        shutdown(self.iterator)
        shutdown_s = time.perf_counter() - stopping
        self._begin_switch(new, by, note, started, shutdown_s)
        self.feed = _Feed(rest)
        self.inner = self.live._inner_loader(self.feed, _generator(self.seed_state))
        self.iterator = iter(self.inner)

    # -- the end -------------------------------------------------------------------------------

    def _end(self, keep: bool) -> None:
        """The epoch is over (or abandoned, or failed): persistent workers are kept for the next
        epoch when ``keep``; every other worker is stopped now."""
        if self.finished:
            return
        self.finished = True
        if self._switch is not None:  # the epoch ended right after a switch
            self._end_switch(time.perf_counter())
        if keep and self.inner is not None and self.inner.persistent_workers:
            self.live._keep(self.inner, self.feed)
        else:
            shutdown(self.iterator)
        self.iterator = self.inner = None

    def close(self) -> None:
        """Abandoned (a new epoch began, or ``live.close()``): persistent workers are kept, as a
        DataLoader keeps them after a ``break``; ``live.close()`` stops them too."""
        self._end(keep=True)


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
