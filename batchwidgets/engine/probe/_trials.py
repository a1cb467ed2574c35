"""The probe's trials: the step each size runs (the model form's training step, or the user's
own), the state each trial starts from, and one size's steps measured (``Trainer``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ...results import Attempt
from .. import memory
from .._batches import forward_and_loss
from .._own_steps import own_steps
from .._state import TrainingState, optimizers_within
from .._util import first_line, to_device
from ..memory import Reading
from ._checks import AMP_DTYPES
from ._ranks import made_on_every_rank

OnStep = Callable[[Attempt], None]


def state_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list:
    tensors: list = []
    if model is not None:
        tensors += [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:  # a bare step's weights count too (the tracker counts each once)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += params + [p.grad for p in params if p.grad is not None]
        tensors += state_values(optimizer)
    return tensors


def state_values(optimizer: Any) -> list[dict]:
    """Each parameter's optimizer state as the tensor walker reads it: a custom object's
    attributes as a dict (its tensors are the state's too); an inner optimizer's too (NOTE
    [ An optimizer inside an optimizer ] in engine/_state.py)."""
    return [{key: vars(value) if hasattr(value, "__dict__") and not isinstance(
                 value, torch.Tensor) else value for key, value in state.items()}
            for inner in optimizers_within(optimizer) for state in inner.state.values()]


# NOTE [ What a wrapper holds outside every op ]
# DistributedDataParallel keeps its gradient buckets from its construction on: with
# gradient_as_bucket_view=False (the default) a second copy of every gradient, which its C++
# reducer fills by copies in place and all-reduces. No op of a step makes them, so the tracker,
# which counts the storages ops make, would never see them, and a probe inside a DDP job would
# find a larger batch than the rank can hold (and than the plan for "ddp" says: NOTE [ Per-rank
# memory by strategy ] in _parallel.py). So a probe counts them from the start of every step, at
# the sizes DDP itself records (its logging data's bucket_sizes). With gradient_as_bucket_view
# the gradients are views of the buckets, counted with the gradients.
def held_outside_ops(owner: torch.nn.Module | None) -> int:
    """The bytes ``owner`` holds that no op of a step shows: DDP's gradient buckets."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(owner, ddp) or getattr(owner, "gradient_as_bucket_view", True):
        return 0
    try:
        sizes = str(owner._get_ddp_logging_data().get("bucket_sizes", ""))
    except Exception:  # a private accessor: torch may move it; the buckets go uncounted
        return 0
    return sum(int(size) for size in sizes.split(",") if size.strip().isdigit())


# NOTE [ A second step only when the first left state behind ]
# Adam and SGD with momentum make their state on the first step, and the second step's peak
# includes it, so a trial that stopped after one step would read too little. Gradients the user
# had before the probe are freed by the first step's zero_grad, so the second starts from another
# state too. But a step that leaves memory exactly as it found it (SGD without momentum, a bare
# step whose optimizer state exists already) would only repeat itself: the trial stops after it.
# So each size costs one step, or two where the second can differ, up to ``steps_per_trial``.


class Marks:
    """Files the step's storages for the memory split (NOTE [ Where the memory goes ] in
    memory/_meters.py): parameters and buffers, gradients as they accumulate, optimizer state."""

    def __init__(self, tensors: list[torch.Tensor], optimizer: Any) -> None:
        """``tensors``: the model's parameters and buffers (the optimizer's are added)."""
        self.optimizer = optimizer
        self.params = list(tensors)
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
            meter.mark(state_values(self.optimizer), "optimizer")


class Trainer:
    """Runs up to ``steps_per_trial`` training steps at one batch size and measures them."""

    def __init__(self, step: Callable[[int], None], meter: Any, state: Any,
                 steps_per_trial: int, tracked: Callable[[], list], marks: Marks,
                 around: Callable[[], Any] = nullcontext) -> None:
        """``state.restore()`` after each trial; ``around()`` is entered under the meter (the
        fake trials' FakeTensorMode: see NOTE [ Fake trials ] in _fake.py)."""
        self.step, self.meter, self.state = step, meter, state
        self.steps_per_trial, self.tracked, self.marks = steps_per_trial, tracked, marks
        self.around = around

    def attempt(self, batch_size: int, trace: bool = True) -> tuple[Attempt, Reading]:
        seconds, oom = None, False
        in_job = getattr(self.meter, "defer_budget", False)
        try:
            with self.around(), self.meter.measure(self.tracked, trace=trace) as reading, \
                    self.marks.trial(self.meter), own_steps():  # not a user's micro-step
                for _ in range(self.steps_per_trial):
                    before = self.meter.live_bytes()
                    self.meter.start_step()
                    self.meter.synchronize()
                    started = time.perf_counter()
                    self.step(batch_size)
                    self.meter.synchronize()
                    seconds = time.perf_counter() - started
                    self.marks.after_step(self.meter)
                    if self.meter.live_bytes() == before and not in_job:
                        break  # see NOTE [ A second step only when the first left state behind ]
                if in_job:  # every rank ran as many steps (NOTE [ Over the budget inside a job ])
                    self.meter.end_trial()
        except BaseException as error:  # OOM is data; everything else goes to the user as is
            if not (memory.is_oom(error, self.meter.device)
                    or (batch_size == 1 and memory.cannot_train_alone(error))):
                raise
            oom = True
            message = first_line(error)
            budget_error = isinstance(error, memory.BudgetExceededError)
            memory.forget(error)
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
            memory.free_memory(self.meter.device, collect=oom)
            if hasattr(self.meter, "empty_cache"):  # the simulated CUDA device
                self.meter.empty_cache()
        return Attempt(batch_size, True, reading.peak_bytes, seconds, reading.peak_reserved_bytes,
                       reading.activation_peak_bytes), reading


def moved(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
          extras: tuple, loss_fn: Callable | None = None) -> TrainingState:
    """Move the model and its optimizer state to ``device``; the state to start each trial from.

    Optimizer state follows its parameter, except ``step`` counters, which PyTorch's optimizers
    keep on the host unless they are capturable or fused.
    """
    model.to(device)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != param.device:
                state[key] = value.to(param.device)
    return TrainingState(model, optimizer, extras, loss_fn=loss_fn)


def model_step(model: torch.nn.Module, make: Callable[[int], Any], loss_fn: Callable | None,
               optimizer: torch.optim.Optimizer, device: torch.device, amp: str | None,
               scaler: Any, meter: Any, call: Callable | None = None) -> Callable[[int], None]:
    """The model form's step(batch_size): a batch, forward and loss (under autocast with
    ``amp``), backward, the optimizer's step (through ``scaler`` when there is one). ``call``
    runs the model (default ``model``)."""
    dtype = AMP_DTYPES.get(amp) if amp else None

    def step(batch_size: int) -> None:
        model.train()  # each trial starts from the user's modes, restored after the last one
        with meter.making_batch():  # see TracingTracker.collapsed
            batch = made_on_every_rank(lambda: to_device(make(batch_size), device),
                                       meter.defer_budget)  # real steps in a job
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = forward_and_loss(model, batch, loss_fn, call=call)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        meter.end_forward_backward()  # see NOTE [ Two phases ] in memory/_meters.py
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
