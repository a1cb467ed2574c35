"""The probe's trials: the step each size runs (the model form's training step, or the user's
own), the state each trial starts from, and one size's steps measured (``Trainer``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ...results import Attempt
from .. import memory
from .._batches import forward
from .._called import calling, describe, own_steps, said, scalar_hint, was_called
from .._state import TrainingState, optimizers_within
from .._util import first_line, to_device
from ..memory import Reading
from ._ranks import (
    RankFailed,
    after_backward,
    end_of_step,
    made_on_every_rank,
    no_reducer,
    ran_out_alone,
)

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16}  # amp= as autocast's dtype


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


def touched_tensors(touches: tuple) -> list:
    """What the other objects a step names hold (a %%find_batch cell's: an EMA copy, a second
    optimizer), counted in the budget as the model's are."""
    tensors: list = []
    for other in touches:
        if isinstance(other, torch.nn.Module):
            tensors += state_tensors(other, None)
        elif isinstance(other, torch.optim.Optimizer):
            tensors += state_tensors(None, other)
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

# NOTE [ A size holds when the allocator's layout repeats ]
# On a caching allocator (CUDA, and the simulated device) a step can fit where a later one does not:
# it starts where the last left the segments, split and partly filled, and may need a new segment
# there (NOTE [ The allocator's steady state ] in memory/_allocator.py, which plans replay). On the
# H200 the probe answered 644 for a wide CNN whose boundary a longer run keeps at 641, and 1,297 for
# 1,281 (benchmarks/results/gpu_truth_h200.md): two steps fitted, a later one did not. So a real
# trial on such a device also goes on, past ``steps_per_trial`` and up to memory.STEADY_STEPS steps
# in all (as many as a plan's replay runs), until a step leaves the allocator's layout as one of the
# trial's steps found it (``meter.layout()``: the free blocks; on CUDA the counters of reserved,
# allocated, segments and free splits): from there the steps repeat, the loop's steady state (a loop
# whose batch and loss live across steps can alternate between two layouts; the simulated device's
# small pool does), and every state of it has fitted. A layout that repeats after the first step
# costs no step more; a step that left live memory and the layout as it found them ends the trial
# (above). Not for fake trials (a plan replays its steady step), nor inside a job, whose ranks must
# take the same number of steps.


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
                 around: Callable[[], Any] = nullcontext, *, fake: bool = False,
                 called: str = "") -> None:
        """``state.restore()`` after each trial; ``around()`` is entered under the meter (the
        fake trials' FakeTensorMode: see NOTE [ Fake trials ] in _fake.py), ``fake`` says so.
        ``called``: what the step is to a user whose error it raises (``"step"``, a step of
        their own), where the step does not say it (NOTE [ The user's error, said in our words
        first ] in engine/_called.py)."""
        self.step, self.meter, self.state = step, meter, state
        self.steps_per_trial, self.tracked, self.marks = steps_per_trial, tracked, marks
        self.around, self.fake, self.called = around, fake, called

    def _steps(self, batch_size: int, in_job: bool) -> float | None:
        """The trial's steps; the loop's variables let go at its end (``release``)."""
        seconds = None
        steady = not (self.fake or in_job)  # NOTE [ A size holds when the allocator's layout
        # repeats ]
        layouts: set[tuple] = set()  # where the trial's steps started
        layout = self.meter.layout() if steady else None  # where the next step starts
        try:
            for done in itertools.count(1):
                before = self.meter.live_bytes()
                if layout is not None:
                    layouts.add(layout)
                self.meter.start_step()
                self.meter.synchronize()
                started = time.perf_counter()
                try:
                    with (calling(lambda: f"{self.called}({batch_size})") if self.called
                          else nullcontext()):
                        self.step(batch_size)
                except BaseException as error:  # NOTE [ A rank that runs out alone ]
                    if in_job:
                        ran_out_alone(error)
                    raise
                self.meter.synchronize()
                seconds = time.perf_counter() - started
                if in_job:
                    end_of_step()
                self.marks.after_step(self.meter)
                layout = self.meter.layout() if steady else None
                settled = layout is None or layout in layouts
                if self.meter.live_bytes() == before and not in_job and settled:
                    break  # see NOTE [ A second step only when the first left state behind ]
                if done >= (self.steps_per_trial if settled
                            else max(memory.STEADY_STEPS, self.steps_per_trial)):
                    break
        finally:
            release = getattr(self.step, "release", None)
            if release is not None:  # NOTE [ The loop the step models ]: inside the meter
                release()
        return seconds

    def attempt(self, batch_size: int, trace: bool = True) -> tuple[Attempt, Reading]:
        oom = False
        in_job = getattr(self.meter, "defer_budget", False)
        try:
            with self.around(), self.meter.measure(self.tracked, trace=trace) as reading, \
                    self.marks.trial(self.meter), own_steps():  # not a user's micro-step
                seconds = self._steps(batch_size, in_job)
                if in_job:  # every rank ran as many steps (NOTE [ Over the budget inside a job ])
                    self.meter.end_trial()
        except BaseException as error:  # OOM is data; the user's errors said in our words
            if not (memory.is_oom(error, self.meter.device)
                    or (batch_size == 1 and memory.cannot_train_alone(error))):
                if not was_called(error) or isinstance(error, RankFailed):  # another rank's
                    raise
                new = said(error, "find_batch", batch_size, self.fake)
                if new is error:
                    raise
                raise new from error
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


