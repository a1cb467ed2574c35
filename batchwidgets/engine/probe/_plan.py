"""Planning for a target, as functions of the traces a probe made (``Traced``): replayed through
the target's caching allocator under its memory (``planned``), for one GPU or for each rank of N
(``_parallel.py``). Nothing runs on the target, the model is only read, and nothing here calls
into the probe: a what-if is planned again by the orchestrator (``_find_batch.py``)."""

from __future__ import annotations

import dataclasses
import functools

from ...results import BatchSizeReport
from ...results._snapshot import StepSnapshot
from .. import memory
from .._util import first_line
from ..memory import PeakModel
from ._nothing_fits import NoBatchSizeFits
from ._parallel import plan_ranks
from ._setup import SEARCH_CEILING, Pair, ProbeSetup, Traced


def plan(setup: ProbeSetup, traced: Traced) -> BatchSizeReport:
    """The traces replayed under the target's memory for one GPU or each rank of N (NOTE
    [ Planning for a GPU that is not here ]); ``NoBatchSizeFits`` where nothing fits."""
    report = traced.report
    if traced.stopped:  # planned from the sizes traced before the stop, where they are two
        if traced.pair is None:
            return dataclasses.replace(report, target=setup.target[0])
        return dataclasses.replace(planned(report, traced, *setup.target), stop_reason="stopped")
    report = planned(report, traced, *setup.target)
    if setup.parallel is not None:  # see NOTE [ Per-rank memory by strategy ]
        report = _ranks_planned(setup, report, traced)
    if report.max_batch_size == 0 and report.stop_reason != "stopped":
        raise NoBatchSizeFits(report)
    return report


# NOTE [ The band of a plan, from the evidence ]
# What the plan cannot trace (the real allocator's layout, kernels not modelled, cuDNN's choice)
# moves the real edge. The band's low end is the answer times the lowest ratio of true boundary to
# plan recorded on a real GPU, with the kernel rules of memory/_kernels.py, the workspaces of
# memory/_simulated.py and the staging buffers and steady state of memory/_allocator.py: an H200
# capped at 8 and 16 GiB (benchmarks/results/gpu_truth_h200.md, torch 2.11; replayed by
# tests/engine/probe/test_gpu_truth.py): the plans made today are exact for the wide CNN and the
# encoder at 8 GiB (641, 784), 0.993 and 0.976 of the plan at 16 GiB, and 0.947 for the checkpointed
# Llama at 16 GiB (18 against 19, one sample); an H100 earlier gave the encoder 0.961 (784 against
# 816, before the staging buffer). The recommended size (headroom 0.9) stays below every truth.
EVIDENCE_RATIO = 0.96


