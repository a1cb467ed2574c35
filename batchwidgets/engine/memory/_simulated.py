"""A simulated CUDA device over CPU tensors, for testing the CUDA search without a GPU and for
planning a GPU that is not here: every new tensor storage goes through a model of the caching
allocator, with cuBLAS- and cuDNN-like workspaces, and ``torch.OutOfMemoryError`` is raised at
the op that passes the cap. One object, one module: the device, the meters over it, and which
meter a probe reads (``probe_meter``, ``seed_meter``).

Usage:
    >>> import torch
    >>> from batchwidgets.engine.memory._simulated import SimulatedCudaMeter
    >>> meter = SimulatedCudaMeter("cpu", budget_bytes=64 * 2**20)
    >>> with meter.measure([]) as reading:
    ...     x = torch.zeros(1000)
    >>> reading.peak_bytes, reading.peak_reserved_bytes
    (4096, 2097152)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._state import makes_weakref_callbacks
from ._allocator import CachingAllocatorModel, Event, staging_bytes, staging_kind
from ._kernels import cuda_kernels
from ._meters import (
    CudaMeter,
    Reading,
    TensorMeter,
    TracingTracker,
    _TracedSteps,
    make_meter,
    tracing,
)
from ._targets import CPU_TARGET
from ._tracker import DEVICE, LIFT, _Where, unique_tensors
from ._workspaces import (
    CONV_OPS,
    MATMUL_OPS,
    REDUCE_OPS,
    Workspaces,
    device_rules,
    kernel_area,
    reduction_shape,
    target_capability,
    target_workspaces,
)


class _SimulatedDevice(TorchDispatchMode):
    """Sends every new CPU storage through ``allocator`` and frees it when the storage dies;
    storages that existed before, and views and in-place outputs of them, cost nothing new (the
    rules of ``TensorMemoryTracker``). While ``log`` is a list, every allocation and free is
    written to it as trace events; ``live`` holds the allocations alive, oldest first. While
    ``tracker`` is set, this mode also does its work (NOTE [ One dispatch mode for two ])."""

    def __init__(self, allocator: CachingAllocatorModel, workspaces: Workspaces) -> None:
        super().__init__()
        self.allocator, self.workspaces = allocator, workspaces
        self.log: list[Event] | None = None
        self.log_ops: list[int] | None = None  # each logged event's op (OpTrace.event_ops)
        self.live: dict[int, int] = {}  # key -> requested bytes
        self.cublas: dict[int | str, tuple[int, Any]] = {}  # see _blas_workspaces
        self.tracker: TracingTracker | None = None
        self._keys = iter(range(1, 2**62))
        self._storages: dict[int, tuple[weakref.ref, int, tuple[int, Any] | None]] = {}
        self.storage_of: dict[int, int] = {}  # allocation key -> id() of its storage
        self._busy = False
        self._pending: list[tuple[int, Any]] = []  # frees that arrived inside a malloc (gc)

    def count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":  # so not meta either (is_meta is an op on a fake)
            return
        storage = tensor.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        known = self._storages.get(key)
        same = known is not None and known[0]() is storage
        if same:
            if known[1] == nbytes:
                return
            del self._storages[key]  # resized in place (out= ops): the new block comes first
        # NOTE [ A storage of no bytes ]: known, so that an out= op growing it is seen, no event
        entry = self._malloc(nbytes) if nbytes else None
        self._storages[key] = (weakref.ref(storage, self._release(key)), nbytes, entry)
        if entry is not None:
            self.storage_of[entry[0]] = key
        if same:
            self._free(known[2])

    def _malloc(self, nbytes: int, workspace_fraction: float | None = None,
                kind: str = "alloc", logged: int | None = None) -> tuple[int, Any]:
        self._busy = True
        try:
            if workspace_fraction is None:
                block = self.allocator.malloc(nbytes)
            else:
                block = self.allocator.malloc_workspace(nbytes, workspace_fraction)
        finally:
            self._busy = False
            while self._pending:
                self._free(self._pending.pop())
        key = next(self._keys)
        self.live[key] = nbytes
        if self.log is not None:
            self.log.append((kind if workspace_fraction is None else "workspace", key,
                             nbytes if logged is None else logged))
            self._log_op()
        return key, block

    def _free(self, entry: tuple[int, Any] | None) -> None:
        if entry is None:  # a storage of no bytes: no block (NOTE [ A storage of no bytes ])
            return
        if self._busy:
            self._pending.append(entry)
            return
        key, block = entry
        del self.live[key]
        if self.log is not None:
            self.log.append(("free", key, 0))
            self._log_op()
        self.allocator.free(block)

    def _log_op(self) -> None:
        if self.log_ops is not None:
            self.log_ops.append(len(self.tracker.trace.names) if self.tracker is not None else 0)

    @makes_weakref_callbacks  # see NOTE [ Restoring under Ctrl-C ] in engine/_state.py
    def _release(self, key: int) -> Callable[[weakref.ref], None]:
        def release(ref: weakref.ref) -> None:
            known = self._storages.get(key)
            if known is not None and known[0] is ref:
                del self._storages[key]
                self._free(known[2])
        return release

    def _blas_workspaces(self, name: str) -> None:
        """cuBLAS's workspace of the thread (forward; backward on a GPU's autograd thread) and
        cuBLASLt's, each made at its first product and kept for good."""
        spaces = self.workspaces
        thread = (1 if spaces.cublas_threads > 1
                  and torch._C._current_autograd_node() is not None else 0)
        if spaces.cublas_bytes > 0 and thread not in self.cublas:
            self.cublas[thread] = self._malloc(spaces.cublas_bytes)
        if name in ("addmm", "_addmm_activation") and spaces.cublaslt_bytes > 0 \
                and "lt" not in self.cublas:
            self.cublas["lt"] = self._malloc(spaces.cublaslt_bytes)

    def _stage(self, args: tuple, kwargs: dict) -> None:
        """A reduction's staging buffer, taken after its output and freed after its kernel
        (NOTE [ A reduction's staging buffer ]); logged with the rows it reduces, even when it
        stages nothing at this size, so that the traces of two sizes correspond."""
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is None:
            return
        dims = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else \
            kwargs.get("dim")
        shape = reduction_shape(tensor, dims)
        if shape is not None:
            outputs, rows, fastest, acc = shape
            spaces = self.workspaces
            nbytes = staging_bytes(outputs, rows, fastest, acc, spaces.sms, spaces.threads_per_sm)
            kind = staging_kind(outputs, fastest, acc, spaces.sms, spaces.threads_per_sm)
            self._free(self._malloc(nbytes, kind=kind, logged=rows))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE:
            return func(*args, **(kwargs or {}))
        tracker = self.tracker
        try:
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in MATMUL_OPS:
                self._blas_workspaces(name)
            out = func(*args, **kwargs)
            # The outputs first, then the workspace, as a CUDA op allocates them before its kernel.
            # none at all for many (prim.device); none new for a lift (NOTE [ Lifted constants ])
            outputs = list(unique_tensors([out])) if func is not LIFT else []
            inputs = {id(t.untyped_storage()) for t in unique_tensors([args, kwargs])} \
                if outputs else set()
            for tensor in outputs:
                key = id(tensor.untyped_storage())
                if key in self._storages or key not in inputs:
                    self.count(tensor)
            if name in CONV_OPS and self.workspaces.conv_ratio > 0:
                first = next(unique_tensors([args]), None)  # the input, or the output's gradient
                if first is not None:
                    wanted = int(self.workspaces.conv_ratio * first.numel() * first.element_size()
                                 * (kernel_area(name, args) if self.workspaces.conv_unfold else 1))
                    self._free(self._malloc(wanted, self.workspaces.conv_free_fraction))
            if name in REDUCE_OPS and self.workspaces.sms:
                self._stage(args, kwargs)
            if tracker is not None:
                tracker.count_outputs(func, inputs, outputs)
            return out
        finally:
            if tracker is not None:
                tracker.record_op(func)


