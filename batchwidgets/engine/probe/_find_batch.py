"""``find_batch``: the largest batch size that trains on this device, measured, not guessed.

Usage:
    >>> import torch, batchwidgets as bw
    >>> model = torch.nn.Linear(8, 2)
    >>> report = bw.find_batch(model, torch.zeros(8), optimizer=torch.optim.SGD(model.parameters()),
    ...                        budget="64KB", max_batch_size=4096)
    >>> report.max_batch_size > 0
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport
from .. import memory
from .._called import is_said
from .._state import InterruptGuard, TrainingState, restore_home
from .._types import Amp, ProbeStep, ShouldStop, Trace
from .._util import first_line
from . import _search, _what_if
from ._cell import CellStep, CellWorld, FakeCellStep
from ._checks import has_meta_tensors
from ._fake import FakeTraceError, FakeWorld, fake_mode, fake_step
from ._fake_group import FakeGroupUnavailable, fake_group
from ._loop import Search, planned
from ._nothing_fits import NoBatchSizeFits
from ._optimizer_shapes import OptimizerStateError, StateRule, state_rule
from ._options import FIND_BATCH
from ._parallel import plan_ranks
from ._ranks import agree_limit, alone, in_job
from ._remember import remembered
from ._setup import ProbeSetup, resolve
from ._sharded import ShardedWorld, ShardingError
from ._trials import (
    Marks,
    OnStep,
    Trainer,
    held_outside_ops,
    model_step,
    moved,
    state_tensors,
    touched_tensors,
)

# NOTE [ find_batch, a long module ]
# Over 400 lines: the public function's docstring is its manual (a hundred lines), and the
# stages it runs (search under the guard, the report, a target's plans for one GPU and for N
# ranks, the frontier) call one another; split them only with the ProbeSetup they share.
MakeBatch = (Callable[[int], Any] | torch.utils.data.Dataset | torch.utils.data.DataLoader
             | torch.Tensor)

_FLAT = "memory did not grow with the batch size: check make_batch"


def find_batch(model: torch.nn.Module | ProbeStep, make_batch: MakeBatch | None = None,
               loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
               device: torch.device | str | None = None, budget: int | str | None = None,
               amp: Amp | None = None, max_batch_size: int | None = None, multiple_of: int = 1,
               headroom: float = 0.9, *, scaler: Any = None, scheduler: Any = None,
               steps_per_trial: int = 2, start: int | None = None,
               on_step: OnStep | None = None, should_stop: ShouldStop | None = None,
               seq_len: Sequence[int] | None = None,
               what_if: bool = False, target: str | int | None = None,
               trace: Trace | None = None, step: ProbeStep | None = None,
               parallel: str | None = None, keep_output: bool = True,
               cache: bool = True, refresh: bool = False) -> BatchSizeReport:
    """Find the largest batch size that trains without running out of memory.

    Runs real training steps (forward, loss, backward, optimizer step; ``steps_per_trial`` of
    them per size, since Adam allocates its state on the first) and searches by predicting the
    boundary from measured memory, then verifying it (see NOTE [ Predict, then verify ]).
    The step is the common loop's: ``out = model(x); loss = loss_fn(out, y); loss.backward();
    optimizer.step()``, the output and loss alive until the next step's forward has returned
    (``keep_output``). Out-of-memory errors are data; any other exception from the model, the
    loss or the batch comes out of the user's type, its first line saying what find_batch
    called with what, at which batch size, on fake or real tensors, and the user's error its
    ``__cause__``. Model weights, buffers, gradients, optimizer/scheduler/scaler state,
    train/eval modes, RNGs and backend flags are restored bit for bit however it ends.

    Parameters
    ----------
    model : torch.nn.Module or callable
        The model, or ``step(batch_size)`` that runs one whole training step itself.
    make_batch : callable, Dataset, DataLoader or Tensor
        ``make_batch(batch_size) -> batch``; a Dataset/DataLoader (real samples, the largest
        when sizes vary); or one example tensor, repeated. A batch ``(x, ..., y)`` is fed as
        ``loss_fn(model(x, ...), y)``, a dict as ``model(**batch)``, a tensor as ``model(x)``.
    loss_fn : callable, optional
        ``loss_fn(output, target)``; leave it out when the model's output carries ``.loss``
        (Hugging Face models given labels). See NOTE [ The batch convention ] in engine/_batches.py:
        a target that is present is always used, or the call is refused with the fix.
    optimizer : torch.optim.Optimizer, optional
        Default: a fresh ``torch.optim.AdamW`` on the model's parameters (Adam-sized state).
        With a bare ``step``, pass the optimizer it uses: its parameters (weights, gradients)
        and state are then restored too; find_batch cannot see them otherwise.
    device : str or torch.device, optional
        Default: the model's device (or CUDA for a bare step when present).
    budget : int or str, optional
        Memory cap, e.g. ``"512MB"``, ``"16GiB"``. CUDA: caps the process (emulates a smaller
        GPU). CPU/MPS: the step's live tensor bytes may not pass it. Default: the whole GPU;
        on the CPU, half of the available RAM.
    amp : {"bf16", "fp16"}, optional
        Probe under autocast (fp16 with a GradScaler).
    max_batch_size, multiple_of, headroom
        Largest size to try; sizes tried are multiples of ``multiple_of``; the recommendation
        stays under ``headroom * max_batch_size``.
    scaler, scheduler : optional
        Restored afterwards; ``scaler`` is used for the steps.
    steps_per_trial : int
        Training steps run at each size.
    start : int, optional
        First size tried (default 2, or ``multiple_of`` when larger); if it does not fit, the
        probe halves down to ``multiple_of``.
    on_step : callable, optional
        Called with each ``Attempt`` as it finishes (progress for front ends).
    should_stop : callable, optional
        Polled before each size (as in ``tune_loader``) and between the ops of a step (at most
        every 0.05 s); True ends the search with the sizes it finished (``stop_reason=
        "stopped"``), the size it stopped in undone: model, optimizer and RNGs as they were.
        A front end's Stop button.
    seq_len : sequence of int, optional
        Sequence lengths: ``make_batch(batch_size, seq_len)`` is called, each length probed, and
        ``report.frontier`` maps each length to its largest batch size (the rest of the report
        is the longest length's probe).
    target : str or int, optional
        A GPU that is not here: ``"T4"``, ``"L4"``, ``"A10G"``, ``"V100-16GB"``, ``"A100-40GB"``,
        ``"A100-80GB"``, ``"H100-80GB"``, ``"H200"``, or a size (``"24GiB"``). The step is traced
        at two small sizes on the CPU and replayed through a model of the CUDA caching allocator
        (workspaces included) under the target's memory less the CUDA context; the answer is
        *predicted, not run*, and says so (``stop_reason``, ``summary()``, ``target_band``).
        A model built on the meta device (``with torch.device("meta"): model = ...``) is
        planned too: nothing of it is materialised. A count plans that many GPUs
        (``"8xA100-80GB"``, ``"4xH100"``, ``"2x24GiB"``) under ``parallel`` (default "ddp");
        ``"4xCPU"`` with ``budget=`` plans CPU processes under that budget each.
    trace : {"fake", "real"}, optional
        How a target's small sizes are traced: on fake tensors (``FakeTensorMode``: shapes, no
        compute, no memory; the default for a target plan of a model) or by real steps. A step
        fake tensors cannot run (``.item()``, ``nonzero``) is traced by real steps instead, and
        ``report.method`` says why; ``report.trace`` names what the answer rests on. On this
        device (no ``target``) the model form searches on fake tensors first, under the same
        budget, and spends real steps only at the edge it found (the answer rests on them:
        ``report.trace == "real"``, the fake attempts say ``fake=True``); ``trace="real"`` runs
        real steps only.
    step : callable, optional
        ``find_batch(model, step=my_step, optimizer=optimizer)``: your own ``step(batch_size)``
        trains ``model``, which is then protected (weights, buffers, gradients, modes restored)
        and counted in the budget, as in the model form. ``find_batch(my_step)`` alone cannot
        see the model: pass ``optimizer=`` at least, so its parameters are restored and counted.
    parallel : {"ddp", "fsdp", "zero1", "zero2", "zero3", "compare"}, optional
        With a target of several GPUs (or inside a job): how the ranks hold the model. "ddp"
        (DistributedDataParallel: every rank holds everything, plus its gradient buckets),
        "fsdp" (FSDP2 ``fully_shard`` per block), "zero1"-"zero3" (DeepSpeed's stages, by
        their published rules); "compare" plans each and reports the one with the largest
        batch. ``max_batch_size`` is then per rank, ``global_batch_size`` over the
        ``world_size`` ranks, ``parallel_plans`` has every strategy, ``memory_split`` one rank's
        (``communication_bytes``: the strategy's buffers). Predicted, not run; the model is
        only read: "fsdp" is traced on one rank of a fake process group, the others from the
        one-GPU trace with each storage at a rank's share (see NOTE [ Per-rank memory by
        strategy ] in probe/_parallel.py).
    what_if : bool
        Also probe with each change the user could make (bf16, fp16, SGD, ``foreach=False``) and
        list the largest batch under each in ``report.what_if``, measured. Rows the per-op model
        predicts (no optimizer state, activation checkpointing of the largest blocks) are there
        whenever the model is.
    keep_output : bool
        The loop modelled (NOTE [ The loop the step models ] in probe/_trials.py). True: the
        model's output and the loss stay alive through backward and the optimizer step, until
        the next step's forward returns, as a loop's variables do (Hugging Face's manual loop,
        ``out = model(x)``). False: a loop that frees the output before backward (the Hugging
        Face Trainer's ``compute_loss``). ``report.loop`` says which; a what-if row predicts
        the other. A loop that does more (``zero_grad(set_to_none=False)``, an EMA copy) is
        what ``%%find_batch`` (the cell itself, measured) or ``step=`` is for.
    cache : bool
        Give back at once the answer an identical call measured before (in this process or
        another: ``report.remembered`` says when and where), and remember this one. The key is
        everything that decides memory: the model's structure, parameters and buffers, the
        optimizer's class and settings, the batch's shapes and dtypes, the code of
        ``make_batch`` and ``step``, the options, the device and the memory free on it, the
        versions of torch and of the engine. Files in ``$BATCHWIDGETS_CACHE_DIR`` (default:
        the user cache folder, e.g. ``~/.cache/batchwidgets``); ``batchwidgets.forget()``
        clears them. False: neither read nor write.
    refresh : bool
        Measure again even where an answer is remembered, and remember the new one.

    Returns
    -------
    BatchSizeReport

    Raises
    ------
    NoBatchSizeFits
        When even the smallest size runs out of memory (carries ``.report``).

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    >>> opt = torch.optim.Adam(model.parameters())
    >>> report = find_batch(model, torch.randn(3, 32, 32), optimizer=opt, budget="8MiB")
    >>> report.max_batch_size, report.first_oom_batch_size
    (622, 623)
    """
    options = FIND_BATCH.pick(locals())  # see probe/_options.py
    setup = resolve(model, make_batch, options)
    try:
        return remembered(setup, options,  # see NOTE [ Remembered answers ]
                          lambda: _frontier(setup) if setup.seq_len is not None
                          else _probe(setup))
    except Exception as error:
        if not is_said(error):
            raise
        raise error.with_traceback(None) from error.__cause__  # said in our words: from here


def _probe(setup: ProbeSetup) -> BatchSizeReport:
    """The stages after the setup: the search under the meter and the state guard, the report,
    then what the report adds (a target's prediction, the what-ifs)."""
    with alone() if setup.target is not None else contextlib.nullcontext():
        setup, search = _searched(setup)
    report = _report(setup, search)
    if setup.target is not None:
        report = planned(report, search, *setup.target)
        if setup.parallel is not None:  # see NOTE [ Per-rank memory by strategy ]
            report = _ranks_planned(setup, report, search)
        if report.max_batch_size == 0 and report.stop_reason != "stopped":
            raise NoBatchSizeFits(report)
        # each row planned, never measured; a plan for N GPUs has its strategies' rows instead.
        # The per-op model's rows (the other loop's answer among them) cost nothing: in every
        # plan; what_if=True plans each change
        if setup.model is not None and setup.parallel is None:
            report = dataclasses.replace(report, what_if=_what_if.for_target(
                search.model, report.max_batch_size, setup.target[1],
                (lambda **change: _probe(setup.with_change(**change))) if setup.what_if else None,
                setup.optimizer, setup.amp, multiple_of=setup.multiple_of, ceiling=setup.ceiling,
                modules=_what_if.checkpoint_candidates(setup.model), module=setup.model))
        return report
    rows = _predicted_what_ifs(setup, report, search)
    if setup.what_if and setup.model is not None:
        rows += _what_if.measured(lambda **change: _probe(setup.with_change(**change)),
                                  setup.optimizer, setup.amp, setup.model)
    return dataclasses.replace(report, what_if=tuple(rows)) if rows else report


def _ranks_planned(setup: ProbeSetup, report: BatchSizeReport,
                   search: Search) -> BatchSizeReport:
    """Each strategy's per-rank plan: FSDP2 traced on one rank of a fake group where it can be
    (NOTE [ One FSDP2 rank, traced ]), the rest by each storage's share on a rank."""
    traced: dict[str, BatchSizeReport] = {}
    if setup.parallel in ("fsdp", "compare"):
        fsdp, why_not = _fsdp_traced(setup) if setup.trace == "fake" else (
            None, "the step was traced by real steps")
        if fsdp is not None:
            traced["fsdp"] = fsdp
        else:
            report = dataclasses.replace(report, method=f"{report.method} FSDP2 planned by its "
                                                        f"published rules: {why_not}.")
    name, usable = setup.target
    return plan_ranks(report, setup.model, setup.parallel, setup.world_size, search._event_pair(),
                      lambda pair: planned(report, search, name, usable, pair), traced)


def _fsdp_traced(setup: ProbeSetup) -> tuple[BatchSizeReport | None, str]:
    """One FSDP2 rank's plan, traced on a fake process group; or None and why it could not be."""
    if state_rule(setup.optimizer) is not None:
        return None, "its optimizer's state cannot be made on fake tensors"
    try:
        with fake_group(setup.world_size) as mesh:
            sharded = dataclasses.replace(setup, mesh=mesh, what_if=False, on_step=None)
            search = _search_guarded(sharded)
            report = planned(_report(sharded, search), search, *setup.target)
    except FakeGroupUnavailable as error:
        return None, str(error)
    except ShardingError:
        if setup.parallel == "fsdp":
            raise
        return None, "fully_shard cannot wrap this model"
    except Exception as error:  # what the plain trace ran, one FSDP2 rank could not
        memory.drop_own_frames(error)
        return None, f"one FSDP2 rank could not be traced ({first_line(error)})"
    method = (f"{report.method} One FSDP2 rank of {setup.world_size} traced on a fake process "
              f"group: its shards, all-gathers and reduce-scatters as they run.")
    return dataclasses.replace(report, method=method), ""


def _searched(setup: ProbeSetup) -> tuple[ProbeSetup, Search]:
    """The search; a fake trace that cannot run is traced by real steps, the reason kept in
    the setup's notes (a meta model has none to run: one line naming the op and the module)."""
    if setup.trace == "real":
        return setup, _search_guarded(setup)
    try:
        rule = state_rule(setup.optimizer)  # see NOTE [ Optimizer state by shape ]
        with_rule = setup if rule is None else dataclasses.replace(
            setup, notes=(*setup.notes, rule.note))
        return with_rule, _search_guarded(with_rule, rule)
    except Exception as error:
        on_meta = has_meta_tensors(setup.model)
        if isinstance(error, FakeTraceError) and on_meta:
            raise ValueError(
                f"model should run on fake tensors to be planned from the meta device, but "
                f"{error.op} in {error.module} reads a value back or makes a shape from data; "
                f"build the model on a real device (it is then traced by real steps), or avoid "
                f"that op (e.g. pass attention_mask, labels of a fixed shape).") from error
        if on_meta:
            raise
        reason = (str(error).rstrip(".") if isinstance(error, (FakeTraceError, OptimizerStateError))
                  else first_line(error))
        notes = (*setup.notes, f"Traced by real steps: {reason}.")
        setup = dataclasses.replace(setup, trace="real", notes=notes)
        return setup, _search_guarded(setup)


def _search_guarded(setup: ProbeSetup, rule: StateRule | None = None) -> Search:
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
                   Marks(owned, setup.optimizer), called="" if setup.model else "step")


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
    world = (ShardedWorld(setup.model, setup.optimizer, mode, setup.mesh) if setup.mesh is not None
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


def _report(setup: ProbeSetup, search: Search) -> BatchSizeReport:
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
                          BatchwidgetsWarning, stacklevel=4)  # _probe, find_batch, the user
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
        assumed=setup.assumed + _loss_assumed(setup, search))
    if lo == 0 and stop != "stopped":
        raise NoBatchSizeFits(report)
    return report


