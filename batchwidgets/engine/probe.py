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
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Union

import torch

from .._warnings import BatchwidgetsWarning
from ..results import Attempt, BatchSizeReport, MemorySplit
from . import _cuda_model, _cuda_sim, _memory, _search, _what_if
from ._batches import as_batch_maker, forward_and_loss, to_device
from ._meters import Reading, make_meter
from ._state import InterruptGuard, TrainingState, restore_home
from ._trace import OpTrace, PeakModel
from .accumulate import _suspended

Step = Callable[[int], Any]
OnStep = Callable[[Attempt], None]
MakeBatch = Union[Callable[[int], Any], torch.utils.data.Dataset, torch.utils.data.DataLoader,
                  torch.Tensor]

_FLAT = "memory did not grow with the batch size: check make_batch"
SEARCH_CEILING = 2**24  # stop doubling here when nothing runs out of memory
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


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo;
    True where that cannot be read (no warning then)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return True
    return not flags or any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _notes(owner: torch.nn.Module | None, device: torch.device, amp: str | None) -> list[str]:
    """What the user should know about what was probed, said in the report (and warned)."""
    notes = []
    if owner is not None and hasattr(owner, "_orig_mod"):  # torch.compile's OptimizedModule
        notes.append("The model is torch.compile'd: the probe ran it as compiled on this device, "
                     "but a compiled step's memory can change after recompilation (new shapes): "
                     "probe again at the size you train with.")
    if amp == "bf16" and device.type == "cpu" and not _cpu_has_bf16():
        notes.append("amp='bf16' on a CPU without bf16 instructions (no avx512_bf16 or "
                     "amx_bf16): the memory is right, but each step runs several times slower "
                     "than float32, so step times do not rank throughput.")
    if owner is not None and any(p.grad is not None for p in owner.parameters()):
        notes.append("The model held gradients from an earlier backward: the first step at each "
                     "size accumulated into them and its zero_grad freed them, as in a loop that "
                     "zeroes its gradients; the answer is for that loop.")
    for note in notes[:2]:  # the gradients note is information, not a warning
        warnings.warn(note, BatchwidgetsWarning, stacklevel=3)
    return notes


def _check_step(model: Any, make_batch: Any, step: Any, seq_len: Any) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be the torch.nn.Module that step trains, when step= is "
                        f"given, but got model={model!r}; call find_batch(model, step=my_step, "
                        f"optimizer=optimizer), or find_batch(my_step) without a model.")
    if not callable(step):
        raise TypeError(f"step should be a step(batch_size) function, but got step={step!r}.")
    if make_batch is not None or seq_len is not None:
        raise TypeError("make_batch and seq_len should be left out with step=: the step makes its "
                        "own batches; call find_batch(model, step=my_step, optimizer=optimizer).")
    return model


def _check_arguments(model: Any, make_batch: Any, amp: str | None, max_batch_size: int | None,
                     multiple_of: int, headroom: float, steps_per_trial: int,
                     start: int | None, optimizer: Any = None) -> None:
    if isinstance(model, type):
        raise TypeError(f"model should be a model instance or a step(batch_size) function, but "
                        f"got model={model.__name__} (a class); create it first, e.g. "
                        f"find_batch({model.__name__}(), ...).")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError(f"model should be a torch.nn.Module or a step(batch_size) callable, "
                        f"but got model={model!r}.")
    if isinstance(model, torch.nn.Module) and make_batch is None:
        raise TypeError("make_batch is required with a model: pass make_batch(batch_size) -> "
                        "batch, a Dataset, a DataLoader or one example tensor, e.g. "
                        "find_batch(model, torch.randn(3, 32, 32)).")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        name = optimizer.title() if isinstance(optimizer, str) else "Adam"
        name = name if hasattr(torch.optim, name) else "Adam"
        raise TypeError(f"optimizer should be a torch.optim.Optimizer, but got "
                        f"optimizer={optimizer!r}; create it first, e.g. "
                        f"optimizer=torch.optim.{name}(model.parameters()).")
    if amp is not None and amp not in _AMP:
        raise ValueError(f"amp should be one of {sorted(_AMP)} or None, but got amp={amp!r}.")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of should be a positive int, but got "
                         f"multiple_of={multiple_of!r}; use e.g. multiple_of=8 for tensor cores.")
    if max_batch_size is not None and (not isinstance(max_batch_size, int)
                                       or max_batch_size < multiple_of):
        raise ValueError(f"max_batch_size should be an int >= multiple_of ({multiple_of}), but "
                         f"got max_batch_size={max_batch_size!r}; raise it or lower multiple_of.")
    if not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ValueError(f"headroom should be in (0, 1], but got headroom={headroom!r}; use "
                         f"e.g. 0.9 to keep 10% of the memory free.")
    if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial should be an int >= 1, but got "
                         f"steps_per_trial={steps_per_trial!r}.")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1
                              or start % multiple_of):
        raise ValueError(f"start should be a positive multiple of multiple_of ({multiple_of}), "
                         f"but got start={start!r}.")
    if start is not None and max_batch_size is not None and start > max_batch_size:
        raise ValueError(f"max_batch_size should be >= start ({start}), but got "
                         f"max_batch_size={max_batch_size!r}; raise max_batch_size or lower start.")