# NOTE [ A storage of no bytes ]
# A storage of 0 bytes takes no block, and the tracer never sees it born (its live bytes do not
# change). The events' kinds (parameter, gradient, optimizer, ... for a rank's share) are matched
# to the tracer's births storage by storage (TracingTracker.record_kinds), so an event logged for
# it took the kind of the next birth at its id: a storage grown from nothing by an out= op, or a
# later one at the same address, lost its kind, and an optimizer's state counted whole on every
# ZeRO rank at addresses that changed from run to run (a Llama's ZeRO-1 plan 149 against 170).
# So the device knows such a storage, to see it grow, but logs nothing until it holds bytes.


# NOTE [ One dispatch mode for two ]
# A probe on the simulated device traces every op twice over: the device's allocator and the
# tracer's per-op trace. As two stacked dispatch modes, each op paid two mode switches and two
# walks of its arguments and outputs, and the tracer's own tensor queries (is_meta is an op on a
# fake tensor) went through the device below it: more than a quarter of a fake plan's time for a
# Llama-3-8B shape. So ProbeMeter does not enter its TracingTracker as a mode: the device's mode
# hands each op's input storages and outputs to it (``tracker``), in the order the two modes ran
# (the device's allocations, then the tracer's count, its trace entry even when the op raises),
# and both keep their own books as before.


