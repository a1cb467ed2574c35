"""Memory backends for the probe: CUDA reads its caching allocator and caps the process with
``set_per_process_memory_fraction``; CPU and MPS count the live tensor bytes of each step."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .._state import makes_weakref_callbacks
from ._budget import available_memory_bytes
from ._trace import OpTrace, said_at
from ._tracker import TensorMemoryTracker, _Where, unique_tensors

HELD_KEY = -(10**15) - 1  # the held bytes' place in a trace (no storage's key)
# NOTE [ The meters, a long module ]
# Over 400 lines: the tracer's books (lifetimes, kinds, parts) and the two meters that read
# them (CPU tensors, CUDA's allocator) are one interface; the simulated device has its own file.
CPU_DEFAULT_FRACTION = 0.5  # without a budget, the CPU probe may use half of the available RAM


@dataclass
class Reading:
    peak_bytes: int = 0
    peak_reserved_bytes: int | None = None
    activation_peak_bytes: int | None = None  # forward+backward only; see NOTE [ Two phases ]
    trace: OpTrace | None = None  # per op; see NOTE [ Every op's live bytes are affine ... ]
    live_bytes: int | None = None  # live bytes when the trial ended (or failed)
    split: tuple | None = None  # TracingTracker.split_at_peak() of a trial that ran


def _saving_activations(tracker: TracingTracker | None) -> Any:
    """Mark what autograd saves for backward as activations (see NOTE [ Where the memory goes ])."""
    if tracker is None:
        return nullcontext()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        tracker.mark(tensor, "activation")
        # The same storage without its grad_fn: packing the tensor itself would make a cycle
        # (node -> saved output -> its grad_fn -> node) that Python's collector cannot see, and
        # every probed step's activations would outlive it. A tensor with no grad_fn (a weight,
        # the batch) makes none, and is packed as it is: a detach on a fake tensor is an op
        # through both modes, a tenth of a fake Llama step's dispatch time.
        return tensor if tensor.grad_fn is None else tensor.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


class TracingTracker(TensorMemoryTracker):
    """The tensor tracker that also records the step's per-op trace (``self.trace``)."""

    def __init__(self, device: torch.device, budget_bytes: int | None, baseline: list,
                 where: _Where, held_bytes: int = 0, *, defer_budget: bool = False) -> None:
        self.trace: OpTrace | None = None
        super().__init__(device, budget_bytes, baseline, held_bytes, defer_budget=defer_budget)
        self.trace, self._where = OpTrace(kinds=where.modules.kinds), where
        self._op_names: dict[Any, str] = {}  # str(func) once per op overload
        self._batch_peak: int | None = None  # while making the batch; see collapsed()
        # See NOTE [ Where the memory goes ]: storage key -> serial, serial -> lifetime
        self._serials: dict[int, int] = {}
        self.lifetimes: list[list] = []  # [first op, op it was freed at or None, bytes, module]
        self.categories: dict[int, str] = {}  # serial -> parameter, gradient, ...
        self._births: list[tuple[int, int]] = []  # (storage key, serial), in birth order
        # the events' keys -> storage keys, where another meter wrote the events (the
        # simulated device's allocation keys); the tracker's own events use storage keys
        self.storage_of: dict[int, int] = {}
        # (serial, op) of each storage the loop's variables hold from that op on (the output
        # and the loss: NOTE [ The loop the step models ] in probe/_trials.py)
        self.held: list[tuple[int, int]] = []
        for key, (_, nbytes) in self._storages.items():
            self._born(key, nbytes, -1, "")
        self.trace.preallocated = [(key, nbytes) for key, (_, nbytes) in self._storages.items()]
        if held_bytes:  # one storage of its own, alive through the step
            self._born(HELD_KEY, held_bytes, -1, "")
            self.categories[self._serials[HELD_KEY]] = "communication"
            self.trace.preallocated.append((HELD_KEY, held_bytes))

    def _born(self, key: int, nbytes: int, op: int, module: str) -> None:
        self._serials[key] = len(self.lifetimes)
        self._births.append((key, len(self.lifetimes)))
        self.lifetimes.append([op, None, nbytes, module])

    def mark(self, tensors: Any, category: str) -> None:
        """File the storages of ``tensors`` under ``category`` (first mark wins)."""
        for tensor in unique_tensors([tensors]):
            serial = self._serials.get(id(tensor.untyped_storage()))
            if serial is not None:
                self.categories.setdefault(serial, category)

    def hold(self, tensors: Any) -> None:
        """The storages of ``tensors`` are held by the loop's variables from this op on."""
        op = len(self.trace.names)
        for tensor in unique_tensors([tensors]):
            serial = self._serials.get(id(tensor.untyped_storage()))
            if serial is not None:
                self.held.append((serial, op))

    def _output_part(self, n: int) -> list[int]:
        """Per op, the bytes alive only because the loop holds its output and loss: from the
        op they were held at (what autograd saved, from the end of backward, where a loop that
        drops its output would see the graph free them) to their free."""
        delta = [0] * (n + 1)
        where, seen = self.trace.where, set()
        for serial, op in self.held:
            born, freed, nbytes, _ = self.lifetimes[serial]
            if serial in seen or born < 0:
                continue
            seen.add(serial)
            if self.categories.get(serial) == "activation":
                op = next((i for i in range(op, n) if where[i] == "optimizer step"), n)
            end = n if freed is None else min(freed, n)
            if op < end:
                delta[op] += nbytes
                delta[end] -= nbytes
        return list(itertools.accumulate(delta[:n]))

    def record_parts(self, top_modules: int = 8) -> None:
        """Per op, the live bytes of the optimizer state and of the activations saved by each of
        the ``top_modules`` modules that save the most (a sweep over the lifetimes)."""
        n = len(self.trace.live)
        saved: dict[str, int] = {}
        for serial, (_, _, nbytes, module) in enumerate(self.lifetimes):
            if self.categories.get(serial) == "activation":
                saved[module] = saved.get(module, 0) + nbytes
        wanted = {"optimizer": "optimizer"}
        for module in sorted(saved, key=saved.get, reverse=True)[:top_modules]:
            wanted[f"activation of {module}"] = module
        deltas = {part: [0] * (n + 1) for part in wanted}  # one sweep files them all
        parts_of = {module: part for part, module in wanted.items() if part != "optimizer"}
        for serial, (born, freed, nbytes, module) in enumerate(self.lifetimes):
            category = self.categories.get(serial)
            part = "optimizer" if category == "optimizer" else (
                parts_of.get(module) if category == "activation" else None)
            if part is not None:
                delta = deltas[part]
                delta[max(born, 0)] += nbytes
                delta[n if freed is None else min(freed, n)] -= nbytes
        for part, delta in deltas.items():
            self.trace.parts[part] = list(itertools.accumulate(delta[:n]))
        if self.held:
            self.trace.parts["output"] = self._output_part(n)

    def finish(self, reading: Reading) -> None:
        """Hand the trial's trace to ``reading``, with the split and parts of a trial that ran."""
        reading.trace = self.trace
        if self.trace.complete and self.trace.live:
            reading.split = self.split_at_peak()
            self.record_parts()
            self.record_kinds()

    def record_kinds(self) -> None:
        """Each storage's kind in the trace: by serial, by event and by preallocated storage
        (OpTrace.storages); the events may be another meter's (the simulated device's), matched
        to the tracker's births storage by storage in order."""
        trace, where = self.trace, self.trace.where
        kinds = []
        for serial, (born, freed, nbytes, _) in enumerate(self.lifetimes):
            kind = self.categories.get(serial, "temporary")
            if kind == "temporary" and 0 <= born < len(where) and where[born] == "optimizer step":
                kind = "step"
            kinds.append(kind)
            trace.storages.append((born, freed, nbytes, kind))
        born_as: dict[int, list[int]] = {}
        for key, serial in reversed(self._births):
            born_as.setdefault(key, []).append(serial)
        preallocated = {key: serial for key, serial in self._births
                        if self.lifetimes[serial][0] < 0}
        storage_of = self.storage_of
        trace.preallocated_kinds = [kinds[preallocated[storage_of.get(key, key)]]
                                    if storage_of.get(key, key) in preallocated else "temporary"
                                    for key, _ in trace.preallocated]
        for key in preallocated:  # their births are not the events'
            born_as[key].pop()
        for kind, key, _ in trace.events:
            serials = born_as.get(storage_of.get(key, key)) if kind == "alloc" else None
            trace.event_kinds.append(kinds[serials.pop()] if serials else
                                     ("temporary" if kind == "alloc" else ""))

    def split_at_peak(self) -> tuple[dict[str, int], dict[str, int], int]:
        """Bytes by category and activation bytes by module alive after the peak op, and it."""
        peak = max(range(len(self.trace.live)), key=self.trace.live.__getitem__)
        parts: dict[str, int] = {}
        modules: dict[str, int] = {}
        for serial, (born, freed, nbytes, module) in enumerate(self.lifetimes):
            if born <= peak and (freed is None or freed > peak):
                category = self.categories.get(serial, "temporary")
                parts[category] = parts.get(category, 0) + nbytes
                if category == "activation":
                    modules[module] = modules.get(module, 0) + nbytes
        return parts, modules, peak

    @contextmanager
    def collapsed(self) -> Iterator[None]:
        """Record the ops inside as one entry, at their peak: a collate_fn that loops over the
        samples in Python runs more ops for a larger batch, but only the memory it leaves (and
        its peak) matters to the model, so the op sequences of two sizes still match."""
        self._batch_peak = self.live_bytes
        try:
            yield
        finally:
            peak, self._batch_peak = self._batch_peak, None
            self.trace.names.append("making the batch")
            self.trace.live.append(max(peak, self.live_bytes))
            self.trace.where.append("making the batch")

    def _count(self, tensor: torch.Tensor) -> None:
        before = self.live_bytes
        super()._count(tensor)
        if self.trace is not None and self.live_bytes != before:
            storage = tensor.untyped_storage()
            key, nbytes, op = id(storage), storage.nbytes(), len(self.trace.names)
            events, serial = self.trace.events, self._serials.pop(key, None)
            if serial is not None:  # NOTE [ A storage resized in place ]
                self.lifetimes[serial][1] = op
                events.append(("free", key, 0))
                self.trace.event_ops.append(op)
            if nbytes:
                events.append(("alloc", key, nbytes))
                self.trace.event_ops.append(op)
                module = self._where.module() if self._batch_peak is None else "making the batch"
                self._born(key, nbytes, op, module)

    @makes_weakref_callbacks  # see NOTE [ Restoring under Ctrl-C ] in engine/_state.py
    def _release(self, key: int):
        release = super()._release(key)

        def traced(ref) -> None:
            known = self._storages.get(key)
            release(ref)
            if self.trace is not None and known is not None and known[0] is ref and known[1]:
                self.trace.events.append(("free", key, 0))
                self.trace.event_ops.append(len(self.trace.names))
                serial = self._serials.pop(key, None)
                if serial is not None:
                    self.lifetimes[serial][1] = len(self.trace.names)
        return traced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.record_op(func)

    def op_said(self, func: Any) -> str:
        """The op an out-of-memory message names, with the user's module it ran in."""
        where = self._where() if self._batch_peak is None else "making the batch"
        return said_at(where, str(func), self.trace.kinds)

    def record_op(self, func) -> None:
        """The op's entry in the trace (after it ran or raised), or the batch's running peak."""
        if self._batch_peak is not None:
            self._batch_peak = max(self._batch_peak, self.live_bytes)
        elif func is not torch.ops.prim.device.default:  # torch < 2.6 fakes: uneven counts
            trace, name = self.trace, self._op_names.get(func)
            if name is None:
                name = self._op_names[func] = str(func)
            trace.names.append(name)
            trace.live.append(self.live_bytes)
            trace.where.append(self._where())


