"""The traced core both engines stand on: a step run at the sizes a search picks, under the meter
and the state guard, on this device's real tensors or on fake ones (``traced``), and the report of
what the search found (``report_of``). Measuring on this device (``_measure.py``) and planning for
a target (``_plan.py``) are the two engines on it; each takes from it a Search and a report."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport
from ...results._snapshot import StepSnapshot
from .. import memory
from .._options import ProbeStep
from .._state import InterruptGuard, TrainingState, restore_home
from .._util import user_stacklevel
from . import _search
from ._cell import CellStep, CellWorld, FakeCellStep
from ._fake import FakeWorld, fake_mode, fake_step
from ._loop import Search
from ._nothing_fits import NoBatchSizeFits
from ._optimizer_shapes import StateRule
from ._ranks import agree_limit, checkpoints_in, in_job
from ._setup import ProbeSetup
from ._sharded import ShardedWorld
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


def traced(setup: ProbeSetup, rule: StateRule | None = None) -> Search:
    """Enter the meter and the state guard, run the search; every trial starts from the user's
    state, and the user's state comes back however it ends (NOTE [ Restoring under Ctrl-C ] in
    engine/_state.py). A fake trace touches none of the user's tensors: only the modes, RNGs
    and flags are guarded then (see NOTE [ Fake trials ] in _fake.py)."""
    fake = setup.trace == "fake"
    home_state = (TrainingState(setup.owner, None, (), weights=False, loss_fn=setup.loss_fn,
                                trains=setup.optimizer)
                  if fake else TrainingState(setup.owner, setup.optimizer, setup.extras,
                                             loss_fn=setup.loss_fn, touches=_touches(setup)))
    meter = memory.probe_meter(setup.device, setup.budget_bytes,
                               setup.target[0] if setup.target is not None else None)
    guard = InterruptGuard()
    search = trainer = None
    try:
        with meter.capped():
            trainer = (_fake_trainer(setup, meter, rule) if fake
                       else _trainer(setup, meter, home_state))
            limit_bytes = agree_limit(meter.limit_bytes)
            # real steps in a job run to their end: NOTE [ Over the budget inside a job ]
            meter.defer_budget = in_job() and not fake
            meter.held_bytes = 0 if fake else held_outside_ops(setup.owner)
            meter.warm_up()
            search = Search(trainer, meter, start=setup.start, multiple_of=setup.multiple_of,
                            ceiling=setup.ceiling, limit_bytes=limit_bytes,
                            traced_only=setup.target is not None)
            if setup.fake_first:  # see NOTE [ A free first guess ] in _loop.py
                search.seed(lambda: _fake_trainer(setup, meter, paused=True, home=home_state),
                            setup.on_step, setup.should_stop)
            search.run(setup.on_step, setup.should_stop)
    except BaseException as error:  # its traceback (kept by IPython) must not keep them alive
        memory.drop_own_frames(error)
        raise
    finally:
        failed = restore_home(home_state, setup.model if setup.moves else None, setup.home, guard)
        if search is not None and trainer is not None:
            search.loss_from = getattr(trainer.step, "loss_from", "")
        home_state = trainer = None  # the traceback keeps this frame
        if search is not None:
            search.trainer = None
        memory.free_memory(setup.device, collect=not fake)  # fake tensors hold no memory
        if failed is not None:
            raise failed
    return search


def _trainer(setup: ProbeSetup, meter: Any, home_state: TrainingState) -> Trainer:
    """Real trials: each starts from the user's state (moved to the device probed)."""
    state = (moved(setup.model, setup.optimizer, setup.device, setup.extras, setup.loss_fn)
             if setup.moves else home_state)
    owned = [] if setup.owner is None else [*setup.owner.parameters(), *setup.owner.buffers()]
    touches = _touches(setup)
    return Trainer(_step(setup, meter), meter, state, setup.steps_per_trial,
                   lambda: state_tensors(setup.owner, setup.optimizer) + touched_tensors(touches),
                   Marks(owned, setup.optimizer), functools.partial(checkpoints_in, setup.owner),
                   called="" if setup.model is not None else "step")


def _touches(setup: ProbeSetup) -> tuple:
    """The other objects a %%find_batch cell names (NOTE [ A cell as the step ] in _cell.py):
    put back after each trial, and counted, as the model is."""
    mine = {id(o) for o in (setup.owner, setup.optimizer, *setup.extras) if o is not None}
    return tuple(o for o in getattr(setup.step, "touches", ()) if id(o) not in mine)


def _fake_trainer(setup: ProbeSetup, meter: Any, rule: StateRule | None = None,
                  paused: bool = False, home: TrainingState | None = None) -> Trainer:
    """Fake trials: the model's fake twins, each trial from their start (NOTE [ Fake trials ]).
    ``rule``: the optimizer's state by shape (NOTE [ Optimizer state by shape ]). ``paused``: the
    caller holds the cycle collector paused over all the trials (one collection instead of one
    per trial, which costs more than a small fake trial in a large process: see Search.seed).
    A %%find_batch cell's: its objects' twins (NOTE [ A cell's fake trials ]), ``home`` put
    back after each."""
    mode = fake_mode()
    if setup.model is None:
        cell = CellWorld(setup.step, mode, home)
        return Trainer(FakeCellStep(cell, meter), meter, cell, setup.steps_per_trial,
                       cell.tensors, Marks(cell.marked(), None),
                       around=lambda: mode, fake=True)
    world = (ShardedWorld(setup.model, setup.optimizer, mode, setup.mesh,
                          setup.units) if setup.mesh is not None
             else FakeWorld(setup.model, setup.optimizer, mode, rule))
    return Trainer(fake_step(world, setup.make, setup.loss_fn, setup.amp, meter,
                             keep_output=setup.keep_output), meter, world,
                   setup.steps_per_trial, world.tensors, Marks(world.marked(), world.optimizer),
                   around=(lambda: mode) if paused else world.active, fake=True)