def record_events(run: Callable[[], object], *,
                  workspaces: Workspaces = Workspaces()) -> list[Event]:
    """The trace of ``run()``: every storage it allocates and frees, and the workspaces the
    simulated device would take (``NO_WORKSPACES`` for tensors only), as ``("alloc", key,
    nbytes)``, ``("free", key, 0)`` and, for convolution workspaces, ``("workspace", key,
    wanted_bytes)`` events, which ``replay`` sizes by the free memory as the device does (give it
    ``workspace_fraction=workspaces.conv_free_fraction``). Storages that existed before are not
    in the trace: ``preallocated_sizes`` lists those ``measure`` allocates first."""
    device = _SimulatedDevice(CachingAllocatorModel(), workspaces)
    device.log = events = []
    try:
        with device:
            run()
    finally:
        device.log = None
    return events


def preallocated_sizes(tracked: Iterable[object]) -> list[int]:
    """The storage sizes ``SimulatedCudaMeter.measure(tracked)`` allocates first, in order."""
    seen: set[int] = set()
    sizes = []
    for tensor in unique_tensors(tracked):
        storage = tensor.untyped_storage()
        if id(storage) not in seen and tensor.device.type == "cpu":
            seen.add(id(storage))
            sizes.append(storage.nbytes())
    return sizes


class SimulatedCudaMeter:
    """A CUDA device for the CPU CI: the interface of the meters in ``_meters.py`` over CPU
    tensors, with a ``CachingAllocatorModel`` capped at ``budget_bytes`` and the workspaces of
    NOTE [ Workspaces of the simulated device ]. Like the real allocator, it lives across
    ``measure`` blocks; ``empty_cache()`` releases its wholly free segments. After a block,
    ``events`` is its trace and ``preallocated`` the ``(key, nbytes)`` allocations alive at its
    start, oldest first: ``replay(events, cap, preallocated=preallocated)`` reruns it, exactly on
    a fresh meter (a used one's segments may be laid out otherwise)."""

    def __init__(self, device: torch.device | str, budget_bytes: int | None, *,
                 workspaces: Workspaces = Workspaces()) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"device should be 'cpu' (the simulated CUDA device runs on CPU "
                             f"tensors), but got device={device!r}.")
        self.limit_bytes = budget_bytes
        self.baseline_bytes: int | None = None
        self.allocator = CachingAllocatorModel(budget_bytes)
        self._device = _SimulatedDevice(self.allocator, workspaces)
        self._reading = Reading()
        self.events: list[Event] = []
        self.event_ops: list[int] = []
        self.preallocated: list[tuple[int, int]] = []

    @contextmanager
    def capped(self) -> Iterator[None]:
        yield  # the allocator model enforces the cap at every malloc

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def _fold_peaks(self) -> None:
        reading, allocator = self._reading, self.allocator
        reading.peak_bytes = max(reading.peak_bytes, allocator.peak_allocated_bytes)
        reading.peak_reserved_bytes = max(reading.peak_reserved_bytes or 0,
                                          allocator.peak_reserved_bytes)

    def end_forward_backward(self) -> None:
        reading = self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0,
                                            self.allocator.peak_reserved_bytes)
        self._fold_peaks()
        self.allocator.reset_peaks()

    @contextmanager
    def measure(self, tracked: list) -> Iterator[Reading]:
        reading = self._reading = Reading(peak_reserved_bytes=0)
        for tensor in unique_tensors(tracked):
            self._device.count(tensor)  # weights, gradients, optimizer state: alive before
        self.preallocated = list(self._device.live.items())
        self._device.log = self.events = []
        self._device.log_ops = self.event_ops = []
        self.allocator.reset_peaks()
        if self.baseline_bytes is None:
            self.baseline_bytes = self.allocator.allocated_bytes
        try:
            with self._device:
                yield reading
        finally:
            self._device.log = self._device.log_ops = None
            self._fold_peaks()