# NOTE [ Where the memory goes ]
# The tracer gives every storage a lifetime (the op that made it, the op it was freed at, its
# bytes, the module that made it) and a category: the model's parameters and buffers, gradients
# (the .grad of a parameter when backward ends), optimizer state (what optimizer.state holds after
# its step), activations (tensors autograd saved for backward, seen by a saved_tensors_hooks pack
# hook), and temporaries (everything else). The split is read at the op that holds the step's
# peak, so its parts add up to the measured peak.


# NOTE [ A storage resized in place ]
# A storage counted again at another size is the same storage resized: FSDP2's unsharded weights
# go to 0 bytes after each unit runs and back before its next all-gather (NOTE [ FSDP2 frees by
# resizing storages ] in probe/_fakes.py), an out= op grows its output. Its old size's lifetime
# ends there and the new size, if any, is born anew, as the simulated device logs a free and an
# allocation: a lifetime left open counted every unit's gathered weights as activations alive
# at an FSDP2 rank's peak, and a birth of 0 bytes, which the device never logs, took the kind
# of the storage's next allocation.


# NOTE [ Two phases ]
# A training step's peak is max(forward+backward, optimizer step). The second is nearly constant
# in the batch size (gradients, optimizer state and its temporaries), so at small sizes it hides
# the per-sample growth and a line fitted on whole-step peaks predicts nonsense. The model form
# marks the end of backward; the meter keeps that phase's peak apart, and the search fits on it.