def _resolve_device(model: Any, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return _memory.usable_device(device)
    if isinstance(model, torch.nn.Module):
        first = next(model.parameters(), None)
        if first is not None:
            return first.device
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# NOTE [ Why the probe starts at 2 ]
# Batch size 1 is a special case for many models: BatchNorm cannot train on one sample, and
# reductions over the batch, squeezes and kernel choices make its memory fall off the line that
# larger sizes lie on, so a fit through it misleads the jump. Starting at 2 (as Lightning's tuner
# does) costs nothing when 2 fits; when it does not, the search halves down to 1.


def _state_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list:
    tensors: list = []
    if model is not None:
        tensors += [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:  # a bare step's weights count too (the tracker counts each once)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += params + [p.grad for p in params if p.grad is not None]
        tensors += [dict(s) for s in optimizer.state.values()]
    return tensors


def _collective_device() -> torch.device | None:
    """Where all_reduce tensors live (CUDA for NCCL, else the CPU); None when not distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(attempt: Attempt) -> Attempt:
    """Under torch.distributed, one outcome for all ranks: fits only if it fit everywhere, and
    the largest memory and time of any rank, so every rank takes the same next step."""
    device = _collective_device()
    if device is None:
        return attempt
    values = [attempt.peak_memory_bytes, attempt.peak_reserved_bytes,
              attempt.activation_peak_bytes, attempt.step_time_s]
    # MIN of (fits, -x) is (fits everywhere, -max x); -1 stands for "not measured" (None).
    flat = torch.tensor([float(attempt.fits)] + [-(v if v is not None else -1) for v in values],
                        dtype=torch.float64, device=device)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MIN)
    fits, peak, reserved, activation, seconds = flat.tolist()
    unmeasured = 1.0
    return Attempt(
        batch_size=attempt.batch_size, fits=bool(fits),
        peak_memory_bytes=None if peak == unmeasured else int(-peak),
        peak_reserved_bytes=None if reserved == unmeasured else int(-reserved),
        step_time_s=None if seconds == unmeasured or not fits else -seconds,
        activation_peak_bytes=None if activation == unmeasured else int(-activation),
        error=attempt.error or ("" if fits else "out of memory on another rank"))


def _agree_limit(limit_bytes: int | None) -> int | None:
    device = _collective_device()
    if device is None:
        return limit_bytes  # every rank takes part below, with or without a limit of its own
    value = torch.tensor([float("inf") if limit_bytes is None else float(limit_bytes)],
                         dtype=torch.float64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return None if value.item() == float("inf") else int(value.item())


# NOTE [ A second step only when the first left state behind ]
# Adam and SGD with momentum make their state on the first step, and the second step's peak
# includes it, so a trial that stopped after one step would read too little. Gradients the user
# had before the probe are freed by the first step's zero_grad, so the second starts from another
# state too. But a step that leaves memory exactly as it found it (SGD without momentum, a bare
# step whose optimizer state exists already) would only repeat itself: the trial stops after it.
# So each size costs one step, or two where the second can differ, up to ``steps_per_trial``.


class _Marks:
    """Files the step's storages for the memory split (NOTE [ Where the memory goes ] in
    _meters.py): parameters and buffers, gradients as they accumulate, optimizer state."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.params = [] if model is None else [*model.parameters(), *model.buffers()]
        if optimizer is not None:
            self.params += [p for group in optimizer.param_groups for p in group["params"]]

    @contextmanager
    def trial(self, meter: Any) -> Iterator[None]:
        meter.mark(self.params, "parameter")
        self.after_step(meter)
        hooks = [p.register_post_accumulate_grad_hook(
                     lambda p: meter.mark(p.grad, "gradient"))
                 for p in self.params if isinstance(p, torch.nn.Parameter) and p.requires_grad]
        try:
            with meter.saving_activations():
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def after_step(self, meter: Any) -> None:
        meter.mark([p.grad for p in self.params if p.grad is not None], "gradient")
        if self.optimizer is not None:
            meter.mark([dict(state) for state in self.optimizer.state.values()], "optimizer")


class _Trainer:
    """Runs up to ``steps_per_trial`` training steps at one batch size and measures them."""

    def __init__(self, step: Callable[[int], None], meter: Any, state: TrainingState,
                 steps_per_trial: int, tracked: Callable[[], list], marks: _Marks) -> None:
        self.step, self.meter, self.state = step, meter, state
        self.steps_per_trial, self.tracked, self.marks = steps_per_trial, tracked, marks

    def attempt(self, batch_size: int, trace: bool = True) -> tuple[Attempt, Reading]:
        seconds, oom = None, False
        try:
            with self.meter.measure(self.tracked, trace=trace) as reading, \
                    self.marks.trial(self.meter), _suspended():  # not a user's micro-step
                for _ in range(self.steps_per_trial):
                    before = self.meter.live_bytes()
                    self.meter.start_step()
                    self.meter.synchronize()
                    started = time.perf_counter()
                    self.step(batch_size)
                    self.meter.synchronize()
                    seconds = time.perf_counter() - started
                    self.marks.after_step(self.meter)
                    if self.meter.live_bytes() == before:
                        break  # see NOTE [ A second step only when the first left state behind ]
        except BaseException as error:  # OOM is data; everything else goes to the user as is
            if not (_memory.is_oom(error, self.meter.device)
                    or (batch_size == 1 and _memory.cannot_train_alone(error))):
                raise
            oom = True
            message = _memory.first_line(error)
            budget_error = isinstance(error, _memory.BudgetExceededError)
            _memory.forget(error)
            del error
            attempt = Attempt(batch_size, False, reading.peak_bytes or None, None,
                              reading.peak_reserved_bytes, reading.activation_peak_bytes,
                              error=message)
            if budget_error:
                reading.live_bytes = None  # the budget's own limit, not a lower real one
            return attempt, reading
        finally:
            self.state.restore()
            # A full gc.collect() costs ~0.2 s with torch loaded; only an out-of-memory error
            # leaves cycles (its traceback) holding tensors. A clean step's are freed already.
            _memory.free_memory(self.meter.device, collect=oom)
            if hasattr(self.meter, "empty_cache"):  # the simulated CUDA device
                self.meter.empty_cache()
        return Attempt(batch_size, True, reading.peak_bytes, seconds, reading.peak_reserved_bytes,
                       reading.activation_peak_bytes), reading


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


def find_batch(model: torch.nn.Module | Step, make_batch: MakeBatch | None = None,
               loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
               device: torch.device | str | None = None, budget: int | str | None = None,
               amp: str | None = None, max_batch_size: int | None = None, multiple_of: int = 1,
               headroom: float = 0.9, *, scheduler: Any = None, scaler: Any = None,
               steps_per_trial: int = 2, start: int | None = None,
               on_step: OnStep | None = None,
               should_stop: Callable[[], bool] | None = None,
               seq_len: Sequence[int] | None = None,
               what_if: bool = False, target: str | int | None = None,
               step: Step | None = None) -> BatchSizeReport:
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
    scheduler, scaler : optional
        Restored afterwards; ``scaler`` is used for the steps.
    steps_per_trial : int
        Training steps run at each size.
    start : int, optional
        First size tried (default 2, or ``multiple_of`` when larger); if it does not fit, the
        probe halves down to ``multiple_of``.
    on_step : callable, optional
        Called with each ``Attempt`` as it finishes (progress for front ends).
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


# NOTE [ Planning for a GPU that is not here ]
# find_batch(..., target="T4") runs the step at two small sizes on the CPU, through the simulated
# CUDA device (_cuda_sim.py: the caching allocator's rules, cuBLAS's workspace as the target
# makes it, cuDNN-like convolution workspaces), and replays the trace, scaled to each size,
# through the allocator's model under the target's memory less the CUDA context
# (_cuda_model.largest_batch_size). That is the answer, marked predicted. The band's high end is
# the same replay with the tensors alone (no convolution workspaces). What the CPU cannot show:
# CUDA attention kernels (flash, memory-efficient) keep less than the CPU's math path, so for
# attention-heavy models the prediction errs low; cuDNN may pick algorithms with larger
# workspaces than the simulated ones when memory is free. benchmarks/results records the
# prediction beside real boundaries where a GPU was lent.
def _planned(report: BatchSizeReport, search: _Search, name: str,
             usable_bytes: int) -> BatchSizeReport:
    pair = search._event_pair()
    if pair is None:
        raise RuntimeError(f"find_batch could not trace two sizes of the same op sequence on the "
                           f"CPU to predict for {name} (sizes tried: "
                           f"{[a.batch_size for a in report.attempts]}); the step's shapes depend "
                           f"on its data. Probe on a GPU instead.")
    (small, b_small), (large, b_large) = pair
    predict = functools.partial(_cuda_model.largest_batch_size, multiple_of=report.multiple_of,
                                ceiling=SEARCH_CEILING, preallocated=large.preallocated)
    low = predict(small.events, b_small, large.events, b_large, usable_bytes)
    tensors_only = [[e for e in t.events if e[0] != "workspace"] for t in (small, large)]
    high = predict(tensors_only[0], b_small, tensors_only[1], b_large, usable_bytes)
    return dataclasses.replace(
        report, max_batch_size=low, first_oom_batch_size=None, limit_bytes=usable_bytes,
        budget_bytes=None, stop_reason=f"predicted for {name}: not run", target=name,
        target_band=(low, max(low, high)),
        method=report.method.replace("then verified", "then replayed for the target"))


def _make_meter(device: torch.device, budget_bytes: int | None) -> Any:
    workspaces = _cuda_sim.simulated_workspaces()
    if device.type == "cpu" and workspaces is not None:  # tests: see _cuda_sim.simulated_cuda
        return _cuda_sim.ProbeMeter(device, budget_bytes, workspaces=workspaces)
    return make_meter(device, budget_bytes)


def _memory_split(batch_size: int, trace: OpTrace, parts: dict[str, int],
                  modules: dict[str, int], peak: int) -> MemorySplit:
    by_module = dict(sorted(modules.items(), key=lambda item: -item[1]))
    return MemorySplit(
        batch_size=batch_size, parameters_bytes=parts.get("parameter", 0),
        gradients_bytes=parts.get("gradient", 0), optimizer_bytes=parts.get("optimizer", 0),
        activations_bytes=parts.get("activation", 0),
        temporaries_bytes=parts.get("temporary", 0), by_module=by_module,
        where=f"{trace.where[peak]} ({trace.names[peak]})")


class _Search:
    """The probe's loop: fit the per-op model on what ran, ask the policy for the next size, run
    it (see NOTE [ Predict, then verify ] in _search.py)."""

    def __init__(self, trainer: _Trainer, meter: Any, *, start: int, multiple_of: int,
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
        self.traced_only = traced_only  # stop once two sizes are traced (target=)
        self.split: MemorySplit | None = None  # at the largest size that ran with a trace

    def run(self, on_step: OnStep | None, should_stop: Callable[[], bool] | None) -> list[Attempt]:
        while True:
            if should_stop is not None and should_stop():
                self.stopped = True
                break
            predicted = self._predicted()
            size = _search.next_batch_size(
                self.attempts, start=self.start, multiple_of=self.multiple_of,
                ceiling=self.ceiling, limit_bytes=self.limit_bytes, predicted=predicted)
            if size is None or (self.traced_only and self._event_pair() is not None):
                break
            attempt, reading = self.trainer.attempt(size, trace=self._wants_trace())
            if predicted is not None:
                attempt = dataclasses.replace(attempt, predicted_peak_bytes=self._predicted_peak(
                    size), predicted_fits=size <= predicted)
            self._learn(attempt, reading)
            self.attempts.append(_agree(attempt))
            if on_step is not None:
                on_step(self.attempts[-1])
        return self.attempts

    def _wants_trace(self) -> bool:
        """CPU: always (the tracker sees every op anyway). CUDA: only to fit or refit the model,
        since tracing slows the step and the sizes near the boundary are timed."""
        return self.meter.device.type != "cuda" or len(self.traces) < 2 or (
            bool(self.attempts) and self.attempts[-1].predicted_fits is not None
            and self.attempts[-1].predicted_fits != self.attempts[-1].fits)

    def _learn(self, attempt: Attempt, reading: Reading) -> None:
        trace = reading.trace
        if attempt.fits and trace is not None and trace.complete:
            self.traces[attempt.batch_size] = trace
            if reading.split is not None and (self.split is None
                                              or attempt.batch_size > self.split.batch_size):
                self.split = _memory_split(attempt.batch_size, trace, *reading.split)
            if reading.peak_reserved_bytes:
                self.overhead_bytes = max(0, reading.peak_reserved_bytes - max(trace.live))
            if self.meter.device.type == "cuda":  # workspaces the tensor trace cannot see
                replayed = _cuda_model.replay(trace.events, preallocated=trace.preallocated)
                self.unseen_bytes = max(0, (reading.peak_reserved_bytes or 0)
                                        - replayed.peak_reserved_bytes)
        elif (not attempt.fits and not self.replays and reading.live_bytes is not None
              and self.limit_bytes is not None and reading.live_bytes < self.limit_bytes):
            # A real allocator failure below the assumed limit (a cgroup, a ulimit, another
            # process): the limit is lower than assumed. Lower it and predict again.
            self.limit_bytes, self._lowered = reading.live_bytes, True
        self.model = self._fit()

    def _fit(self) -> PeakModel | None:
        sizes = sorted(self.traces, reverse=True)[:4]
        for i, large in enumerate(sizes):
            for small in sizes[i + 1:]:
                model = PeakModel.fit(self.traces[small], small, self.traces[large], large)
                if model is not None:
                    return model
        return None

    @property
    def replays(self) -> bool:
        """On CUDA (and the simulated device) what runs out is reserved memory: predictions
        replay the traces through the caching allocator's model (_cuda_model.py)."""
        return self.meter.device.type == "cuda" or getattr(self.meter, "allocator_model", False)

    def _event_pair(self) -> tuple[tuple[OpTrace, int], tuple[OpTrace, int]] | None:
        sizes = sorted(self.traces, reverse=True)[:4]
        for i, large in enumerate(sizes):
            for small in sizes[i + 1:]:
                a, b = self.traces[small], self.traces[large]
                if _cuda_model.scale_events(a.events, small, b.events, large, small) is not None:
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
            return _cuda_model.largest_batch_size(
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
                events = _cuda_model.scale_events(small.events, b_small, large.events, b_large,
                                                  size)
                return (_cuda_model.replay(events, preallocated=large.preallocated)
                        .peak_reserved_bytes + self.unseen_bytes)
        return self.model.peak_bytes(size) + self.overhead_bytes

    def method(self) -> str:
        """How the search went, in a sentence for the report."""
        sizes = sorted(self.traces)
        lowered = (" The memory limit was lowered to the live bytes of a real allocator "
                   "failure." if self._lowered else "")
        if _search.misses(self.attempts) >= _search.MAX_MISSES:
            return ("per-op model missed twice (memory not affine in the batch size here); "
                    "finished by bisection." + lowered)
        if self.model is not None:
            replay = (" replayed through the CUDA caching allocator's model" if self.replays
                      else "")
            return (f"per-op model fitted on sizes {self.model.batch_small} and "
                    f"{self.model.batch_large} ({len(self.model.large.names)} ops){replay}, "
                    f"then verified." + lowered)
        if len(sizes) >= 2:
            return (f"op sequences differ between sizes {sizes[-2]} and {sizes[-1]} "
                    f"(data-dependent shapes or unpadded lengths?): no per-op model, searched "
                    f"by measured peaks." + lowered)
        return "searched by measured peaks." + lowered