def _batches_from(setup: ProbeSetup) -> str:
    """What the batches were built from, for the report: a Dataset's sample (its description),
    else the callable or the step that made them."""
    if setup.batch_description:
        return setup.batch_description
    if setup.model is None:
        return "the step's own: step(batch_size) builds its batches"
    make, extra = setup.make, ""
    if isinstance(make, functools.partial) and make.func is _at_length:
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


def _predicted_what_ifs(setup: ProbeSetup, report: BatchSizeReport, search: Search) -> list:
    """The what-if rows the per-op model predicts (see probe/_what_if.py), where it was fitted."""
    if search.model is None or search.limit_bytes is None:
        return []
    modules = _what_if.checkpoint_candidates(setup.owner) if setup.owner is not None else {}
    # On CUDA the tensors' bytes are not what runs out: the boundary found says where, in
    # tensor bytes, the reserved memory ran out, and the rows are predicted against that.
    row_limit = (search.model.peak_bytes(report.max_batch_size)
                 if search.replays and report.max_batch_size
                 else search.limit_bytes - search.overhead_bytes)
    rows = _what_if.predicted(search.model, row_limit, multiple_of=setup.multiple_of,
                              ceiling=setup.ceiling, modules=modules)
    if search.replays:  # the allocator's segments and rounding gone: tensors and workspaces
        rows += _what_if.expandable(search.model, search.limit_bytes - search.unseen_bytes,
                                    report.max_batch_size, multiple_of=setup.multiple_of,
                                    ceiling=setup.ceiling)
    return rows


def _frontier(setup: ProbeSetup) -> BatchSizeReport:
    """The probe at each sequence length; the longest length's report, with the frontier."""
    frontier: dict[int, int] = {}
    report: BatchSizeReport | None = None
    for length in setup.seq_len:
        at_length = dataclasses.replace(
            setup, seq_len=None, make=functools.partial(_at_length, setup.make, length))
        try:
            report = _probe(at_length)
        except NoBatchSizeFits as error:
            report = error.report
        frontier[length] = report.max_batch_size
        if report.stop_reason == "stopped":
            break
    report = dataclasses.replace(report, frontier=frontier, seq_len=length)
    if report.max_batch_size == 0 and report.stop_reason != "stopped":
        raise NoBatchSizeFits(report)
    return report


def _at_length(make_batch: Callable, length: int, batch_size: int) -> Any:
    return make_batch(batch_size, length)