@contextmanager
def tracing(tracker: TracingTracker, where: _Where, mode: bool = True) -> Iterator[None]:
    """Run a step under ``tracker`` (``mode=False``: another mode calls it), ``where`` naming the
    module of each op; a step that raises leaves a trace marked incomplete (no prediction is
    fitted through it)."""
    try:
        with where.modules, tracker if mode else nullcontext():
            yield
    except BaseException:
        tracker.trace.complete = False
        raise


class _TracedSteps:
    """The probe's hooks into a meter's ``TracingTracker`` (``self._tracker``, None while no trace
    is recorded) and its ``_Where``: each step's start, the batch's own ops, the split's marks."""

    _tracker: TracingTracker | None = None
    _where: _Where | None = None
    defer_budget = False  # inside a job (NOTE [ Over the budget inside a job ] in _tracker.py)
    held_bytes = 0  # what the step holds outside every op (TensorMemoryTracker's held_bytes)

    def prepare(self, held_bytes: int, *, defer_budget: bool) -> None:
        """Set once before the first trial: what each step holds outside every op (DDP's
        gradient buckets: TensorMemoryTracker's ``held_bytes``), and whether a job's steps run
        to their end over the budget (NOTE [ Over the budget inside a job ] in _tracker.py)."""
        self.held_bytes, self.defer_budget = held_bytes, defer_budget

    def end_trial(self) -> None:
        """Raise the out-of-memory error a job's steps held back until they ended."""
        if self._tracker is not None:
            self._tracker.raise_if_over_budget()

    def start_step(self) -> None:
        if self._where is not None:
            self._where.optimizer_phase = False

    def making_batch(self) -> Any:
        return self._tracker.collapsed() if self._tracker is not None else nullcontext()

    def mark(self, tensors: Any, category: str) -> None:
        if self._tracker is not None:
            self._tracker.mark(tensors, category)

    def saving_activations(self) -> Any:
        return _saving_activations(self._tracker)

    def hold(self, tensors: Any) -> None:
        """What the loop's variables hold after the forward (TracingTracker.hold)."""
        if self._tracker is not None:
            self._tracker.hold(tensors)


