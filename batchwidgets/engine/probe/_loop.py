"""The probe's search loop: run a size, fit the per-op model on what ran, ask the policy for the
next size (``Search``); the memory split at the largest size that ran. Both engines run it: on
real steps to measure, on fake ones to plan (a target's replay of its traces is in _plan.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

from ...results import Attempt, MemorySplit, MemoryTimeline
from .. import memory
from .._util import first_line
from ..memory import OpTrace, PeakModel, Reading
from . import _search
from ._fake import FakeTraceError
from ._ranks import agree, agree_size, in_job, share_error
from ._stop import StepStopped, stop_between_ops
from ._timeline import memory_split, memory_timeline
from ._trials import OnStep, Trainer

Pair = tuple[tuple[OpTrace, int], tuple[OpTrace, int]]  # two traced sizes: (trace, batch size)

@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off over the fake trials (as FakeWorld.active pauses it over
    each), then run once, so that their garbage is not collected inside a real step (its time
    and its trace); as it was afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if enabled:
            gc.enable()


# NOTE [ One real size after a miss ]
# After a miss (NOTE [ After a miss ] in _search.py) the model is fitted on the largest size
# traced for real and the smallest size traced, not on the two largest: next to a miss those
# are often one sample apart (P and P + 1), and a block of allocator rounding makes the slope of
# such a pair noise. Where the real steps traced no small size, the smallest fake trace serves
# (dropped from the model at the miss, kept for this). Whatever the real step holds that the
# trace missed, the line holds it at the real size, where it is used: after an out-of-memory
# miss the first size of NOTE [ What a miss may cost ] in _after_miss.py is such a real step,
# well inside the bracket.

# NOTE [ A free first guess ]
# On this device the search's small sizes need no compute either. The search first runs on fake
# tensors (NOTE [ Fake trials ] in _fake.py), under the same meter and limit as the real steps:
# the same storages, counted the same way, so a fake trial runs out of memory where the real
# tensors would (a budget's bytes; the simulated device's allocator), at the cost of a trace, not
# a step. Its sizes are the real search's: 2 and 4, then the edge B the per-op model predicts,
# then refits until the model says B is the edge (one fake size past the two small ones when
# memory is affine; at most MAX_FAKE_SIZES). Its verification, B + 1, is left to real steps: they
# begin at B, and go on as predict-then-verify does, B runs, B + 1 runs out of memory, and the
# answer rests on those two real steps alone (report.trace stays "real"; the fake attempts say
# fake=True and count in no bracket). The model the real steps verify is the fake search's own
# (a real trace at a size the fake search traced is kept aside). A real size that goes the other
# way than predicted means the fake trace missed something the real step holds: the fake traces
# are dropped, and the search goes on from the real sizes alone. A step that fake tensors cannot
# run (a value read back, a shape from data, anything else that fails) or whose fake sizes give
# no model leaves the search to real steps from the start, and report.method says why. Not on
# CUDA (the fakes run the CPU's kernels, whose workspaces and attention differ), not for a
# step(batch_size) of the user's own (it runs on the user's real tensors), not under
# torch.distributed (every rank must take the same path), not with trace="real".
MAX_FAKE_SIZES = 6  # a fake search that has not found its edge by then leaves it to real steps


class Search:
    """The probe's loop: fit the per-op model on what ran, ask the policy for the next size, run
    it (see NOTE [ Predict, then verify ] in _search.py)."""

    def __init__(self, trainer: Trainer, meter: Any, *, start: int, multiple_of: int,
                 ceiling: int, limit_bytes: int | None, traced_only: bool = False) -> None:
        self.trainer, self.meter = trainer, meter
        self.start, self.multiple_of, self.ceiling = start, multiple_of, ceiling
        self.limit_bytes = limit_bytes
        self.traces: dict[int, OpTrace] = {}
        self.overhead_bytes = 0  # reserved beyond the tensors (CUDA), from the traced sizes
        self.unseen_bytes = 0  # real CUDA: reserved that the trace's replay does not explain
        self.model: PeakModel | None = None
        self.attempts: list[Attempt] = []
        self.stopped = False
        self._lowered = False
        self.traced_only = traced_only  # stop once two sizes are traced (target=), or
        # MAX_FAKE_SIZES whose op sequences differ (the plan then says it cannot predict)
        self.split: MemorySplit | None = None  # at the largest size that ran with a trace
        self.timeline: MemoryTimeline | None = None  # the same step over its ops
        self.split_trace: OpTrace | None = None  # the same step's trace
        self._seeding = False  # trials now are fake (NOTE [ A free first guess ])
        self._fake_sizes: set[int] = set()  # sizes whose trace in self.traces is fake
        self._shadowed: dict[int, OpTrace] = {}  # real traces at those sizes, kept for later
        self._donors: dict[int, OpTrace] = {}  # fake traces dropped after a miss, kept to fit on
        self._missed = False  # a real size went the other way (NOTE [ One real size after a miss ])
        self.seed_size: int | None = None  # the fake search's answer, the first real size
        self.seed_note = ""  # why there was no fake search first, when it failed
        self._gave_up = False  # the fake search found no model to predict from
        self.loss_from = ""  # where the model form's step took its loss (for the report)

    def seed(self, fake: Callable[[], Trainer], on_step: OnStep | None,
             should_stop: Callable[[], bool] | None) -> None:
        """The search on fake tensors first, through the Trainer ``fake()`` makes (NOTE [ A free
        first guess ])."""
        real, self._seeding = self.trainer, True
        try:
            with _collector_paused():
                self.trainer = fake()
                self.run(on_step, should_stop)
        except Exception as error:  # the real steps search alone, and the report says why
            reason = str(error) if isinstance(error, FakeTraceError) else first_line(error)
            memory.drop_own_frames(error)
            error.__traceback__ = None  # swallowed: its frames keep nothing alive
            self.seed_note = f" No fake trace first: {reason}."
            self._drop_fakes()
            return
        finally:
            self.trainer, self._seeding = real, False
        lo = _search.bracket(self.attempts)[0]
        if self._gave_up and (self.model is None or self._predicted() is None):
            self.seed_note = (f" No fake trace first: the fake sizes "
                              f"{', '.join(str(a.batch_size) for a in self.attempts)} gave no "
                              f"prediction (op sequences that differ, or memory that does not "
                              f"grow with the batch size).")
            self._drop_fakes()
        elif not self.stopped:
            if lo > 0:
                self.seed_size = lo
            else:  # nothing fits: the real steps confirm it from the smallest fake OOM down
                self.start = min((a.batch_size for a in self.attempts if not a.fits
                                  and not memory.cannot_train_alone(a.error)), default=self.start)
            self.seed_note = (f" Traced first on fake tensors (sizes "
                              f"{', '.join(str(a.batch_size) for a in self.attempts)}), so the "
                              f"real steps began at {self.seed_size or self.start}.")

    def _drop_fakes(self) -> None:
        """Forget the fake traces: the per-op model is fitted on real ones alone from here."""
        for size in self._fake_sizes:
            self._donors[size] = self.traces.pop(size)
        self.traces.update(self._shadowed)
        self._shadowed.clear()
        if self.split is not None and self.split.batch_size in self._fake_sizes:
            self.split = self.timeline = None
        self._fake_sizes.clear()
        self.model = self._fit()

    def run(self, on_step: OnStep | None, should_stop: Callable[[], bool] | None) -> list[Attempt]:
        while not self.stopped:
            stopping = should_stop is not None and bool(should_stop())
            if stopping and not in_job():
                self.stopped = True
                break
            searched = self._searched()  # this phase's attempts: fake, or real
            predicted = self._predicted()
            if not searched and self.seed_size is not None:
                predicted = self.seed_size  # NOTE [ A free first guess ]
            size = _search.next_batch_size(
                searched, start=self.start, multiple_of=self.multiple_of,
                ceiling=self.ceiling, limit_bytes=self.limit_bytes, predicted=predicted)
            if self.traced_only and (self._event_pair() is not None
                                     or len(self.traces) >= MAX_FAKE_SIZES):
                size = None  # a plan's traces: two that correspond, or none to predict from
            size, self.stopped = agree_size(size, stopping)  # rank 0's size; any rank's stop
            if size is None or self.stopped:
                break
            if self._seeding and predicted is not None and size > predicted:
                break  # the fake edge is known: the real steps verify it
            if self._seeding and (len(searched) >= MAX_FAKE_SIZES
                                  or (predicted is None and len(self.traces) >= 2)):
                self._gave_up = True  # no model to predict from: the real steps search alone
                break
            # an error raises on every rank: NOTE [ One verdict per size, errors included ]
            try:
                with stop_between_ops(None if in_job() else should_stop, self.meter.device):
                    attempt, reading = self.trainer.attempt(size, trace=self._wants_trace())
            except StepStopped:  # NOTE [ Stopping mid-step ]: the state is restored already
                self.stopped = True
                break
            except Exception as error:
                share_error(error)
                raise
            if predicted is not None:
                attempt = dataclasses.replace(attempt, predicted_peak_bytes=self._predicted_peak(
                    size) if self.model is not None else None, predicted_fits=size <= predicted)
            if self._seeding:  # nothing ran: no step time
                attempt = dataclasses.replace(attempt, fake=True, step_time_s=None)
            failed_here = not attempt.fits  # this rank's own outcome
            attempt = agree(attempt)  # every rank learns from the same outcome
            self._learn(attempt, reading, failed_here)
            self.attempts.append(attempt)
            if not self._seeding and _search.misses([attempt]):
                self._missed = True
                if self._fake_sizes:
                    self._drop_fakes()  # the fake trace missed what the real step holds
            if on_step is not None:
                on_step(self.attempts[-1])
        return self.attempts

    def _searched(self) -> list[Attempt]:
        """The attempts the policy searches on: the fake ones while seeding, else the real."""
        return [a for a in self.attempts if a.fake == self._seeding]

    def _wants_trace(self) -> bool:
        """CPU: always (the tracker sees every op anyway). CUDA: only to fit or refit the model,
        since tracing slows the step and the sizes near the boundary are timed."""
        return self.meter.device.type != "cuda" or len(self.traces) < 2 or (
            bool(self.attempts) and self.attempts[-1].predicted_fits is not None
            and self.attempts[-1].predicted_fits != self.attempts[-1].fits)

    def _learn(self, attempt: Attempt, reading: Reading, failed_here: bool) -> None:
        trace = reading.trace
        if attempt.fits and trace is not None and trace.complete:
            if attempt.fake:
                self._fake_sizes.add(attempt.batch_size)
            # the model the real steps verify is the fake search's (NOTE [ A free first guess ])
            shadowed = not attempt.fake and attempt.batch_size in self._fake_sizes
            (self._shadowed if shadowed else self.traces)[attempt.batch_size] = trace
            if reading.split is not None and (self.split is None
                                              or attempt.batch_size >= self.split.batch_size):
                self.split = memory_split(attempt.batch_size, trace, *reading.split)
                self.timeline = memory_timeline(attempt.batch_size, trace)
                self.split_trace = trace  # the report's step_snapshot (report_of)
            if reading.peak_reserved_bytes:
                self.overhead_bytes = max(0, reading.peak_reserved_bytes - max(trace.live))
            if self.meter.device.type == "cuda":  # workspaces the tensor trace cannot see
                replayed = memory.replay(trace.events, preallocated=trace.preallocated)
                self.unseen_bytes = max(0, (reading.peak_reserved_bytes or 0)
                                        - replayed.peak_reserved_bytes)
        elif (failed_here and not self.replays and reading.live_bytes is not None
              and self.limit_bytes is not None and reading.live_bytes < self.limit_bytes):
            # A real allocator failure below the assumed limit (a cgroup, a ulimit, another
            # process): the limit is lower than assumed. Lower it and predict again.
            self.limit_bytes, self._lowered = reading.live_bytes, True
        self.model = self._fit()

    def _fit(self) -> PeakModel | None:
        for small, large in self._pairs():
            model = PeakModel.fit(self._trace(small), small, self._trace(large), large)
            if model is not None:
                return model
        return None

    def _pairs(self) -> Iterator[tuple[int, int]]:
        """(small, large) traced sizes to fit the model on, the best first: the two largest,
        and after a miss first the largest with the smallest (NOTE [ One real size after a
        miss ])."""
        if self._missed and self.traces:
            large = max(self.traces)
            far = large - max(1, large // _search.WINDOW)  # a real size this far below, else a fake
            for small in [*sorted(s for s in self.traces if s <= far), *sorted(self._donors)]:
                if small < large:
                    yield small, large
        sizes = sorted(self.traces, reverse=True)[:4]
        for i, large in enumerate(sizes):
            for small in sizes[i + 1:]:
                yield small, large

    def _trace(self, size: int) -> OpTrace:
        return self.traces[size] if size in self.traces else self._donors[size]

    @property
    def replays(self) -> bool:
        """On CUDA (and the simulated device) what runs out is reserved memory: predictions
        replay the traces through the caching allocator's model (memory/_allocator.py)."""
        return self.meter.device.type == "cuda" or getattr(self.meter, "allocator_model", False)

    def _event_pair(self) -> tuple[tuple[OpTrace, int], tuple[OpTrace, int]] | None:
        for small, large in self._pairs():
            a, b = self._trace(small), self._trace(large)
            if memory.scale_events(a.events, small, b.events, large, small) is not None:
                return (a, small), (b, large)
        return None

    def _predicted(self) -> int | None:
        if self.model is None or self.limit_bytes is None or not self.model.grows:
            return None
        if self.replays:
            pair = self._event_pair()
            if pair is None:
                return None
            (small, b_small), (large, b_large) = pair
            return memory.largest_batch_size(
                small.events, b_small, large.events, b_large, self.limit_bytes,
                multiple_of=self.multiple_of, ceiling=self.ceiling,
                preallocated=large.preallocated, overhead_bytes=self.unseen_bytes)
        return self.model.largest_batch_size(self.limit_bytes - self.overhead_bytes,
                                             multiple_of=self.multiple_of, ceiling=self.ceiling)

    def _predicted_peak(self, size: int) -> int:
        if self.replays:
            pair = self._event_pair()
            if pair is not None:
                (small, b_small), (large, b_large) = pair
                events = memory.scale_events(small.events, b_small, large.events, b_large,
                                                  size)
                return (memory.replay(events, preallocated=large.preallocated)
                        .peak_reserved_bytes + self.unseen_bytes)
        return self.model.peak_bytes(size) + self.overhead_bytes

    def method(self) -> str:
        """How the search went, in a sentence for the report."""
        sizes = sorted(self.traces)
        lowered = (" The memory limit was lowered to the live bytes of a real allocator "
                   "failure." if self._lowered else "") + self.seed_note
        real = [a for a in self.attempts if not a.fake]
        miss = _search.first_miss(real)
        missed = ""
        if miss is not None:  # NOTE [ After a miss ] in _search.py
            went = "ran" if real[miss].fits else "ran out of memory"
            missed = (f" Size {real[miss].batch_size} {went}, against the prediction: the "
                      f"search stepped out from it.")
        if self.model is not None:
            replay = (" replayed through the CUDA caching allocator's model" if self.replays
                      else "")
            return (f"per-op model fitted on sizes {self.model.batch_small} and "
                    f"{self.model.batch_large} ({len(self.model.large.names)} ops){replay}, "
                    f"then verified." + missed + lowered)
        if miss is not None:
            return "per-op model dropped after a miss." + missed + lowered
        if len(sizes) >= 2:
            return (f"op sequences differ between sizes {sizes[-2]} and {sizes[-1]} "
                    f"(data-dependent shapes or unpadded lengths?): no per-op model, searched "
                    f"by measured peaks." + lowered)
        return "searched by measured peaks." + lowered
