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
from typing import Any, Union

import torch

from .._warnings import BatchwidgetsWarning
from ..results import Attempt, BatchSizeReport
from . import _cuda_sim, _memory, _search, _what_if
from ._batches import as_batch_maker, forward_and_loss
from ._meters import make_meter
from ._probe_checks import _check_arguments, _check_step, _notes
from ._state import InterruptGuard, TrainingState, restore_home
from ._trials import (
    SEARCH_CEILING,
    OnStep,
    _agree_limit,
    _Marks,
    _planned,
    _Search,
    _state_tensors,
    _Trainer,
)
from ._types import Amp, ProbeStep, ShouldStop, progress
from ._util import default_device, to_device

Step = ProbeStep  # the earlier name (NOTE [ One vocabulary ] in _types.py)
MakeBatch = Union[Callable[[int], Any], torch.utils.data.Dataset, torch.utils.data.DataLoader,
                  torch.Tensor]

_FLAT = "memory did not grow with the batch size: check make_batch"
_AMP = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
        "float16": torch.float16}


class NoBatchSizeFits(RuntimeError):
    """Even the smallest batch size ran out of memory; ``.report`` holds every attempt."""

    def __init__(self, report: BatchSizeReport) -> None:
        self.report = report
        ran_out = [a for a in report.attempts if not _memory.cannot_train_alone(a.error)]
        smallest = min(ran_out or report.attempts, key=lambda a: a.batch_size)
        alone = ("; batch_size=1 cannot train this model (BatchNorm needs more than one value "
                 "per channel)" if len(ran_out) < len(report.attempts) else "")
        budget = (f"a budget of {report.budget_bytes} bytes" if report.budget_bytes
                  else "the whole device")
        peak = (f" (peak {smallest.peak_memory_bytes} bytes or more)"
                if smallest.peak_memory_bytes else "")
        super().__init__(
            f"No batch size fits: batch_size={smallest.batch_size} ran out of memory on "
            f"{report.device} with {budget}{peak}{alone}. Try amp='bf16' (or 'fp16'), a smaller "
            f"micro-batch with gradient accumulation (batchwidgets.accumulate), a larger budget, "
            f"or a smaller model. Last error: {smallest.error}")


def _resolve_device(model: Any, device: torch.device | str | None) -> torch.device:
    return _memory.usable_device(device) if device is not None else default_device(model)


# NOTE [ Why the probe starts at 2 ]
# Batch size 1 is a special case for many models: BatchNorm cannot train on one sample, and
# reductions over the batch, squeezes and kernel choices make its memory fall off the line that
# larger sizes lie on, so a fit through it misleads the jump. Starting at 2 (as Lightning's tuner
# does) costs nothing when 2 fits; when it does not, the search halves down to 1.


def _moved(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
           extras: tuple) -> TrainingState:
    """Move the model and its optimizer state to ``device``; the state to start each trial from.

    Optimizer state follows its parameter, except ``step`` counters, which PyTorch's optimizers
    keep on the host unless they are capturable or fused.
    """
    model.to(device)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != param.device:
                state[key] = value.to(param.device)
    return TrainingState(model, optimizer, extras)