def _step(setup: ProbeSetup, meter: Any) -> ProbeStep:
    """What each real trial runs: the model form's training step, or the user's own step."""
    if setup.model is None:
        return setup.step
    scaler = setup.scaler
    if setup.amp == "fp16" and scaler is None:
        scaler = torch.amp.GradScaler(setup.device.type)
    return model_step(setup.model, setup.make, setup.loss_fn, setup.optimizer, setup.device,
                      setup.amp, scaler, meter, keep_output=setup.keep_output)


def report_of(setup: ProbeSetup, search: Search) -> BatchSizeReport:
    """The report of what the search found (``NoBatchSizeFits`` when nothing fits)."""
    attempts = search.attempts
    lo, hi = _search.bracket([a for a in attempts if not a.fake])  # what ran decides
    if search.stopped:
        stop = "stopped"
    elif lo == 0:
        stop = "nothing fits"
    elif lo >= setup.ceiling:
        stop = "max_batch_size" if setup.max_batch_size else "ceiling"
        if stop == "ceiling" and _search.memory_stayed_flat(attempts):
            stop = f"ceiling: {_FLAT}"
            warnings.warn(f"find_batch reached its ceiling of {setup.ceiling} samples, but the "
                          f"step's {_FLAT} (it must return a batch of the size it is given), "
                          f"or the step allocates nothing on {setup.device}.",
                          BatchwidgetsWarning, stacklevel=user_stacklevel())
    else:
        stop = "boundary"
    segments = () if search.model is None else search.model.envelope(
        1, max(a.batch_size for a in attempts))
    if setup.trace == "fake":  # nothing ran: no step times, every size marked
        attempts = [dataclasses.replace(a, fake=True, step_time_s=None) for a in attempts]
    report = BatchSizeReport(
        max_batch_size=lo, first_oom_batch_size=hi, attempts=tuple(attempts),
        device=str(setup.device), budget_bytes=setup.budget_bytes, limit_bytes=search.limit_bytes,
        baseline_bytes=search.meter.baseline_bytes, memory_model=_search.fit_memory(attempts),
        headroom=setup.headroom, multiple_of=setup.multiple_of, amp=setup.amp, stop_reason=stop,
        peak_segments=segments, method=" ".join([search.method(), *setup.notes]),
        worst_case=_batches_from(setup), memory_split=search.split,
        memory_timeline=search.timeline, trace=setup.trace, loop=_loop_of(setup),
        step_snapshot=_snapshot(setup, search),
        assumed=setup.assumed + _loss_assumed(setup, search))
    if lo == 0 and stop != "stopped":
        raise NoBatchSizeFits(report)
    return report


def _snapshot(setup: ProbeSetup, search: Search) -> StepSnapshot | None:
    """The step the memory split is of, as a memory snapshot records it; a plan makes its
    own at its answer (_plan.py)."""
    if setup.target is not None or search.split is None or search.split_trace is None:
        return None
    return memory.step_snapshot(search.split_trace, search.split.batch_size,
                                str(setup.device), cap_bytes=search.limit_bytes,
                                allocator=search.replays)


def _batches_from(setup: ProbeSetup) -> str:
    """What the batches were built from, for the report: a Dataset's sample (its description),
    else the callable or the step that made them."""
    if setup.batch_description:
        return setup.batch_description
    if setup.model is None:
        return "the step's own: step(batch_size) builds its batches"
    make, extra = setup.make, ""
    if isinstance(make, functools.partial) and make.func is at_length:
        make, extra = make.args[0], f", {make.args[1]}"
    name = getattr(make, "__qualname__", None) or type(make).__name__
    return f"{name}(batch_size{extra}), called at each size tried"


def _loop_of(setup: ProbeSetup) -> str:
    """The loop the answer is for (NOTE [ The loop the step models ] in _trials.py)."""
    if setup.model is None:
        return "your cell" if isinstance(setup.step, CellStep) else "your step"
    return "keeps output" if setup.keep_output else "frees output"


def _loss_assumed(setup: ProbeSetup, search: Search) -> tuple[str, ...]:
    """The loss the model form took without ``loss_fn`` (NOTE [ Say what was assumed ])."""
    if setup.model is None or setup.loss_fn is not None or not search.loss_from:
        return ()
    return (f"loss {search.loss_from} (loss_fn=)",)


def at_length(make_batch: Callable, length: int, batch_size: int) -> Any:
    """make_batch(batch_size, length): the frontier's batches at one sequence length."""
    return make_batch(batch_size, length)
