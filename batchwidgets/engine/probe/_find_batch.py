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

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport
from .._called import is_said
from .._options import Amp, OnStep, ProbeStep, ShouldStop, Trace
from . import _what_if
from ._fakes import resizes_seen_in_job
from ._nothing_fits import NoBatchSizeFits, already
from ._options import OPTIONS, FindBatchRequest
from ._plan import plan
from ._probe import trials
from ._remember import remembered
from ._resolve import eager_while_probed, resolve
from ._setup import ProbeSetup, at_length

MakeBatch = (Callable[[int], Any] | torch.utils.data.Dataset | torch.utils.data.DataLoader
             | torch.Tensor)


def find_batch(model: torch.nn.Module | ProbeStep, make_batch: MakeBatch | None = None,
               loss_fn: Callable | None = OPTIONS.loss_fn,
               optimizer: torch.optim.Optimizer | None = OPTIONS.optimizer,
               device: torch.device | str | None = OPTIONS.device,
               budget: int | str | None = OPTIONS.budget, amp: Amp | None = OPTIONS.amp,
               max_batch_size: int | None = OPTIONS.max_batch_size,
               multiple_of: int = OPTIONS.multiple_of, headroom: float = OPTIONS.headroom, *,
               scaler: Any = OPTIONS.scaler, scheduler: Any = OPTIONS.scheduler,
               steps_per_trial: int = OPTIONS.steps_per_trial, start: int | None = OPTIONS.start,
               on_step: OnStep | None = OPTIONS.on_step,
               should_stop: ShouldStop | None = OPTIONS.should_stop,
               seq_len: Sequence[int] | None = OPTIONS.seq_len,
               what_if: bool = OPTIONS.what_if, target: str | int | None = OPTIONS.target,
               trace: Trace | None = OPTIONS.trace, step: ProbeStep | None = OPTIONS.step,
               parallel: str | None = OPTIONS.parallel,
               keep_output: bool = OPTIONS.keep_output, cache: bool = OPTIONS.cache,
               refresh: bool = OPTIONS.refresh) -> BatchSizeReport:
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
        everything that decides memory: the model's structure (the functions its modules
        keep too), parameters and buffers, the optimizer's class and settings, the batch's
        shapes and dtypes, the code of ``make_batch`` and ``step``, the options, the device and
        the memory free on it, the versions of torch and of the engine. Files in
        ``$BATCHWIDGETS_CACHE_DIR`` (default: the user cache folder, e.g.
        ``~/.cache/batchwidgets``); ``batchwidgets.forget()`` clears them. False: neither read
        nor write.
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
    request = FindBatchRequest(  # see probe/_options.py
        loss_fn=loss_fn, optimizer=optimizer, device=device, budget=budget, amp=amp,
        max_batch_size=max_batch_size, multiple_of=multiple_of, headroom=headroom,
        scaler=scaler, scheduler=scheduler, steps_per_trial=steps_per_trial, start=start,
        on_step=on_step, should_stop=should_stop, seq_len=seq_len, what_if=what_if,
        target=target, trace=trace, step=step, parallel=parallel, keep_output=keep_output,
        cache=cache, refresh=refresh)
    setup = resolve(model, make_batch, request)
    try:  # a compiled model's eager step: NOTE [ A compiled model is probed in its eager step ]
        with eager_while_probed(setup) as measured, resizes_seen_in_job():  # FSDP2's frees
            report = remembered(setup,  # see NOTE [ Remembered answers ]
                                lambda: _frontier(setup) if setup.seq_len is not None
                                else _probe(setup))
        return dataclasses.replace(report, measured_step=measured) if measured else report
    except Exception as error:
        if not is_said(error):
            raise
        raise error.with_traceback(None) from error.__cause__  # said in our words: from here


def _probe(setup: ProbeSetup) -> BatchSizeReport:
    """One probe, its stages in turn: the trials (traced for a target, searched and verified on
    this device), the plan for a target, each what-if change tried again, the rows. Where
    nothing fits, the error's advice is the call's (NOTE [ Advice from the call ] in
    _nothing_fits.py)."""
    try:
        setup, traced = trials(setup)
        report = plan(setup, traced) if setup.target is not None else traced.report
    except NoBatchSizeFits as error:
        if error.call is not None:
            raise
        raise NoBatchSizeFits(error.report, already(setup)) from None
    tried = [(change, _tried(setup, change)) for change in _what_if.changes(setup, traced)]
    return _what_if.with_rows(setup, traced, report, tried)


def _tried(setup: ProbeSetup, change: _what_if.Change) -> BatchSizeReport | None:
    """The probe (or the plan) again with one what-if change; None where nothing fits or the
    change cannot run (autocast on a device without it). The row's cost line says what the
    change costs: no warning from each probe."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BatchwidgetsWarning)
            return _probe(setup.with_change(**change.change))
    except NoBatchSizeFits:
        return None
    except RuntimeError as error:
        if "autocast" not in str(error):
            raise
        return None


# NOTE [ A compared plan's frontier ]
# parallel="compare" plans every strategy at each sequence length and answers with the one that
# fits the most at the longest. The frontier is that strategy's at every length, as the report
# (and the command line's table) says "per rank under <strategy>": each length's own best mixed
# strategies (FSDP2's 23 at 128 tokens beside DDP's 11 at 256, labelled DDP, whose 128 is 22).
# Every strategy's answer at the longest length stays in ``parallel_plans``.


def _frontier(setup: ProbeSetup) -> BatchSizeReport:
    """The probe at each sequence length; the longest length's report, with the frontier."""
    frontier: dict[int, int] = {}
    strategies: dict[int, dict[str, int]] = {}  # parallel="compare": each strategy's, by length
    report: BatchSizeReport | None = None
    for length in setup.seq_len:
        one_length = dataclasses.replace(
            setup, seq_len=None, make=functools.partial(at_length, setup.make, length))
        try:
            report = _probe(one_length)
        except NoBatchSizeFits as error:
            report = error.report
        frontier[length] = report.max_batch_size
        strategies[length] = {row.parallel: row.max_batch_size
                              for row in report.parallel_plans or ()}
        if report.stop_reason == "stopped":
            break
    if len(strategies[length]) > 1:  # one strategy's frontier: the one the answer names, not
        # each length's best (NOTE [ A compared plan's frontier ])
        frontier = {at: strategies[at].get(report.parallel, frontier[at]) for at in frontier}
    report = dataclasses.replace(report, frontier=frontier, seq_len=length)
    if report.max_batch_size == 0 and report.stop_reason != "stopped":
        raise NoBatchSizeFits(report, already(setup))
    return report
