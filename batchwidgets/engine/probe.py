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

import time
import warnings
from collections.abc import Callable
from typing import Any, Union

import torch

from .._warnings import BatchwidgetsWarning
from ..results import Attempt, BatchSizeReport
from . import _memory, _search
from ._batches import as_batch_maker, forward_and_loss, to_device
from ._meters import make_meter
from ._state import InterruptGuard, TrainingState, restore_home

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
    if optimizer is not None:
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


class _Trainer:
    """Runs ``steps_per_trial`` training steps at one batch size and measures them."""

    def __init__(self, step: Callable[[int], None], meter: Any, state: TrainingState,
                 steps_per_trial: int, tracked: Callable[[], list]) -> None:
        self.step, self.meter, self.state = step, meter, state
        self.steps_per_trial, self.tracked = steps_per_trial, tracked

    def attempt(self, batch_size: int) -> Attempt:
        seconds, oom = None, False
        try:
            with self.meter.measure(self.tracked()) as reading:
                for _ in range(self.steps_per_trial):
                    self.meter.synchronize()
                    started = time.perf_counter()
                    self.step(batch_size)
                    self.meter.synchronize()
                    seconds = time.perf_counter() - started
        except BaseException as error:  # OOM is data; everything else goes to the user as is
            if not (_memory.is_oom(error, self.meter.device)
                    or (batch_size == 1 and _memory.cannot_train_alone(error))):
                raise
            oom = True
            message = _memory.first_line(error)
            _memory.forget(error)
            del error
            return Attempt(batch_size, False, reading.peak_bytes or None, None,
                           reading.peak_reserved_bytes, reading.activation_peak_bytes,
                           error=message)
        finally:
            self.state.restore()
            # A full gc.collect() costs ~0.2 s with torch loaded; only an out-of-memory error
            # leaves cycles (its traceback) holding tensors. A clean step's are freed already.
            _memory.free_memory(self.meter.device, collect=oom)
        return Attempt(batch_size, True, reading.peak_bytes, seconds, reading.peak_reserved_bytes,
                       reading.activation_peak_bytes)


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
        Default: the output's ``.loss``, the output itself if scalar, else its mean.
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
    (621, 622)
    """
    _check_arguments(model, make_batch, amp, max_batch_size, multiple_of, headroom,
                     steps_per_trial, start, optimizer)
    budget_bytes = _memory.parse_bytes(budget, "budget")
    device = _resolve_device(model, device)
    is_module = isinstance(model, torch.nn.Module)
    if is_module and optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
    ceiling = (max_batch_size or SEARCH_CEILING) // multiple_of * multiple_of
    if start is None:
        start = min(max(multiple_of, 2), ceiling)  # see NOTE [ Why the probe starts at 2 ]

    extras = (scheduler, scaler)
    home_state = TrainingState(model if is_module else None, optimizer, extras)
    moved = is_module and _resolve_device(model, None) != device
    home = _resolve_device(model, None) if is_module else device
    meter = make_meter(device, budget_bytes)
    guard = InterruptGuard()  # see NOTE [ Restoring under Ctrl-C ] in _state.py
    try:
        with meter.capped():
            # each trial starts from this state: the user's, on the device probed
            state = _moved(model, optimizer, device, extras) if moved else home_state
            if is_module:
                if amp == "fp16" and scaler is None:
                    scaler = torch.amp.GradScaler(device.type)
                step = _model_step(model, as_batch_maker(make_batch), loss_fn, optimizer, device,
                                   amp, scaler, meter)
            else:
                step = model
            trainer = _Trainer(step, meter, state, steps_per_trial,
                               lambda: _state_tensors(model if is_module else None, optimizer))
            limit_bytes = _agree_limit(meter.limit_bytes)
            attempts: list[Attempt] = []
            while (size := _search.next_batch_size(
                    attempts, start=start, multiple_of=multiple_of, ceiling=ceiling,
                    limit_bytes=limit_bytes)) is not None:
                attempts.append(_agree(trainer.attempt(size)))
                if on_step is not None:
                    on_step(attempts[-1])
    except BaseException as error:  # its traceback (kept by IPython) must not keep them alive
        _memory.drop_own_frames(error)
        raise
    finally:
        failed = restore_home(home_state, model if moved else None, home, guard)
        home_state = state = trainer = step = None  # the traceback keeps this frame
        _memory.free_memory(device)
        if failed is not None:
            raise failed
    return _report(attempts, device, budget_bytes, limit_bytes, meter.baseline_bytes, amp,
                   max_batch_size, ceiling, multiple_of, headroom)


def _report(attempts: list[Attempt], device: torch.device, budget_bytes: int | None,
            limit_bytes: int | None, baseline_bytes: int | None, amp: str | None,
            max_batch_size: int | None, ceiling: int, multiple_of: int,
            headroom: float) -> BatchSizeReport:
    lo, hi = _search.bracket(attempts)
    if lo == 0:
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
    report = BatchSizeReport(
        max_batch_size=lo, first_oom_batch_size=hi, attempts=tuple(attempts), device=str(device),
        budget_bytes=budget_bytes, limit_bytes=limit_bytes, baseline_bytes=baseline_bytes,
        memory_model=_search.fit_memory(attempts), headroom=float(headroom),
        multiple_of=multiple_of, amp=amp, stop_reason=stop)
    if lo == 0:
        raise NoBatchSizeFits(report)
    return report
