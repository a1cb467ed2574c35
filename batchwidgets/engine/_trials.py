"""The probe's trials and its search loop: one size's training steps measured (``_Trainer``),
the per-op model fitted on what ran and the next size asked of the policy (``_Search``), the
memory split, and the prediction for a GPU that is not here (``planned``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..results import Attempt, BatchSizeReport, MemorySplit
from . import _cuda_model, _memory, _search
from ._meters import Reading
from ._state import TrainingState
from ._trace import OpTrace, PeakModel
from ._util import first_line
from .accumulate import _suspended

SEARCH_CEILING = 2**24  # stop doubling here when nothing runs out of memory
OnStep = Callable[[Attempt], None]


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
    return dataclasses.replace(  # the prediction fields are the same on every rank: kept
        attempt, fits=bool(fits),
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
            message = first_line(error)
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
            failed_here = not attempt.fits  # this rank's own outcome
            attempt = _agree(attempt)  # every rank learns from the same outcome
            self._learn(attempt, reading, failed_here)
            self.attempts.append(attempt)
            if on_step is not None:
                on_step(self.attempts[-1])
        return self.attempts

    def _wants_trace(self) -> bool:
        """CPU: always (the tracker sees every op anyway). CUDA: only to fit or refit the model,
        since tracing slows the step and the sizes near the boundary are timed."""
        return self.meter.device.type != "cuda" or len(self.traces) < 2 or (
            bool(self.attempts) and self.attempts[-1].predicted_fits is not None
            and self.attempts[-1].predicted_fits != self.attempts[-1].fits)

    def _learn(self, attempt: Attempt, reading: Reading, failed_here: bool) -> None:
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
        elif (failed_here and not self.replays and reading.live_bytes is not None
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
