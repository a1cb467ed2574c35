"""The per-op memory trace of a training step, and the peak model fitted on two of them.

Usage:
    >>> trace_2 = OpTrace(names=["mm", "relu"], live=[100, 120], where=["f", "f"])
    >>> trace_4 = OpTrace(names=["mm", "relu"], live=[100, 140], where=["f", "f"])
    >>> model = PeakModel.fit(trace_2, 2, trace_4, 4)
    >>> model.peak_bytes(10), model.largest_batch_size(200, multiple_of=1, ceiling=1024)
    (200, 10)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...results import PeakSegment

# NOTE [ Every op's live bytes are affine in the batch size ]
# A training step runs the same sequence of operators at every batch size, and each tensor it
# makes is either of a fixed size (weights, their gradients, optimizer state) or proportional to
# the batch. So the bytes alive after op i are a_i + b_i * B, and the step's peak is
# max_i (a_i + b_i * B): piecewise linear and convex in B, with a kink wherever another op comes
# to hold the peak (a constant optimizer phase at small sizes, the largest activation at large
# ones). One line fitted on whole-step peaks cannot follow that; the per-op lines, fitted on two
# traces of the same op sequence, predict the peak at any size exactly, kinks included. Where the
# sequences differ (data-dependent shapes, unpadded variable lengths) there is no model and the
# probe falls back to its search; where a prediction misses, it refits on the sizes nearest the
# boundary (see NOTE [ Predict, then verify ] in probe/_search.py).


@dataclass
class OpTrace:
    """What one trial did to memory: after each op, its name, the live bytes, and where it ran
    ("forward of encoder.layer.0.attention", "backward of ...", "optimizer step"). ``events``
    lists storage allocations and frees as ("alloc", key, nbytes) / ("free", key, 0), for the
    CUDA allocator model. ``complete`` is False when the trial stopped at an out-of-memory op."""

    names: list[str] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)  # module path -> its class's name
    events: list[tuple[str, int, int]] = field(default_factory=list)
    # the op each event happened in: its index in ``names`` (``len(names)`` after the last op),
    # for the frames of a memory snapshot (results/_snapshot.py)
    event_ops: list[int] = field(default_factory=list)
    complete: bool = True
    # (key, nbytes) of the storages alive when the trial began, for the allocator model's replay
    preallocated: list[tuple[int, int]] = field(default_factory=list)
    # after the trial: per op, the live bytes of one part ("optimizer", "activation of head"),
    # what the what-ifs take away (see probe/_what_if.py)
    parts: dict[str, list[int]] = field(default_factory=dict)
    # after a complete trial, each storage's kind, for a rank's share of it (probe/_parallel.py,
    # NOTE [ One rank's share of a trace ]): (born at op, freed at op or None, nbytes, kind) per
    # storage, kind one of parameter, gradient, optimizer, activation, temporary and step (a
    # temporary of the optimizer step); the kind of each event's storage ("" for frees and
    # workspaces) and of each preallocated storage
    storages: list[tuple[int, int | None, int, str]] = field(default_factory=list)
    event_kinds: list[str] = field(default_factory=list)
    preallocated_kinds: list[str] = field(default_factory=list)

    def without(self, *parts: str) -> OpTrace:
        """The same trace with the bytes of ``parts`` taken away at every op."""
        live = list(self.live)
        for part in parts:
            for i, value in enumerate(self.parts.get(part, ())):
                live[i] -= value
        return OpTrace(names=self.names, live=live, where=self.where, kinds=self.kinds)

    def same_ops(self, other: OpTrace) -> bool:
        return self.names == other.names


def _floor_div(numerator: int, denominator: int) -> int:
    return numerator // denominator  # Python floors toward -inf, which is what the bounds need


class PeakModel:
    """Per-op lines through two traces of the same op sequence (see NOTE [ Every op's live bytes
    are affine in the batch size ]). All arithmetic is exact: the lines go through integer
    points, so a prediction is a byte count, not an estimate."""

    def __init__(self, small: OpTrace, batch_small: int, large: OpTrace, batch_large: int) -> None:
        self.small, self.large = small, large
        self.batch_small, self.batch_large = batch_small, batch_large

    @classmethod
    def fit(cls, small: OpTrace, batch_small: int, large: OpTrace,
            batch_large: int) -> PeakModel | None:
        """The model, or None when the two traces are not of the same op sequence."""
        if (batch_small == batch_large or not small.complete or not large.complete
                or not small.names or not small.same_ops(large)):
            return None
        if batch_small > batch_large:
            small, batch_small, large, batch_large = large, batch_large, small, batch_small
        return cls(small, batch_small, large, batch_large)

    @property
    def grows(self) -> bool:
        """Some op holds more at the larger size: without that, memory that did not move between
        two small sizes (allocator rounding, a plateau) says nothing about larger ones."""
        return any(high > low for low, high in zip(self.small.live, self.large.live))

    def _bytes_at(self, i: int, batch_size: int) -> int:
        """Op i's live bytes at ``batch_size``, rounded up: a + b * B through the two points."""
        span = self.batch_large - self.batch_small
        low, high = self.small.live[i], self.large.live[i]
        return -_floor_div(-(low * span + (high - low) * (batch_size - self.batch_small)), span)

    def _argmax(self, batch_size: int) -> int:
        span, b0 = self.batch_large - self.batch_small, self.batch_small
        best, best_value = 0, None
        for i, (low, high) in enumerate(zip(self.small.live, self.large.live)):
            value = low * span + (high - low) * (batch_size - b0)
            if best_value is None or value > best_value:
                best, best_value = i, value
        return best

    def peak_bytes(self, batch_size: int) -> int:
        """Predicted peak live bytes of the step at ``batch_size``."""
        return self._bytes_at(self._argmax(batch_size), batch_size)

    def where(self, batch_size: int) -> str:
        """Where the peak sits at ``batch_size``: "encoder.layer.5 (BertLayer) backward, at
        aten.bmm.default" (``said_where``)."""
        return said_where(self.large, self._argmax(batch_size))

    def largest_batch_size(self, limit_bytes: int, *, multiple_of: int, ceiling: int) -> int:
        """The largest multiple of ``multiple_of`` (at most ``ceiling``) whose predicted peak stays
        within ``limit_bytes``; 0 when none does."""
        span, b0 = self.batch_large - self.batch_small, self.batch_small
        best = ceiling
        for low, high in zip(self.small.live, self.large.live):
            if high > low:  # a_i + b_i * B <= limit  <=>  B <= b0 + (limit - low) * span / slope
                best = min(best, b0 + _floor_div((limit_bytes - low) * span, high - low))
            elif low > limit_bytes:  # flat or falling, and over the limit already at b0
                best = min(best, b0 - 1 if high == low else
                           b0 + _floor_div((low - limit_bytes) * span, low - high) - 1)
        return max(0, best // multiple_of * multiple_of)

    def envelope(self, lo: int, hi: int) -> tuple[PeakSegment, ...]:
        """The peak's piecewise-linear shape over ``[lo, hi]``: one segment per op that holds the
        peak somewhere in the range, in order of batch size."""
        segments: list[PeakSegment] = []
        size = max(1, lo)
        while size <= hi:
            i = self._argmax(size)
            low, high = self.small.live[i], self.large.live[i]
            per_sample = (high - low) / (self.batch_large - self.batch_small)
            fixed = low - per_sample * self.batch_small
            segments.append(PeakSegment(size, fixed, per_sample, said_where(self.large, i)))
            size = self._next_kink(i, size, hi)
        return tuple(segments)

    def _next_kink(self, i: int, size: int, hi: int) -> int:
        """The smallest size above ``size`` where another op's line rises above op i's."""
        span = self.batch_large - self.batch_small
        low_i, high_i = self.small.live[i], self.large.live[i]
        nearest = hi + 1
        for low, high in zip(self.small.live, self.large.live):
            steeper = (high - low) - (high_i - low_i)
            if steeper <= 0:
                continue
            # line j > line i  <=>  (low - low_i) * span + steeper * (B - b0) > 0
            crossing = self.batch_small + _floor_div((low_i - low) * span, steeper) + 1
            if size < crossing < nearest:
                nearest = crossing
        return nearest


def said_where(trace: OpTrace, i: int) -> str:
    """Where op ``i`` of ``trace`` ran, for a reader (``said_at``)."""
    return said_at(trace.where[i], trace.names[i], trace.kinds) if trace.where else trace.names[i]


def said_at(where: str, op: str, kinds: dict[str, str]) -> str:
    """``where`` ("backward of layers.9") and ``op`` for a reader: the module by its path and
    class, then the phase, then the op ("layers.9 (Linear) backward, at aten.mm.default"); the
    optimizer step and the batch's own ops by name ("optimizer step, at aten.add_.Tensor")."""
    if where == "making the batch":  # the batch's own ops: the user's make_batch, or ours
        return where
    phase, of, module = where.partition(" of ")
    if not of or phase not in ("forward", "backward"):
        return f"{where}, at {op}"
    if module == "the step":  # no module entered: the loss, autograd's own ops
        return f"{phase} outside the model's modules, at {op}"
    kind = kinds.get(module)
    return f"{module} ({kind}) {phase}, at {op}" if kind else f"{module} {phase}, at {op}"