# NOTE [ Planning for a GPU that is not here ]
# find_batch(..., target="T4") runs the step at two small sizes on the CPU, through the simulated
# CUDA device (memory/_simulated.py: the caching allocator's rules, cuBLAS's workspace as the
# target makes it, cuDNN-like convolution workspaces), with the target's kernels where the CPU
# runs others (memory/_kernels.py: dropout, attention, the foreach optimizer step), and replays
# the trace, scaled to each size, through the allocator's model under the target's memory less
# the CUDA context (memory/_allocator.py: largest_batch_size). That is the answer, marked
# predicted. The band's high end is the same replay with the tensors alone (no convolution
# workspaces), its low end the answer as far below as real GPUs were found (NOTE [ The band of a
# plan, from the evidence ]).
def planned(report: BatchSizeReport, traced: Traced, name: str, usable_bytes: int,
            pair: Pair | None = None) -> BatchSizeReport:
    """The answer on the target from the probe's traces (or ``pair``: a rank's share of them,
    NOTE [ One rank's share of a trace ] in _parallel.py)."""
    pair = pair or traced.pair
    if pair is None:
        raise RuntimeError(f"find_batch could not trace two sizes of the same op sequence on the "
                           f"CPU to predict for {name} (sizes tried: "
                           f"{[a.batch_size for a in report.attempts]}); the step's shapes depend "
                           f"on its data. Probe on a GPU instead.")
    if not traced.replays:
        return _planned_in_tensors(report, pair, name, usable_bytes, traced.ceiling)
    (small, b_small), (large, b_large) = pair
    predict = functools.partial(memory.largest_batch_size, multiple_of=report.multiple_of,
                                ceiling=traced.ceiling, preallocated=large.preallocated)
    low = first = predict(small.events, b_small, large.events, b_large, usable_bytes)
    needs = _needs(pair, low, report.multiple_of)
    for _ in range(4):  # NOTE [ The answer under the curve ]
        over = next((size for size, need in needs if size <= low and need > usable_bytes), None)
        if over is None:
            break
        low = predict(small.events, b_small, large.events, b_large, usable_bytes,
                      ceiling=max(0, over - 1))
        needs = _needs(pair, low, report.multiple_of)
    tensors_only = [[e for e in t.events if e[0] != "workspace"] for t in (small, large)]
    same = [len(t) for t in tensors_only] == [len(small.events), len(large.events)]
    high = (first if same  # no workspace to leave out: the first search's own replays
            else predict(tensors_only[0], b_small, tensors_only[1], b_large, usable_bytes))
    return dataclasses.replace(
        report, step_snapshot=_snapshot(pair, max(low, 1), name, usable_bytes, True),
        max_batch_size=low, first_oom_batch_size=None, limit_bytes=usable_bytes,
        budget_bytes=None, stop_reason=_stop(name, low, traced.ceiling), target=name,
        target_band=(_evidence_low(low, report.multiple_of), max(low, high)),
        target_peaks=_running_max(needs),
        method=report.method.replace("then verified", "then replayed for the target"))


def _stop(name: str, found: int, ceiling: int) -> str:
    """A plan's stop reason: predicted, and where max_batch_size (or the ceiling) decided."""
    capped = ("" if found < ceiling else "; max_batch_size reached" if ceiling < SEARCH_CEILING
              else "; ceiling reached")
    return f"predicted for {name}: not run{capped}"


def _planned_in_tensors(report: BatchSizeReport, pair: Pair, name: str,
                        budget_bytes: int, ceiling: int) -> BatchSizeReport:
    """CPU processes under a budget (``target="4xCPU"``): what runs out there is the step's
    tensor bytes, as the budget meter counts them in a real job, so the per-op model of the pair
    decides, with no allocator."""
    (small, b_small), (large, b_large) = pair
    model = PeakModel.fit(small, b_small, large, b_large)
    if model is None:
        raise RuntimeError(f"find_batch could not fit the per-op model on sizes {b_small} and "
                           f"{b_large} to predict for {name}; this is a bug in batchwidgets; "
                           f"please report it with the report above")
    found = model.largest_batch_size(budget_bytes, multiple_of=report.multiple_of,
                                     ceiling=ceiling)
    return dataclasses.replace(
        report, step_snapshot=_snapshot(pair, max(found, 1), name, budget_bytes, False),
        max_batch_size=found, first_oom_batch_size=None, limit_bytes=budget_bytes,
        budget_bytes=budget_bytes, stop_reason=_stop(name, found, ceiling), target=name,
        target_band=(found, found), target_peaks=tuple(
            (size, model.peak_bytes(size)) for size in _peak_sizes(found, report.multiple_of)),
        method=report.method.replace("then verified", "then predicted under the budget"))


def _snapshot(pair: Pair, size: int, name: str, usable_bytes: int,
              allocator: bool) -> StepSnapshot:
    """The step at the answer, scaled from the pair, as a memory snapshot records it
    (NOTE [ A step as a memory snapshot ] in results/_snapshot.py)."""
    (small, b_small), (large, b_large) = pair
    events = memory.scale_events(small.events, b_small, large.events, b_large, size)
    return memory.step_snapshot(large, size, name, cap_bytes=usable_bytes, allocator=allocator,
                                events=events)