def _model_step(model: torch.nn.Module, make: Callable[[int], Any], loss_fn: Callable | None,
                optimizer: torch.optim.Optimizer, device: torch.device, amp: str | None,
                scaler: Any, meter: Any) -> Callable[[int], None]:
    dtype = _AMP.get(amp) if amp else None

    def step(batch_size: int) -> None:
        model.train()  # each trial starts from the user's modes, restored after the last one
        with meter.making_batch():  # see TracingTracker.collapsed
            batch = to_device(make(batch_size), device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = forward_and_loss(model, batch, loss_fn)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        meter.end_forward_backward()  # see NOTE [ Two phases ] in _meters.py
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def find_batch(model: torch.nn.Module | ProbeStep, make_batch: MakeBatch | None = None,
               loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
               device: torch.device | str | None = None, budget: int | str | None = None,
               amp: Amp | None = None, max_batch_size: int | None = None, multiple_of: int = 1,
               headroom: float = 0.9, *, scaler: Any = None, scheduler: Any = None,
               steps_per_trial: int = 2, start: int | None = None,
               on_progress: OnStep | None = None,
               should_stop: ShouldStop | None = None,
               seq_len: Sequence[int] | None = None,
               what_if: bool = False, target: str | int | None = None,
               step: ProbeStep | None = None,
               on_step: OnStep | None = None) -> BatchSizeReport:
    """Find the largest batch size that trains without running out of memory.

    Runs real training steps (forward, loss, backward, optimizer step; ``steps_per_trial`` of
    them per size, since Adam allocates its state on the first) and searches by predicting the
    boundary from measured memory, then verifying it (see NOTE [ Predict, then verify ]).
    Out-of-memory errors are data; any other exception propagates unchanged. Model weights,
    buffers, gradients, optimizer/scheduler/scaler state, train/eval modes, RNGs and backend
    flags are restored bit for bit however it ends.

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
        (Hugging Face models given labels). See NOTE [ The batch convention ] in _batches.py:
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
    on_progress : callable, optional
        Called with each ``Attempt`` as it finishes (progress for front ends); ``on_step`` is
        its earlier name, still accepted (NOTE [ One vocabulary ] in _types.py).
    should_stop : callable, optional
        Polled before each size (as in ``tune_loader``); True ends the search with what it
        found so far (``stop_reason="stopped"``). A front end's Stop button.
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
    step : callable, optional
        ``find_batch(model, step=my_step, optimizer=optimizer)``: your own ``step(batch_size)``
        trains ``model``, which is then protected (weights, buffers, gradients, modes restored)
        and counted in the budget, as in the model form. ``find_batch(my_step)`` alone cannot
        see the model: pass ``optimizer=`` at least, so its parameters are restored and counted.
    what_if : bool
        Also probe with each change the user could make (bf16, fp16, SGD, ``foreach=False``) and
        list the largest batch under each in ``report.what_if``, measured. Rows the per-op model
        predicts (no optimizer state, activation checkpointing of the largest blocks) are there
        whenever the model is.

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
    on_step = progress(on_progress, on_step, "on_step")
    protected: torch.nn.Module | None = None  # the model a bare step= trains
    if step is not None:
        protected, model = _check_step(model, make_batch, step, seq_len), step
    _check_arguments(model, make_batch, amp, max_batch_size, multiple_of, headroom,
                     steps_per_trial, start, optimizer)
    if seq_len is not None:
        return _frontier(model, make_batch, seq_len, loss_fn=loss_fn, optimizer=optimizer,
                         device=device, budget=budget, amp=amp, max_batch_size=max_batch_size,
                         multiple_of=multiple_of, headroom=headroom, scheduler=scheduler,
                         scaler=scaler, steps_per_trial=steps_per_trial, start=start,
                         on_step=on_step, should_stop=should_stop, what_if=what_if,
                         target=target)
    budget_bytes = _memory.parse_bytes(budget, "budget")
    device = _resolve_device(model if protected is None else protected, device)
    planned = _cuda_sim.parse_target(target) if target is not None else None
    if planned is not None:  # see NOTE [ Planning for a GPU that is not here ]
        device, budget_bytes = torch.device("cpu"), None
    is_module = isinstance(model, torch.nn.Module)
    notes = _notes(owner=model if is_module else protected, device=device, amp=amp)
    if is_module and optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
    ceiling = (max_batch_size or SEARCH_CEILING) // multiple_of * multiple_of
    if start is None:
        start = min(max(multiple_of, 2), ceiling)  # see NOTE [ Why the probe starts at 2 ]

    extras = (scheduler, scaler)
    owner = model if is_module else protected  # whose weights, buffers and modes come back
    home_state = TrainingState(owner, optimizer, extras)
    moved = is_module and _resolve_device(model, None) != device
    home = _resolve_device(model, None) if is_module else device
    meter = (_cuda_sim.ProbeMeter(device, None, workspaces=_cuda_sim.target_workspaces(
        planned[0])) if planned is not None else _make_meter(device, budget_bytes))
    make_batch_fn = as_batch_maker(make_batch) if is_module else None
    guard = InterruptGuard()  # see NOTE [ Restoring under Ctrl-C ] in _state.py
    search: _Search | None = None
    try:
        with meter.capped():
            # each trial starts from this state: the user's, on the device probed
            state = _moved(model, optimizer, device, extras) if moved else home_state
            if is_module:
                if amp == "fp16" and scaler is None:
                    scaler = torch.amp.GradScaler(device.type)
                step = _model_step(model, make_batch_fn, loss_fn, optimizer, device, amp,
                                   scaler, meter)
            else:
                step = model
            trainer = _Trainer(step, meter, state, steps_per_trial,
                               lambda: _state_tensors(owner, optimizer), _Marks(owner, optimizer))
            limit_bytes = _agree_limit(meter.limit_bytes)
            meter.warm_up()
            search = _Search(trainer, meter, start=start, multiple_of=multiple_of,
                             ceiling=ceiling, limit_bytes=limit_bytes,
                             traced_only=planned is not None)
            attempts = search.run(on_step, should_stop)
            limit_bytes = search.limit_bytes
    except BaseException as error:  # its traceback (kept by IPython) must not keep them alive
        _memory.drop_own_frames(error)
        raise
    finally:
        failed = restore_home(home_state, model if moved else None, home, guard)
        home_state = state = trainer = step = None  # the traceback keeps this frame
        if search is not None:
            search.trainer = None
        _memory.free_memory(device)
        if failed is not None:
            raise failed
    report = _report(attempts, device, budget_bytes, limit_bytes, meter.baseline_bytes, amp,
                     max_batch_size, ceiling, multiple_of, headroom, search,
                     getattr(make_batch_fn, "description", ""))
    if notes:
        report = dataclasses.replace(report, method=" ".join([report.method, *notes]))
    if planned is not None:
        return _planned(report, search, *planned)
    rows = []
    if search.model is not None and limit_bytes is not None:
        modules = ({name: type(module).__name__ for name, module in owner.named_modules() if name}
                   if owner is not None else {})
        # On CUDA the tensors' bytes are not what runs out: the boundary found says where, in
        # tensor bytes, the reserved memory ran out, and the rows are predicted against that.
        row_limit = (search.model.peak_bytes(report.max_batch_size)
                     if search.replays and report.max_batch_size
                     else limit_bytes - search.overhead_bytes)
        rows += _what_if.predicted(search.model, row_limit, multiple_of=multiple_of,
                                   ceiling=ceiling, modules=modules)
        if search.replays:  # the allocator's segments and rounding gone: tensors and workspaces
            rows += _what_if.expandable(search.model, limit_bytes - search.unseen_bytes,
                                        report.max_batch_size, multiple_of=multiple_of,
                                        ceiling=ceiling)
    if what_if and is_module:
        probe = functools.partial(
            find_batch, model, make_batch, loss_fn=loss_fn, optimizer=optimizer, device=device,
            budget=budget, amp=amp, max_batch_size=max_batch_size, multiple_of=multiple_of,
            headroom=headroom, scheduler=scheduler, scaler=scaler,
            steps_per_trial=steps_per_trial, start=start, should_stop=should_stop)
        rows += _what_if.measured(probe, optimizer, amp)
    return dataclasses.replace(report, what_if=tuple(rows)) if rows else report


def _frontier(model: Any, make_batch: Any, seq_len: Sequence[int],
              **options: Any) -> BatchSizeReport:
    """find_batch at each sequence length; the longest length's report, with the frontier."""
    lengths = list(seq_len) if not isinstance(seq_len, (int, str)) else None
    if (not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                           for n in lengths)):
        raise ValueError(f"seq_len should be a list of positive ints such as [128, 256, 512], "
                         f"but got seq_len={seq_len!r}.")
    if not callable(make_batch) or isinstance(make_batch, (torch.Tensor, torch.utils.data.Dataset,
                                                           torch.utils.data.DataLoader)):
        raise TypeError(f"make_batch should be a callable make_batch(batch_size, seq_len) with "
                        f"seq_len, but got {type(make_batch).__name__}; write one that builds a "
                        f"batch of that many samples of that length.")
    frontier: dict[int, int] = {}
    report: BatchSizeReport | None = None
    for length in sorted(set(lengths)):
        try:
            report = find_batch(model, functools.partial(_at_length, make_batch, length),
                                **options)
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