# -- the simulated device as the probe's meter ------------------------------------------------
class ProbeMeter(_TracedSteps, SimulatedCudaMeter):
    """``SimulatedCudaMeter`` with the rest of the probe's meter interface (see ``_meters.py``):
    the per-op trace of a ``TracingTracker`` inside the simulated device, whose own allocation
    events (workspaces included) replace the tracker's, as the allocator model replays them."""

    allocator_model = True  # the probe predicts through _allocator.largest_batch_size

    def __init__(self, device: torch.device | str, budget_bytes: int | None, *,
                 workspaces: Workspaces = Workspaces(),
                 capability: tuple[int, int] | None = None) -> None:
        super().__init__(device, budget_bytes, workspaces=workspaces)
        self.capability = capability  # a target's: its kernels run (see _kernels.py)
        self._tracker: TracingTracker | None = None
        self._where: _Where | None = None

    def warm_up(self) -> None:
        """The cuBLAS and cuBLASLt workspaces (the backward's too), made once, as
        CudaMeter.warm_up makes the real ones."""
        with SimulatedCudaMeter.measure(self, []):
            a = torch.ones(2, 2, requires_grad=True)
            torch.addmm(a, a, a).sum().backward()

    def end_forward_backward(self) -> None:
        super().end_forward_backward()
        self._where.optimizer_phase = True

    def live_bytes(self) -> int:
        return self.allocator.allocated_bytes

    def layout(self) -> tuple | None:
        return self.allocator.layout()

    @contextmanager
    def measure(self, tracked: Callable[[], list], trace: bool = True) -> Iterator[Reading]:
        del trace  # always: the tracker runs on the CPU anyway
        held = tracked()
        self._where = _Where()
        kernels = nullcontext() if self.capability is None else cuda_kernels(self.capability)
        with SimulatedCudaMeter.measure(self, held) as reading:
            tracker = self._tracker = TracingTracker(self.device, None, held, self._where)
            held.clear()  # see TensorMeter.measure: a kept list would pin freed gradients
            try:
                self._device.tracker = tracker  # see NOTE [ One dispatch mode for two ]
                with tracing(tracker, self._where, mode=False), kernels:
                    yield reading
            finally:
                self._device.tracker = None
                reading.live_bytes = self.allocator.allocated_bytes
                tracker.trace.events, tracker.trace.event_ops = self.events, self.event_ops
                tracker.trace.preallocated = list(self.preallocated)
                tracker.storage_of = self._device.storage_of  # see TracingTracker.record_kinds
                tracker.finish(reading)
                self._tracker = None


@contextmanager
def simulated_cuda(workspaces: Workspaces = Workspaces()) -> Iterator[None]:
    """Inside the block, ``find_batch`` on the CPU probes the simulated CUDA device instead:
    the caching allocator's rules, workspaces and a real ``torch.OutOfMemoryError`` at the cap
    (``budget``), on CPU tensors. For tests of the CUDA search without a GPU."""
    global _SIMULATED
    previous, _SIMULATED = _SIMULATED, workspaces
    try:
        yield
    finally:
        _SIMULATED = previous


_SIMULATED: Workspaces | None = None


def probe_meter(device: torch.device, budget_bytes: int | None,
                target: str | None = None) -> ProbeMeter | TensorMeter | CudaMeter:
    """The meter a probe reads: the simulated device with a target's workspaces for a plan
    (``target``, the GPU's name), the simulated device inside ``simulated_cuda()`` on the CPU
    (tests), else the device's own (``make_meter``)."""
    if target == CPU_TARGET:  # CPU processes: their tensor bytes, traced with no limit
        meter = make_meter(device, None)
        meter.limit_bytes = None
        return meter
    if target is not None:
        return ProbeMeter(device, None, workspaces=target_workspaces(target),
                          capability=target_capability(target))
    if device.type == "cpu" and _SIMULATED is not None:  # tests: see simulated_cuda
        return ProbeMeter(device, budget_bytes, workspaces=_SIMULATED)
    return make_meter(device, budget_bytes)


def seed_meter(meter: ProbeMeter | TensorMeter | CudaMeter) -> ProbeMeter | TensorMeter:
    """The meter a probe's fake first search reads beside ``meter``, the real steps' own: on a
    GPU, the plan for that GPU (its workspaces, kernels and caching allocator, simulated over
    fake CPU tensors) capped where the real steps are (NOTE [ On CUDA, the plan for this device
    first ] in probe/_probe.py); elsewhere ``meter`` itself, whose fake trials count as the real
    ones do."""
    if not isinstance(meter, CudaMeter):
        return meter
    workspaces, capability = device_rules(meter.device)
    return ProbeMeter("cpu", meter.limit_bytes, workspaces=workspaces, capability=capability)