def _peak_sizes(found: int, multiple_of: int) -> list[int]:
    """Sizes a plan's peaks are given at: doubling from 1 to twice the answer, the answer and
    the next size exactly."""
    sizes = {found, found + multiple_of}
    size = 1
    while size < 2 * max(found, 1) and size <= SEARCH_CEILING:
        sizes.add(size)
        size *= 2
    return sorted(s for s in sizes if 0 < s <= SEARCH_CEILING)


def _evidence_low(found: int, multiple_of: int) -> int:
    return int(found * EVIDENCE_RATIO) // multiple_of * multiple_of


def _needs(pair: Pair, found: int,
           multiple_of: int) -> list[tuple[int, int]]:
    """What the step needs on the target (NOTE [ What a step needs ] in memory/_allocator.py)
    at sizes from 1 to twice the answer (doubling, and the answer and the next size exactly),
    by the replay that decided the answer. Sizes up to half the answer take the uncapped
    reserved peak of their tensors (no cap is near them: what they need is that or a little
    less), the others the search down the capacities."""
    (small, b_small), (large, b_large) = pair
    needs = []
    for size in _peak_sizes(found, multiple_of):
        events = memory.scale_events(small.events, b_small, large.events, b_large, size)
        needs.append((size, memory.needed_bytes(events, preallocated=large.preallocated,
                                                exact=2 * size > found)))
    return needs


# NOTE [ The answer under the curve ]
# The replay is not monotone in the batch size either: a size can fit the usable memory while a
# smaller one the curve samples does not (an MLP on 2 GiB, in the loop that keeps its batch to
# the next step: 153,600 fit, 131,072 needed 2.2 GiB). The curve of needs is a running maximum
# (a larger batch holds no fewer bytes), so max_batch_size is the largest size whose need, on
# that curve, is at most the usable memory: below the first sampled size that does not fit.
def _running_max(needs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The curve of needs, never falling: each size's need or a smaller size's, the larger."""
    peaks, most = [], 0
    for size, need in needs:
        most = max(most, need)
        peaks.append((size, most))
    return tuple(peaks)


def _ranks_planned(setup: ProbeSetup, report: BatchSizeReport,
                   traced: Traced) -> BatchSizeReport:
    """Each strategy's per-rank plan: FSDP2 from one rank traced on a fake group where it could
    be (NOTE [ One FSDP2 rank, traced ] in _sharded.py), the rest by each storage's share on a
    rank."""
    ranks_traced: dict[str, BatchSizeReport] = {}
    pairs: dict[str, Pair] = {}
    if setup.parallel in ("fsdp", "compare"):
        fsdp, why_not = _fsdp_planned(setup, traced.rank, traced.rank_note)
        if fsdp is not None:
            ranks_traced["fsdp"] = fsdp
            if traced.rank is not None and traced.rank.pair is not None:
                pairs["fsdp"] = traced.rank.pair
        else:
            report = dataclasses.replace(report, method=f"{report.method} FSDP2 planned by its "
                                                        f"published rules: {why_not}.")
    name, usable = setup.target
    return plan_ranks(report, setup.model, setup.parallel, setup.world_size, traced.pair,
                      lambda pair: planned(report, traced, name, usable, pair), ranks_traced,
                      setup.units, pairs)


def _fsdp_planned(setup: ProbeSetup, rank: Traced | None,
                  why_not: str) -> tuple[BatchSizeReport | None, str]:
    """One FSDP2 rank's plan from its traces; or None and why there is none."""
    if rank is None:
        return None, why_not
    try:
        report = planned(rank.report, rank, *setup.target)
    except Exception as error:  # what the plain trace planned, one FSDP2 rank's could not
        memory.drop_own_frames(error)
        return None, f"one FSDP2 rank could not be traced ({first_line(error)})"
    method = (f"{report.method} One FSDP2 rank of {setup.world_size} traced on a fake process "
              f"group: its shards, all-gathers and reduce-scatters as they run.")
    return dataclasses.replace(report, method=method), ""
