"""A traced step as PyTorch's memory snapshot: ``StepSnapshot`` (what a ``BatchSizeReport``
keeps of its step, filled by the engine) and ``write_snapshot``, the pickle that
``torch.cuda.memory._snapshot()`` writes, which ``python -m torch.cuda._memory_viz`` and
pytorch.org/memory_viz read. Standard library only.

NOTE [ A step as a memory snapshot ]
PyTorch's viewer reads a snapshot's ``segments`` as the allocator's state after the last event
of ``device_traces``, and walks the events backwards to draw any earlier moment. So the trace
runs from the storages alive before the step (weights, gradients, optimizer state: allocated
first, framed "before the step") through the traced trial's allocations and frees, and ends at
the step's peak, where ``segments`` are read: the blocks alive at the peak, each with the frame
of the module and op that made it ("forward of model.layers.0.mlp" / "aten.mm.default"). A
plan's trial runs two steps (the optimizer's state is made by the first), and the peak is the
second's: the whole first step is in the trace.
Where the CUDA caching allocator is modelled (a plan for a GPU, a probe on CUDA), segments and
blocks are the model's (memory/_allocator.py), with segment_alloc and segment_free events; a
probe on the CPU (or MPS) has no caching allocator: each tensor is its own segment, as CUDA
without caching (PYTORCH_NO_CUDA_MEMORY_CACHING=1) lays them out, and the snapshot says so in
its "batchwidgets" key.

Usage:
    >>> step = StepSnapshot(batch_size=2, device="cpu", allocator=False,
    ...                     frames=(("forward of net", "aten.mm.default"),),
    ...                     events=(("alloc", 4096, 512, 0),),
    ...                     segments=((4096, 512, ((512, 512, 0),)),))
    >>> step.reserved_bytes, step.allocated_bytes
    (512, 512)
"""

from __future__ import annotations

import base64
import html
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VIEWER = "https://pytorch.org/memory_viz"
SMALL_SEGMENT_BYTES = 2 * 2**20  # the caching allocator's small pool: segments of 2 MiB
LINK_MAX_BYTES = 8 * 2**20  # a larger snapshot is no link in a panel: save_snapshot(path)


@dataclass(frozen=True)
class StepSnapshot:
    """One traced step's allocations (``report.step_snapshot``): ``events`` as ``(action,
    address, size, frame)`` with action one of alloc, free_requested, free_completed,
    segment_alloc, segment_free; ``segments`` at the step's peak as ``(address, total_size,
    blocks)``, each block ``(size, requested_size, frame)`` in address order (requested 0: a
    free block); ``frames[i]`` is ``(where, op)`` (-1: none). See NOTE [ A step as a memory
    snapshot ]."""

    batch_size: int
    device: str  # "A100-80GB (the caching allocator's model)", "cpu"
    allocator: bool  # the caching allocator modelled; False: tensor events alone
    frames: tuple[tuple[str, str], ...]
    events: tuple[tuple[str, int, int, int], ...]
    segments: tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]

    @property
    def reserved_bytes(self) -> int:
        """Reserved at the peak: the segments' sizes."""
        return sum(total for _, total, _ in self.segments)

    @property
    def allocated_bytes(self) -> int:
        """Allocated at the peak, as PyTorch's viewer counts it: the requested bytes of the live
        blocks."""
        return sum(requested for _, _, blocks in self.segments for _, requested, _ in blocks)

    def __repr__(self) -> str:
        return (f"StepSnapshot(batch_size={self.batch_size}, device={self.device!r}, "
                f"{len(self.events)} events, {len(self.segments)} segments at the peak: "
                f"{self.reserved_bytes} reserved, {self.allocated_bytes} allocated)")


def _frames(step: StepSnapshot, frame: int) -> list[dict[str, Any]]:
    if frame < 0 or frame >= len(step.frames):
        return []
    where, op = step.frames[frame]
    return [{"name": op or where, "filename": where, "line": 0}]


def as_snapshot(step: StepSnapshot) -> dict[str, Any]:
    """The dict ``torch.cuda.memory._snapshot()`` returns, for ``step``."""
    traces = [{"action": action, "addr": address, "size": size, "stream": 0, "time_us": i,
               "frames": _frames(step, frame)}
              for i, (action, address, size, frame) in enumerate(step.events)]
    segments = []
    for address, total, blocks in step.segments:
        listed, at = [], address
        for size, requested, frame in blocks:
            listed.append({"address": at, "size": size, "requested_size": requested,
                           "state": "active_allocated" if requested else "inactive",
                           "frames": _frames(step, frame) if requested else []})
            at += size
        allocated = sum(b["size"] for b in listed if b["requested_size"])
        segments.append({
            "device": 0, "address": address, "total_size": total, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(b["requested_size"] for b in listed),
            "stream": 0, "segment_type": "small" if total <= SMALL_SEGMENT_BYTES and
            step.allocator else "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": listed})
    said = (f"planned by batchwidgets for {step.device}: the caching allocator's model"
            if step.allocator else
            f"measured by batchwidgets on {step.device}: tensor events alone (no caching "
            f"allocator is modelled there; each tensor is its own segment)")
    return {"segments": segments, "device_traces": [traces],
            "allocator_settings": {"expandable_segments": False},
            "batchwidgets": {"batch_size": step.batch_size, "device": step.device,
                             "caching_allocator": step.allocator, "said": said,
                             "reserved_bytes": step.reserved_bytes,
                             "allocated_bytes": step.allocated_bytes}}


def write_snapshot(step: StepSnapshot, path: str | Path) -> str:
    """Write ``step`` to ``path`` as a pickled memory snapshot; what it holds, in one line."""
    with open(path, "wb") as file:
        pickle.dump(as_snapshot(step), file)
    held = ("the caching allocator's model" if step.allocator else
            "tensor events alone: no caching allocator is modelled on this device")
    return (f"batch size {step.batch_size} on {step.device}, {held}; "
            f"{step.reserved_bytes} bytes reserved and {step.allocated_bytes} allocated at the "
            f"peak; open it at {VIEWER}")


def snapshot_link(step: StepSnapshot | None) -> str:
    """A panel's "Save snapshot" link: the pickle inline as a download (up to LINK_MAX_BYTES;
    a larger one names ``report.save_snapshot(path)`` instead), "" without a step."""
    if step is None:
        return ""
    data = pickle.dumps(as_snapshot(step))
    where = f'<a href="{VIEWER}" target="_blank">{VIEWER}</a>'
    if len(data) > LINK_MAX_BYTES:
        return (f"<p>The step's memory snapshot is {len(data) // 2**20} MiB: write it with "
                f"<code>report.save_snapshot(path)</code> and open it at {where}.</p>")
    href = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    return (f'<p><a download="batchwidgets-step.pickle" href="{html.escape(href)}">Save '
            f"snapshot</a> (batch size {step.batch_size}, the step up to its peak) and open it "
            f"at {where}.</p>")