def _report(attempts: list[Attempt], device: torch.device, budget_bytes: int | None,
            limit_bytes: int | None, baseline_bytes: int | None, amp: str | None,
            max_batch_size: int | None, ceiling: int, multiple_of: int,
            headroom: float, search: _Search | None = None,
            worst_case: str = "") -> BatchSizeReport:
    lo, hi = _search.bracket(attempts)
    if search is not None and search.stopped:
        stop = "stopped"
    elif lo == 0:
        stop = "nothing fits"
    elif lo >= ceiling:
        stop = "max_batch_size" if max_batch_size else "ceiling"
        if stop == "ceiling" and _memory.memory_stayed_flat(attempts):
            stop = f"ceiling: {_FLAT}"
            warnings.warn(f"find_batch reached its ceiling of {ceiling} samples, but the "
                          f"step's {_FLAT} (it must return a batch of the size it is given), "
                          f"or the step allocates nothing on {device}.", BatchwidgetsWarning,
                          stacklevel=3)
    else:
        stop = "boundary"
    model = search.model if search is not None else None
    segments = () if model is None else model.envelope(
        1, max(a.batch_size for a in attempts))
    report = BatchSizeReport(
        max_batch_size=lo, first_oom_batch_size=hi, attempts=tuple(attempts), device=str(device),
        budget_bytes=budget_bytes, limit_bytes=limit_bytes, baseline_bytes=baseline_bytes,
        memory_model=_search.fit_memory(attempts), headroom=float(headroom),
        multiple_of=multiple_of, amp=amp, stop_reason=stop, peak_segments=segments,
        method=search.method() if search is not None else "", worst_case=worst_case,
        memory_split=search.split if search is not None else None)
    if lo == 0 and stop != "stopped":
        raise NoBatchSizeFits(report)
    return report


def _make_meter(device: torch.device, budget_bytes: int | None) -> Any:
    workspaces = _cuda_sim.simulated_workspaces()
    if device.type == "cpu" and workspaces is not None:  # tests: see _cuda_sim.simulated_cuda
        return _cuda_sim.ProbeMeter(device, budget_bytes, workspaces=workspaces)
    return make_meter(device, budget_bytes)