class TensorMeter(_TracedSteps):
    """Counts tensor storages on the device; the budget is enforced op by op."""

    def __init__(self, device: torch.device, budget_bytes: int | None) -> None:
        self.device = device
        self.limit_bytes = budget_bytes if budget_bytes is not None else self._default_limit()
        self.baseline_bytes: int | None = None
        self._tracker: TensorMemoryTracker | None = None
        self._reading = Reading()

    def _default_limit(self) -> int | None:
        if self.device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
            return int(torch.mps.recommended_max_memory())
        available = available_memory_bytes()  # cgroup and ulimit included
        if available is None and hasattr(os, "sysconf"):
            try:
                available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                available = None
        return None if available is None else int(CPU_DEFAULT_FRACTION * available)

    @contextmanager
    def capped(self) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        if self.device.type == "mps":
            torch.mps.synchronize()

    def warm_up(self) -> None:
        pass

    def end_forward_backward(self) -> None:
        tracker, reading = self._tracker, self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0, tracker.peak_bytes)
        reading.peak_bytes = max(reading.peak_bytes, tracker.peak_bytes)
        tracker.reset_peak()
        self._where.optimizer_phase = True

    def live_bytes(self) -> int:
        return self._tracker.live_bytes

    def layout(self) -> tuple | None:
        return None  # no caching allocator: nothing laid out that a next step could meet

    @contextmanager
    def measure(self, tracked: Callable[[], list], trace: bool = True) -> Iterator[Reading]:
        """``tracked()`` lists the tensors alive before the step (weights, gradients, optimizer
        state). It is a callable, and its list is dropped at once: a list kept for the block
        would hold gradients the step frees (``zero_grad(set_to_none=True)``) alive."""
        del trace  # the CPU tracker records the trace always: it sees every op anyway
        reading = self._reading = Reading()
        self._where = _Where()
        tracker = self._tracker = TracingTracker(self.device, self.limit_bytes, tracked(),
                                                 self._where, self.held_bytes,
                                                 defer_budget=self.defer_budget)
        if self.baseline_bytes is None:
            self.baseline_bytes = tracker.baseline_bytes
        try:
            with tracing(tracker, self._where):
                yield reading
        finally:
            reading.peak_bytes = max(reading.peak_bytes, tracker.peak_bytes)
            reading.live_bytes = tracker.live_bytes
            tracker.finish(reading)
            self._tracker = None


