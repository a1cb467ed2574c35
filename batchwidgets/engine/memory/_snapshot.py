"""A traced step as PyTorch's memory snapshot records it (``step_snapshot``): the trace replayed
through the caching allocator's model with its segments, blocks and addresses, or, where no
caching allocator is modelled (the CPU), the tensors alone; up to the step's peak, each event
framed by the module and op that made it (NOTE [ A step as a memory snapshot ] in
results/_snapshot.py). The report keeps it; ``report.save_snapshot(path)`` writes it.

Usage:
    >>> from batchwidgets.engine.memory._trace import OpTrace
    >>> trace = OpTrace(names=["aten.mm.default"], live=[4096], where=["forward of net"],
    ...                 events=[("alloc", 7, 4096)], event_ops=[0])
    >>> step = step_snapshot(trace, 2, "T4", cap_bytes=None)
    >>> step.reserved_bytes, step.allocated_bytes, step.events[0][0]
    (2097152, 4096, 'segment_alloc')
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...results._snapshot import StepSnapshot
from ._allocator import (
    WORKSPACE_FREE_FRACTION,
    CachingAllocatorModel,
    Event,
    _Block,
    event_bytes,
)
from ._trace import OpTrace

BASE_ADDRESS = 0x7F0000000000  # where the segments start, as a device's addresses look
ALIGN_BYTES = 512  # the tensors-only layout: each storage at a multiple of this


class _Frames:
    """Frame ids for (where, op) pairs, each pair once."""

    def __init__(self, trace: OpTrace) -> None:
        self.trace, self.ids, self.frames = trace, {}, []

    def _id(self, where: str, op: str) -> int:
        key = (where, op)
        if key not in self.ids:
            self.ids[key] = len(self.frames)
            self.frames.append(key)
        return self.ids[key]

    def of_op(self, op: int | None) -> int:
        names, where = self.trace.names, self.trace.where
        if op is None:
            return -1
        if op >= len(names):
            return self._id("after the step", "")
        return self._id(where[op] if op < len(where) else "", names[op])

    def before(self, kind: str) -> int:
        return self._id("before the step", kind or "tensor")


class _Recording(CachingAllocatorModel):
    """The allocator's model that writes its segments' births and releases to ``log``.
    NOTE [ The model's own internals ]: it reads its base class's free blocks and segment
    hooks (``_free``, ``_new_segment``), its own module's, to list the blocks at the peak."""

    def __init__(self, cap_bytes: int | None) -> None:
        super().__init__(cap_bytes)
        self.segments: dict[int, int] = {}
        self.log: list[tuple[str, int, int, int]] = []
        self.frame = -1

    def _new_segment(self, size: int, small: bool) -> _Block:
        block = super()._new_segment(size, small)
        self.segments[block.address] = block.size
        self.log.append(("segment_alloc", BASE_ADDRESS + block.address, block.size, self.frame))
        return block

    def empty_cache(self) -> None:
        released = [b for b in self._free.values() if b.prev is None and b.next is None]
        super().empty_cache()
        for block in released:
            del self.segments[block.address]
            self.log.append(("segment_free", BASE_ADDRESS + block.address, block.size,
                             self.frame))


def _ops(trace: OpTrace, events: Sequence[Event]) -> list[int | None]:
    if len(trace.event_ops) == len(events):
        return list(trace.event_ops)
    return [None] * len(events)  # a trace made without them (a rank's share): no frames


def _replay(trace: OpTrace, events: Sequence[Event], cap_bytes: int | None,
            stop: int | None) -> tuple[_Recording, dict, int]:
    """The trace through the recording model; stopped once ``stop`` actions are logged.
    Returns the model, the live handles and the log's length at the allocated peak."""
    model, frames = _Recording(cap_bytes), _Frames(trace)
    model.frames = frames
    handles: dict[object, tuple[_Block, int, int]] = {}
    log, peak, peak_at = model.log, -1, 0
    kinds = trace.preallocated_kinds
    steps = [("alloc", key, nbytes, frames.before(kinds[i] if i < len(kinds) else ""))
             for i, (key, nbytes) in enumerate(trace.preallocated)]
    steps += [(kind, key, nbytes, frames.of_op(op))
              for (kind, key, nbytes), op in zip(events, _ops(trace, events))]
    for kind, key, nbytes, frame in steps:
        model.frame = frame
        if kind == "free":
            entry = handles.pop(key, None)
            if entry is not None:
                block = entry[0]
                log.append(("free_requested", BASE_ADDRESS + block.address, block.size, frame))
                log.append(("free_completed", BASE_ADDRESS + block.address, block.size, frame))
                model.free(block)
        else:
            if kind == "workspace":
                wanted = min(nbytes, int(WORKSPACE_FREE_FRACTION * model.largest_free_bytes()))
                block = model.malloc_workspace(nbytes, WORKSPACE_FREE_FRACTION)
            else:
                wanted = event_bytes(kind, nbytes)
                block = model.malloc(wanted)
            if block is not None:
                handles[key] = (block, wanted, frame)
                log.append(("alloc", BASE_ADDRESS + block.address, block.size, frame))
        if model.allocated_bytes > peak:
            peak, peak_at = model.allocated_bytes, len(log)
        if stop is not None and len(log) >= stop:
            break
    return model, handles, peak_at


def _segments(model: _Recording, handles: dict) -> tuple:
    blocks = sorted([(b.address, b.size, requested, frame)
                     for b, requested, frame in handles.values()]
                    + [(b.address, b.size, 0, -1) for b in model._free.values()])
    found, i = [], 0
    for address, size in sorted(model.segments.items()):
        inside = []
        while i < len(blocks) and blocks[i][0] < address + size:
            inside.append(blocks[i][1:])
            i += 1
        found.append((BASE_ADDRESS + address, size, tuple(inside)))
    return tuple(found)


def _allocator_snapshot(trace: OpTrace, events: Sequence[Event], batch_size: int, device: str,
                        cap_bytes: int | None) -> StepSnapshot:
    try:
        _, _, peak_at = _replay(trace, events, cap_bytes, None)
        model, handles, _ = _replay(trace, events, cap_bytes, peak_at)
    except torch.OutOfMemoryError:  # not at a size that fits: the step as it would run alone
        _, _, peak_at = _replay(trace, events, None, None)
        model, handles, _ = _replay(trace, events, None, peak_at)
    return StepSnapshot(batch_size=batch_size, device=device, allocator=True,
                        frames=tuple(model.frames.frames), events=tuple(model.log[:peak_at]),
                        segments=_segments(model, handles))


def _tensor_snapshot(trace: OpTrace, events: Sequence[Event], batch_size: int,
                     device: str) -> StepSnapshot:
    """Each storage its own segment at its own address (no caching allocator), up to the
    peak of the live tensor bytes."""
    frames, kinds = _Frames(trace), trace.preallocated_kinds
    steps = [("alloc", key, nbytes, frames.before(kinds[i] if i < len(kinds) else ""))
             for i, (key, nbytes) in enumerate(trace.preallocated)]
    steps += [(kind, key, nbytes, frames.of_op(op))
              for (kind, key, nbytes), op in zip(events, _ops(trace, events))
              if kind in ("alloc", "free")]
    total = peak = 0
    peak_step, sizes = -1, {}
    for i, (kind, key, nbytes, _) in enumerate(steps):  # first: where the peak is
        if kind == "free":
            total -= sizes.pop(key, 0)
        elif nbytes > 0:
            sizes[key] = nbytes
            total += nbytes
        if total > peak:
            peak, peak_step = total, i
    live, log, at = {}, [], BASE_ADDRESS
    for kind, key, nbytes, frame in steps[:peak_step + 1]:
        if kind == "free":
            entry = live.pop(key, None)
            if entry is not None:
                address, size, _ = entry
                log += [("free_requested", address, size, frame),
                        ("free_completed", address, size, frame),
                        ("segment_free", address, size, frame)]
        elif nbytes > 0:
            live[key] = (at, nbytes, frame)
            log += [("segment_alloc", at, nbytes, frame), ("alloc", at, nbytes, frame)]
            at += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    segments = tuple((address, size, ((size, size, frame),))
                     for address, size, frame in sorted(live.values()))
    return StepSnapshot(batch_size=batch_size, device=device, allocator=False,
                        frames=tuple(frames.frames), events=tuple(log),
                        segments=segments)


def step_snapshot(trace: OpTrace, batch_size: int, device: str, *, cap_bytes: int | None,
                  allocator: bool = True,
                  events: Sequence[Event] | None = None) -> StepSnapshot:
    """``trace``'s step (or ``events``: its events scaled to ``batch_size``) up to its peak, as
    PyTorch's memory snapshot records it: through the caching allocator's model capped at
    ``cap_bytes`` (``allocator``), else its tensors alone."""
    events = trace.events if events is None else events
    if allocator:
        return _allocator_snapshot(trace, events, batch_size, device, cap_bytes)
    return _tensor_snapshot(trace, events, batch_size, device)