# NOTE [ The loop the step models ]
# The loop users write keeps the model's output and the loss in its variables: `outputs =
# model(**batch); loss = outputs.loss; loss.backward(); optimizer.step()` (Hugging Face's manual
# loop), `out = model(x); loss = loss_fn(out, y); ...`. They stay alive through backward and the
# optimizer step, and until the next step's forward has returned (the loop rebinds `outputs`
# only then). For a language model the logits are often the step's largest tensor, and a probe
# whose step dropped them before backward answered a batch that ran out in the user's loop
# (a GPT-2 at 512 MiB: 6 against the loop's 4). So the model form's step keeps them as those
# variables do (``keep_output=True``, the default): held from its forward on, and let go only
# once the next step's forward and loss are computed; the batch through the step too, until the
# next step begins (``for batch in loader`` rebinds it to the loader's next one, on the host,
# before ``.to(device)``). The Trainer lets the last step's go at the end of the trial, inside
# the meter. A trial whose first step left the output alive runs a
# second step (NOTE [ A second step only when the first left state behind ]), which starts with
# it: the steady state of the loop, whose peak is never below the dropped-output loop's, and
# the trace holds it (the per-op model, the allocator's steady replay, a rank's share).
# ``keep_output=False`` drops the output (and the batch) before backward: the Trainer's
# compute_loss, and loops that `del` it. The meter files what is held as the trace's "output"
# part, from which the report predicts the other loop's answer (a what-if row).
class ModelStep:
    """The model form's step(batch_size): a batch, forward and loss (under autocast with
    ``amp``), backward, the optimizer's step (through ``scaler`` when there is one), the output
    and loss kept as a loop keeps them with ``keep_output`` (NOTE [ The loop the step models ]).
    ``call`` runs the model (default ``model``). ``loss_from`` says where the loss came from."""

    def __init__(self, model: torch.nn.Module, make: Callable[[int], Any],
                 loss_fn: Callable | None, optimizer: torch.optim.Optimizer,
                 device: torch.device, amp: str | None, scaler: Any, meter: Any,
                 call: Callable | None = None, *, keep_output: bool) -> None:
        self.model, self.make, self.loss_fn, self.optimizer = model, make, loss_fn, optimizer
        self.device, self.scaler, self.meter, self.call = device, scaler, meter, call
        self.dtype = AMP_DTYPES.get(amp) if amp else None
        self.keep_output = keep_output
        self.batch: Any = None  # the last step's batch, as the loop's variable holds it
        self.held: tuple | None = None  # the last step's (output, loss): the loop's variables
        self.loss_from = ""

    def __call__(self, batch_size: int) -> None:
        model, meter, optimizer, scaler = self.model, self.meter, self.optimizer, self.scaler
        model.train()  # each trial starts from the user's modes, restored after the last one
        self.batch = None  # `for batch in loader` rebinds it, then moves it to the device
        with meter.making_batch(), calling(lambda: f"make_batch({batch_size})"):
            batch = made_on_every_rank(lambda: to_device(self.make(batch_size), self.device),
                                       meter.defer_budget)  # real steps in a job
        self.batch = batch if self.keep_output else None
        # in a job, DDP's reducer waits: NOTE [ A rank that runs out alone ] in _ranks.py
        with no_reducer(model if meter.defer_budget else None):
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype is not None):
                output, loss, self.loss_from = forward(model, batch, self.loss_fn,
                                                       call=self.call)
            self.held = None  # `outputs` and `loss` rebound once the forward has returned
            if self.keep_output:
                self.held = (output, loss)
                meter.hold((batch, output, loss))
            del batch, output
            what = f"loss.backward() on {describe(loss)} from {self.loss_from}"
            hint = scalar_hint(loss)
            with calling(lambda: what, lambda error: hint):
                (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        if meter.defer_budget:
            after_backward(model)
        meter.end_forward_backward()  # see NOTE [ Two phases ] in memory/_meters.py
        with calling(lambda: f"optimizer.step() ({type(optimizer).__name__})"):
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def release(self) -> None:
        """The trial's end: the loop's variables go."""
        self.batch = self.held = None


def model_step(model: torch.nn.Module, make: Callable[[int], Any], loss_fn: Callable | None,
               optimizer: torch.optim.Optimizer, device: torch.device, amp: str | None,
               scaler: Any, meter: Any, call: Callable | None = None, *,
               keep_output: bool) -> ModelStep:
    """The model form's step (``ModelStep``)."""
    return ModelStep(model, make, loss_fn, optimizer, device, amp, scaler, meter, call,
                     keep_output=keep_output)