# See NOTE [ A real CUDA OOM inside a job ] in _tracker.py (not run on a GPU yet).
JOB_TENSOR_FRACTION = 0.85


_LAYOUT_STATS = ("reserved_bytes", "allocated_bytes", "segment", "inactive_split",
                 "inactive_split_bytes")


class CudaMeter(_TracedSteps):
    """Peak allocated and reserved bytes from the caching allocator; the budget caps the process."""

    def __init__(self, device: torch.device, budget_bytes: int | None) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.budget_bytes = budget_bytes
        self.total_bytes = torch.cuda.get_device_properties(device).total_memory
        free, _ = torch.cuda.mem_get_info(device)
        reachable = free + torch.cuda.memory_reserved(device)
        self.limit_bytes = min(budget_bytes, reachable) if budget_bytes else reachable
        self.baseline_bytes: int | None = None
        self._reading = Reading()
        self._where: _Where | None = None
        self._tracker: TracingTracker | None = None

    @contextmanager
    def capped(self) -> Iterator[None]:
        if self.budget_bytes is None:
            yield
            return
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = getter(self.device) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, self.budget_bytes / self.total_bytes), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def warm_up(self) -> None:
        """Make cuBLAS's and cuBLASLt's workspaces now (the first matmul, and the first with a
        bias, allocate them for good), so that they are not in the first size's trace only."""
        with torch.no_grad():
            a = torch.ones(8, 8, device=self.device)
            torch.addmm(a, a, a)
            del a
        torch.cuda.synchronize(self.device)

    def _fold_peaks(self) -> None:
        reading = self._reading
        reading.peak_bytes = max(reading.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        reading.peak_reserved_bytes = max(reading.peak_reserved_bytes or 0,
                                          torch.cuda.max_memory_reserved(self.device))

    def end_forward_backward(self) -> None:
        reading = self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0,
                                            torch.cuda.max_memory_reserved(self.device))
        self._fold_peaks()
        torch.cuda.reset_peak_memory_stats(self.device)
        if self._where is not None:
            self._where.optimizer_phase = True

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def layout(self) -> tuple | None:
        """The caching allocator's layout as its counters say it: reserved and allocated bytes,
        segments and the free splits inside them (memory_snapshot would say each block, at a
        cost per call that grows with them)."""
        stats = torch.cuda.memory_stats(self.device)
        return tuple(stats.get(f"{key}.all.current") for key in _LAYOUT_STATS)

    @contextmanager
    def measure(self, tracked: Callable[[], list], trace: bool = False) -> Iterator[Reading]:
        """``tracked()``: as for TensorMeter.measure. ``trace``: also record the per-op trace
        (slower: a Python call per op), which the probe asks for at the sizes it fits on."""
        reading = self._reading = Reading(peak_reserved_bytes=0)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.baseline_bytes is None:
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        trace = trace or self.defer_budget  # see JOB_TENSOR_FRACTION
        self._where = _Where() if trace else None
        budget = int(JOB_TENSOR_FRACTION * self.limit_bytes) if self.defer_budget else None
        tracker = (TracingTracker(self.device, budget, tracked(), self._where, self.held_bytes,
                                  defer_budget=self.defer_budget) if trace else None)
        self._tracker = tracker
        try:
            with tracing(tracker, self._where) if tracker is not None else nullcontext():
                yield reading
        finally:
            self._fold_peaks()
            reading.live_bytes = torch.cuda.memory_allocated(self.device)
            if tracker is not None:
                tracker.finish(reading)
            self._tracker = None


def make_meter(device: torch.device, budget_bytes: int | None) -> TensorMeter | CudaMeter:
    if device.type == "cuda":
        return CudaMeter(device, budget_bytes)
    return TensorMeter(device, budget_bytes)
