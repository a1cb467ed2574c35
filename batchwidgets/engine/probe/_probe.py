"""One probe: the step run at the sizes a search picks, under the meter and the state guard, on
this device's real tensors or on fake ones, and what it found as plain values (``Traced``).
One object, one module: ``Probe`` owns the meter, the state guard, the trainer and the search's
state, as PyTorch's MemTracker owns its own: a context manager whose state is in ``self``.

Usage (what find_batch's stages do; ``probed(setup)`` is the same in one call):
    >>> import torch
    >>> from batchwidgets.engine.probe._options import FindBatchRequest
    >>> from batchwidgets.engine.probe._resolve import resolve
    >>> setup = resolve(torch.nn.Linear(8, 2), torch.zeros(8), FindBatchRequest(budget="64KB"))
    >>> with Probe(setup) as probe:  # the meter's cap on, the user's state guarded
    ...     probe.run()  # size after size: fit the per-op model, ask the policy, run the size
    >>> traced = probe.traced()  # the report of the search, the model fitted on its traces
    >>> traced.report.max_batch_size > 0, traced.model is not None
    (True, True)

``trials(setup)`` is the stage find_batch calls: this device's search, or a plan's traces (fake
first, real steps where fakes cannot run, one FSDP2 rank's where asked). The answer on this
device is its report; planning (``_plan.py``) and the what-ifs (``_what_if.py``) are functions
of a ``Traced``, and neither calls into the probe."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import Attempt, BatchSizeReport, MemorySplit, MemoryTimeline
from ...results._snapshot import StepSnapshot
from .. import memory
from .._options import ProbeStep
from .._state import InterruptGuard, TrainingState, restore_home
from .._util import first_line, user_stacklevel
from ..memory import OpTrace, PeakModel, Reading
from . import _search
from ._cell import CellStep, CellWorld, FakeCellStep
from ._checks import has_meta_tensors
from ._fake import FakeWorld, fake_step
from ._fakes import (
    FakeGroupUnavailable,
    FakeTraceError,
    collector_paused,
    fake_group,
    fake_mode,
)
from ._nothing_fits import NoBatchSizeFits
from ._optimizer_shapes import OptimizerStateError, StateRule, state_rule
from ._ranks import (
    agree,
    agree_limit,
    agree_size,
    alone,
    checkpoints_in,
    in_job,
    share_error,
)
from ._setup import Pair, ProbeSetup, Traced, at_length
from ._sharded import ShardedWorld, ShardingError
from ._stop import StepStopped, stop_between_ops
from ._timeline import memory_split, memory_timeline
from ._trials import (
    Marks,
    Trainer,
    held_outside_ops,
    model_step,
    moved,
    state_tensors,
    touched_tensors,
)

_FLAT = "memory did not grow with the batch size: check make_batch"


def probed(setup: ProbeSetup) -> Traced:
    """The search under the meter and the state guard, and what it found (``NoBatchSizeFits``
    where nothing fits)."""
    with Probe(setup) as probe:
        probe.run()
    return probe.traced()


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
# no model leaves the search to real steps from the start, and report.method says why. On CUDA
# the fake search is the plan for this GPU (NOTE [ On CUDA, the plan for this device first ]).
# Not on MPS (no plan models its kernels), not for a step(batch_size) of the user's own (it runs
# on the user's real tensors), not under torch.distributed (every rank must take the same path),
# not with trace="real".
MAX_FAKE_SIZES = 6  # a fake search that has not found its edge by then leaves it to real steps

# NOTE [ On CUDA, the plan for this device first ]
# A first guess fitted on real sizes 2 and 4 misses where the small sizes' memory is not the
# large ones': on the H200 (benchmarks/results/gpu_truth_h200.md) it said 671 for a wide CNN
# whose boundary was 641, and the search walked down from there, while the plan for that same
# capped GPU, made on a CPU, said 642. So on CUDA the fake search reads the plan's meter, not
# the GPU's (memory.seed_meter): the same fake trace, kernel rules (_kernels.py) and caching
# allocator replay that target= uses, with this GPU's workspaces (its cuBLAS, its SMs) and capped
# at what the real steps may use (free memory and budget, as CudaMeter.limit_bytes). The real
# steps then verify its answer as on the CPU: B runs, B + 1 runs out, two real sizes. A miss
# costs what NOTE [ What a miss may cost ] in _after_miss.py allows, from the real sizes alone.


class Probe:
    """One probe's trials and search. Every trial starts from the user's state, and the user's
    state comes back however the probe ends (NOTE [ Restoring under Ctrl-C ] in
    engine/_state.py). A fake probe touches none of the user's tensors: only the modes, RNGs and
    flags are guarded then (see NOTE [ Fake trials ] in _fake.py). The search fits the per-op
    model on what ran, asks the policy for the next size and runs it (NOTE [ Predict, then
    verify ] in _search.py)."""

    def __init__(self, setup: ProbeSetup) -> None:
        self.setup = setup
        self._fake = setup.trace == "fake"
        # fake trials of one GPU: the optimizer's state learned by shape where fakes cannot
        # make it (NOTE [ Optimizer state by shape ] in _optimizer_shapes.py; OptimizerStateError
        # where it cannot be learned either)
        self._rule: StateRule | None = (state_rule(setup.optimizer)
                                        if self._fake and setup.mesh is None else None)
        self.meter = memory.probe_meter(setup.device, setup.budget_bytes,
                                        setup.target[0] if setup.target is not None else None)
        # what fake trials read: on a GPU the plan for it (NOTE [ On CUDA, the plan for this
        # device first ]), else the meter itself
        self._fake_meter = memory.seed_meter(self.meter) if setup.fake_first else self.meter
        self.trainer: Trainer | None = None
        self._home: TrainingState | None = None
        self._left: contextlib.ExitStack | None = None
        self.start = setup.start  # lowered after a fake search where nothing fits
        self.limit_bytes: int | None = None  # agreed by every rank as the probe starts
        self.traces: dict[int, OpTrace] = {}
        self.overhead_bytes = 0  # reserved beyond the tensors (CUDA), from the traced sizes
        self.unseen_bytes = 0  # real CUDA: reserved that the trace's replay does not explain
        self.model: PeakModel | None = None
        self.attempts: list[Attempt] = []
        self.stopped = False
        self._lowered = False
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

    @property
    def traced_only(self) -> bool:
        """A plan's probe stops once two sizes are traced, or MAX_FAKE_SIZES whose op sequences
        differ (the plan then says it cannot predict)."""
        return self.setup.target is not None

    def __enter__(self) -> Probe:
        """The meter's cap on and the trainer made, the user's state guarded from here."""
        setup = self.setup
        self._home = (TrainingState(setup.owner, None, (), weights=False, loss_fn=setup.loss_fn,
                                    trains=setup.optimizer)
                      if self._fake else TrainingState(setup.owner, setup.optimizer, setup.extras,
                                                       loss_fn=setup.loss_fn,
                                                       touches=self._touches()))
        guard = InterruptGuard()
        with contextlib.ExitStack() as stack:
            stack.push(functools.partial(self._leave, guard))
            stack.enter_context(self.meter.capped())
            self.trainer = self._fake_trainer() if self._fake else self._trainer()
            self.limit_bytes = agree_limit(self.meter.limit_bytes)
            # real steps in a job run to their end: NOTE [ Over the budget inside a job ]
            self.meter.prepare(0 if self._fake else held_outside_ops(setup.owner),
                               defer_budget=in_job() and not self._fake)
            self.meter.warm_up()
            if self._fake_meter is not self.meter:  # a GPU's plan, for the first guess
                self._fake_meter.prepare(0, defer_budget=False)
                self._fake_meter.warm_up()
            self._left = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool:
        left, self._left = self._left, None
        return left.__exit__(*exc)

    def _leave(self, guard: InterruptGuard, kind: Any, error: BaseException | None,
               traceback: Any) -> bool:
        """The user's state back, the trials' memory freed; an error's traceback (kept by
        IPython) keeps none of them alive."""
        if error is not None:
            memory.drop_own_frames(error)
        failed = restore_home(self._home, self.setup.model if self.setup.moves else None,
                              self.setup.home, guard)
        if self.trainer is not None:
            self.loss_from = getattr(self.trainer.step, "loss_from", "")
        self._home = self.trainer = None  # the traceback keeps this object
        memory.free_memory(self.setup.device, collect=not self._fake)  # fakes hold no memory
        if failed is not None:
            raise failed
        return False

    def run(self) -> None:
        """The search: on fake tensors first where it can (NOTE [ A free first guess ]), then
        on the trials the probe was made for."""
        if self.setup.fake_first:
            self._seed()
        self._search()

    def traced(self) -> Traced:
        """What the probe found (``NoBatchSizeFits`` when nothing fits)."""
        return Traced(report=self._report(), model=self.model,
                      pair=self._event_pair() if self.traced_only else None,
                      limit_bytes=self.limit_bytes, overhead_bytes=self.overhead_bytes,
                      unseen_bytes=self.unseen_bytes, replays=self.replays,
                      ceiling=self.setup.ceiling, state_by_shape=self._rule is not None)

    # -- the trials ----------------------------------------------------------------------------

    def _trainer(self) -> Trainer:
        """Real trials: each starts from the user's state (moved to the device probed)."""
        setup = self.setup
        state = (moved(setup.model, setup.optimizer, setup.device, setup.extras, setup.loss_fn)
                 if setup.moves else self._home)
        owned = [] if setup.owner is None else [*setup.owner.parameters(),
                                                *setup.owner.buffers()]
        touches = self._touches()
        return Trainer(self._step(), self.meter, state, setup.steps_per_trial,
                       lambda: (state_tensors(setup.owner, setup.optimizer)
                                + touched_tensors(touches)),
                       Marks(owned, setup.optimizer), functools.partial(checkpoints_in,
                                                                        setup.owner),
                       called="" if setup.model is not None else "step")

    def _touches(self) -> tuple:
        """The other objects a %%find_batch cell names (NOTE [ A cell as the step ] in _cell.py):
        put back after each trial, and counted, as the model is."""
        setup = self.setup
        mine = {id(o) for o in (setup.owner, setup.optimizer, *setup.extras) if o is not None}
        return tuple(o for o in getattr(setup.step, "touches", ()) if id(o) not in mine)

    def _fake_trainer(self, paused: bool = False) -> Trainer:
        """Fake trials: the model's fake twins, each trial from their start (NOTE [ Fake trials
        ]), the optimizer's state by the probe's rule where it has one. ``paused``: the caller
        holds the cycle collector paused over all the trials (one collection instead of one per
        trial, which costs more than a small fake trial in a large process: see ``_seed``). A
        %%find_batch cell's: its objects' twins (NOTE [ A cell's fake trials ]), the user's
        state put back after each."""
        setup, meter, mode = self.setup, self._fake_meter, fake_mode()
        if setup.model is None:
            cell = CellWorld(setup.step, mode, self._home if paused else None)
            return Trainer(FakeCellStep(cell, meter), meter, cell, setup.steps_per_trial,
                           cell.tensors, Marks(cell.marked(), None),
                           around=lambda: mode, fake=True)
        world = (ShardedWorld(setup.model, setup.optimizer, mode, setup.mesh,
                              setup.units) if setup.mesh is not None
                 else FakeWorld(setup.model, setup.optimizer, mode, self._rule))
        return Trainer(fake_step(world, setup.make, setup.loss_fn, setup.amp, meter,
                                 keep_output=setup.keep_output), meter, world,
                       setup.steps_per_trial, world.tensors,
                       Marks(world.marked(), world.optimizer),
                       around=(lambda: mode) if paused else world.active, fake=True)

    def _step(self) -> ProbeStep:
        """What each real trial runs: the model form's training step, or the user's own step."""
        setup = self.setup
        if setup.model is None:
            return setup.step
        scaler = setup.scaler
        if setup.amp == "fp16" and scaler is None:
            scaler = torch.amp.GradScaler(setup.device.type)
        return model_step(setup.model, setup.make, setup.loss_fn, setup.optimizer, setup.device,
                          setup.amp, scaler, self.meter, keep_output=setup.keep_output)

    # -- the search ----------------------------------------------------------------------------

    def _seed(self) -> None:
        """The search on fake tensors first, on the model's fake twins (NOTE [ A free first
        guess ])."""
        real, self._seeding = self.trainer, True
        try:
            with collector_paused():
                self.trainer = self._fake_trainer(paused=True)
                self._search()
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
            how = ("Planned first for this GPU on fake tensors (its workspaces, kernels and "
                   "caching allocator; " if self._fake_meter is not self.meter
                   else "Traced first on fake tensors (")
            self.seed_note = (f" {how}sizes "
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

    def _search(self) -> None:
        """Size after size until the policy has its answer, a stop, or an error on any rank."""
        on_step, should_stop = self.setup.on_step, self.setup.should_stop
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
                searched, start=self.start, multiple_of=self.setup.multiple_of,
                ceiling=self.setup.ceiling, limit_bytes=self.limit_bytes, predicted=predicted)
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
                self.split_trace = trace  # the report's step_snapshot
            if reading.peak_reserved_bytes:
                self.overhead_bytes = max(0, reading.peak_reserved_bytes - max(trace.live))
            if self.meter.device.type == "cuda" and not attempt.fake:  # workspaces the
                # tensor trace cannot see
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

    def _event_pair(self) -> Pair | None:
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
                multiple_of=self.setup.multiple_of, ceiling=self.setup.ceiling,
                preallocated=large.preallocated, overhead_bytes=self.unseen_bytes)
        return self.model.largest_batch_size(self.limit_bytes - self.overhead_bytes,
                                             multiple_of=self.setup.multiple_of,
                                             ceiling=self.setup.ceiling)

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

    def _method(self) -> str:
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

    # -- the report of the search --------------------------------------------------------------

    def _report(self) -> BatchSizeReport:
        """The report of what the search found (``NoBatchSizeFits`` when nothing fits)."""
        setup, attempts = self.setup, self.attempts
        lo, hi = _search.bracket([a for a in attempts if not a.fake])  # what ran decides
        if self.stopped:
            stop = "stopped"
        elif lo == 0:
            stop = "nothing fits"
        elif lo >= setup.ceiling:
            stop = "max_batch_size" if setup.max_batch_size else "ceiling"
            if stop == "ceiling" and _search.memory_stayed_flat(attempts):
                stop = f"ceiling: {_FLAT}"
                warnings.warn(f"find_batch reached its ceiling of {setup.ceiling} samples, but "
                              f"the step's {_FLAT} (it must return a batch of the size it is "
                              f"given), or the step allocates nothing on {setup.device}.",
                              BatchwidgetsWarning, stacklevel=user_stacklevel())
        else:
            stop = "boundary"
        segments = () if self.model is None else self.model.envelope(
            1, max(a.batch_size for a in attempts))
        if setup.trace == "fake":  # nothing ran: no step times, every size marked
            attempts = [dataclasses.replace(a, fake=True, step_time_s=None) for a in attempts]
        report = BatchSizeReport(
            max_batch_size=lo, first_oom_batch_size=hi, attempts=tuple(attempts),
            device=str(setup.device), budget_bytes=setup.budget_bytes,
            limit_bytes=self.limit_bytes, baseline_bytes=self.meter.baseline_bytes,
            memory_model=_search.fit_memory(attempts), headroom=setup.headroom,
            multiple_of=setup.multiple_of, amp=setup.amp, stop_reason=stop,
            peak_segments=segments, method=" ".join([self._method(), *setup.notes,
                                             *([self._rule.note] if self._rule else [])]),
            worst_case=self._batches_from(), memory_split=self.split,
            memory_timeline=self.timeline, trace=setup.trace, loop=self._loop_of(),
            step_snapshot=self._snapshot(), assumed=setup.assumed + self._loss_assumed())
        if lo == 0 and stop != "stopped":
            raise NoBatchSizeFits(report)
        return report

    def _snapshot(self) -> StepSnapshot | None:
        """The step the memory split is of, as a memory snapshot records it; a plan makes its
        own at its answer (_plan.py)."""
        if self.setup.target is not None or self.split is None or self.split_trace is None:
            return None
        return memory.step_snapshot(self.split_trace, self.split.batch_size,
                                    str(self.setup.device), cap_bytes=self.limit_bytes,
                                    allocator=self.replays)

    def _batches_from(self) -> str:
        """What the batches were built from, for the report: a Dataset's sample (its
        description), else the callable or the step that made them."""
        setup = self.setup
        if setup.batch_description:
            return setup.batch_description
        if setup.model is None:
            return "the step's own: step(batch_size) builds its batches"
        make, extra = setup.make, ""
        if isinstance(make, functools.partial) and make.func is at_length:
            make, extra = make.args[0], f", {make.args[1]}"
        name = getattr(make, "__qualname__", None) or type(make).__name__
        return f"{name}(batch_size{extra}), called at each size tried"

    def _loop_of(self) -> str:
        """The loop the answer is for (NOTE [ The loop the step models ] in _trials.py)."""
        if self.setup.model is None:
            return "your cell" if isinstance(self.setup.step, CellStep) else "your step"
        return "keeps output" if self.setup.keep_output else "frees output"

    def _loss_assumed(self) -> tuple[str, ...]:
        """The loss the model form took without ``loss_fn`` (NOTE [ Say what was assumed ] in
        _resolve.py)."""
        if self.setup.model is None or self.setup.loss_fn is not None or not self.loss_from:
            return ()
        return (f"loss {self.loss_from} (loss_fn=)",)


