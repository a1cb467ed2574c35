"""What one traced step holds: its split by part at the peak, and its timeline by kind over its
ops (the report's ``memory_split`` and ``memory_timeline``)."""

from __future__ import annotations

import itertools

from ...results import MemorySplit, MemoryTimeline
from ...results.memory import TIMELINE_KINDS
from ..memory import OpTrace, said_where


def memory_split(batch_size: int, trace: OpTrace, parts: dict[str, int],
                  modules: dict[str, int], peak: int) -> MemorySplit:
    by_module = dict(sorted(modules.items(), key=lambda item: -item[1]))
    return MemorySplit(
        batch_size=batch_size, parameters_bytes=parts.get("parameter", 0),
        gradients_bytes=parts.get("gradient", 0), optimizer_bytes=parts.get("optimizer", 0),
        activations_bytes=parts.get("activation", 0),
        temporaries_bytes=parts.get("temporary", 0) + parts.get("step", 0),
        communication_bytes=parts.get("communication", 0), by_module=by_module,
        where=said_where(trace, peak))


TIMELINE_POINTS = 300  # enough for a picture; a report stays small


def _phase(where: str) -> str:
    return ("forward" if where.startswith("forward") else "backward"
            if where.startswith("backward") else "optimizer step" if where.startswith("optimizer")
            else "other")


def memory_timeline(batch_size: int, trace: OpTrace) -> MemoryTimeline | None:
    """The step's live bytes by kind over its ops (from ``trace.storages``, a complete
    trial's): in each window of ops the one of largest total, so the peak is kept."""
    n = len(trace.live)
    if not n or not trace.storages:
        return None
    kinds = {kind: [0] * (n + 1) for kind in TIMELINE_KINDS}
    for born, freed, nbytes, kind in trace.storages:
        delta = kinds["temporary" if kind not in kinds else kind]
        delta[max(born, 0)] += nbytes
        delta[n if freed is None else min(max(freed, 0), n)] -= nbytes
    series = {kind: list(itertools.accumulate(delta[:n])) for kind, delta in kinds.items()}
    totals = [sum(values) for values in zip(*series.values())]
    peak = max(range(n), key=totals.__getitem__)
    # a trial may run two steps (NOTE [ A second step only when the first left state behind ]):
    # the one that holds the peak, from its first forward op to the next step's
    phases = [_phase(where) for where in trace.where]
    starts = [op for op in range(n) if phases[op] == "forward"
              and (op == 0 or phases[op - 1] in ("optimizer step", "other"))] or [0]
    first = max((op for op in starts if op <= peak), default=0)
    last = min((op for op in starts if op > peak), default=n) - 1
    window = max(1, -(-(last - first + 1) // TIMELINE_POINTS))
    ops = [max(range(start, min(start + window, last + 1)), key=totals.__getitem__)
           for start in range(first, last + 1, window)]
    spans: list[tuple[str, int, int]] = []
    for op in range(first, last + 1):
        if spans and spans[-1][0] == phases[op]:
            spans[-1] = (phases[op], spans[-1][1], op - first)
        else:
            spans.append((phases[op], op - first, op - first))
    return MemoryTimeline(batch_size=batch_size, ops=tuple(op - first for op in ops),
                          by_kind={k: tuple(v[op] for op in ops) for k, v in series.items()},
                          phases=tuple(spans), peak_op=peak - first, n_ops=last - first + 1)