# -- the trials of one call -------------------------------------------------------------------

def trials(setup: ProbeSetup) -> tuple[ProbeSetup, Traced]:
    """The probe's traces. On this device: the search, verified. For a target, this process
    alone: on fake tensors, or by real steps where a fake trace cannot run, the reason kept in
    the setup's notes (a meta model has none to run: one line naming the op and the module);
    with ``parallel`` "fsdp" or "compare", one FSDP2 rank's traces too (``Traced.rank``), or
    why there are none (``Traced.rank_note``)."""
    with alone() if setup.target is not None else contextlib.nullcontext():
        while True:  # fake first for a target, unless real steps were asked for
            try:
                traced = probed(setup)
                break
            except Exception as error:
                if setup.trace == "real":  # asked for, or this device's own search
                    raise
                on_meta = has_meta_tensors(setup.model)
                if isinstance(error, FakeTraceError) and on_meta:
                    raise ValueError(
                        f"model should run on fake tensors to be planned from the meta device, "
                        f"but {error.op} in {error.module} reads a value back or makes a shape "
                        f"from data; build the model on a real device (it is then traced by "
                        f"real steps), or avoid that op (e.g. pass attention_mask, labels of a "
                        f"fixed shape).") from error
                if on_meta:
                    raise
                reason = (str(error).rstrip(".")
                          if isinstance(error, (FakeTraceError, OptimizerStateError))
                          else first_line(error))
                setup = dataclasses.replace(setup, trace="real", notes=(
                    *setup.notes, f"Traced by real steps: {reason}."))
    if setup.target is None or setup.parallel not in ("fsdp", "compare") or traced.stopped:
        return setup, traced
    if setup.trace != "fake":
        return setup, dataclasses.replace(traced, rank_note="the step was traced by real steps")
    if traced.state_by_shape:
        return setup, dataclasses.replace(
            traced, rank_note="its optimizer's state cannot be made on fake tensors")
    try:  # one FSDP2 rank on a fake process group (NOTE [ One FSDP2 rank, traced ] in _sharded.py)
        with fake_group(setup.world_size) as mesh:
            rank, why_not = probed(setup.with_change(mesh=mesh)), ""
    except FakeGroupUnavailable as error:
        rank, why_not = None, str(error)
    except ShardingError:
        if setup.parallel == "fsdp":
            raise
        rank, why_not = None, "fully_shard cannot wrap this model"
    except Exception as error:  # what the plain trace ran, one FSDP2 rank could not
        memory.drop_own_frames(error)
        rank, why_not = None, f"one FSDP2 rank could not be traced ({first_line(error)})"
    return setup, dataclasses.replace(traced, rank=rank, rank_note=why_not)
