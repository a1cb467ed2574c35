"""Plans for N GPUs from one process (``target="8xA100-80GB", parallel="fsdp"``): the one-rank
plan's trace, with each rank's share of the weights, gradients and optimizer state and the
communication buffers its strategy adds, by the strategies' published rules.
One object, one module: a rank's share of a trace, its row and the strategies' order read the
same rules."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import torch

from ...results import BatchSizeReport, MemorySplit, ParallelPlan
from .. import memory
from ..memory import OpTrace

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")  # least communication first
PARALLEL = (*STRATEGIES, "compare")
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), in elements
REDUCE_BUCKET_ELEMENTS = 500_000_000  # reduce_bucket_size
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size
MAX_LIVE_ELEMENTS = 1_000_000_000  # stage3_max_live_parameters

# NOTE [ Per-rank memory by strategy ]
# A plan for N GPUs traces one rank. "fsdp" runs FSDP2 itself over a fake process group (NOTE
# [ One FSDP2 rank, traced ] in _sharded.py): its shards, all-gather and reduce-scatter buffers,
# prefetch and the optimizer step over a shard are in the trace. The other strategies, and
# "fsdp" where a fake group cannot run (inside a job, a torch without one), take the one-GPU
# trace and give each storage the rank's share of it by its kind (NOTE [ One rank's share of a
# trace ]), with the buffers the strategy adds, by the strategies' published rules:
# - "ddp": every rank holds the weights, gradients and optimizer state, plus DDP's gradient
#   buckets: with gradient_as_bucket_view=False (the default) the buckets are a second copy of
#   every gradient (bucket_cap_mb=25 only splits them into buckets; DDP's docs: "the saved memory
#   size will be equal to the total gradients size" with gradient_as_bucket_view=True).
# - "zero1"/"zero2"/"zero3": DeepSpeed's stages (the ZeRO paper; DeepSpeed's config docs).
#   Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the weights too.
#   The optimizer's share is the largest rank's when whole parameters are dealt out largest
#   first to the emptiest rank (torch's ZeroRedundancyOptimizer, which runs stage 1 on
#   torch.distributed; DeepSpeed's flat partition is the even 1/N, at most that). Stages 1-2
#   reduce gradients through a bucket of reduce_bucket_size (5e8) elements (DDP's buckets under
#   ZeroRedundancyOptimizer: the same bytes below 5e8 elements); stage 3 also gathers each
#   submodule's weights as it runs, plus a prefetch bucket of stage3_prefetch_bucket_size (5e7)
#   elements, at most stage3_max_live_parameters (1e9).
# - "fsdp" by rule: FSDP2 fully_shard on every block and the root: weights, gradients and
#   optimizer state 1/N; each block's weights all-gathered as one flat buffer when it runs,
#   the next block's gathered ahead (two blocks' weights), one block's gradients in the
#   reduce-scatter's input, the root's own weights gathered from forward to backward.
# ZeRO-3 and FSDP2 differ in those buffers: ZeRO-3 gathers by submodule in fixed-size buckets
# and reduces gradients in a fixed bucket, FSDP2 gathers and reduce-scatters whole blocks.
# The buffers are held through the whole step (a rank's worst case, not their timing).

# NOTE [ One rank's share of a trace ]
# Each storage of a trace has a kind (OpTrace.storages: parameter, gradient, optimizer state,
# activation, temporary, and "step", a temporary of the optimizer step). A rank's trace is the
# same trace with each storage at the rank's share of its bytes: the weights 1/N under ZeRO-3
# and FSDP, the gradients 1/N from ZeRO-2 on, the optimizer state and the optimizer step's
# temporaries (foreach's lists over the parameters a rank steps) at the optimizer's share from
# ZeRO-1 on; activations and the other temporaries whole. Both traces of the pair are shared
# alike, so the per-op model and the allocator replay read them as any other pair, and the
# optimizer step, where the largest models peak, is sharded with the states it works on.


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The model's states and units, in bytes, read from its parameters (meta ones too)."""

    weights_bytes: int
    gradients_bytes: int  # of the parameters that train
    gradient_itemsize: int
    trainable_numel: int
    numel: int
    weight_itemsize: int
    largest_leaf_bytes: int  # ZeRO-3's largest submodule (its own parameters)
    root_bytes: int  # FSDP2's root unit: parameters outside every block
    largest_block_bytes: int
    largest_unit_gradient_bytes: int
    trainable_sizes: tuple[int, ...]  # each trainable parameter's elements


def _bytes(params: list[torch.nn.Parameter], trainable: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP2's units below the root: each ModuleList's modules, else the top-level children."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return [b for lst in lists for b in lst] or list(model.children())


# NOTE [ The wrapping a plan assumes ]
# How a model is wrapped decides what FSDP2 gathers at once, so a plan says the wrapping it
# assumed (report.wrapping). By default it is the one torchtitan (parallelize_llama) and Hugging
# Face's FSDP2 plugin (accelerate's fsdp_auto_wrap_policy by the model's _no_split_modules) give
# a transformer: fully_shard on each block (the modules of each ModuleList: model.layers,
# transformer.h) and then on the root, which keeps the rest (embeddings, final norm, head). A
# model already sharded by fully_shard is planned as the job wrapped it: its own units.
def wrapping(model: torch.nn.Module, units: tuple[str, ...] = ()) -> str:
    """The wrapping a plan of ``model`` assumes, in words (NOTE [ The wrapping a plan
    assumes ]); ``units``: the names of the modules the user's own fully_shard wrapped."""
    if units:
        shown = ", ".join(name or "the root" for name in units[:3])
        more = f" and {len(units) - 3} more" if len(units) > 3 else ""
        return f"the job's own fully_shard units ({len(units)}: {shown}{more})"
    names = {id(module): name for name, module in model.named_modules()}
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module)]
    if lists:
        where = ", ".join(f"{name} ({len(module)} x {type(module[0]).__name__})"
                          for name, module in lists[:2])
        said = f"each block of {where}{' and more lists' if len(lists) > 2 else ''}"
    else:
        children = [names.get(id(child), "") for child in model.children()]
        more = ", ..." if len(children) > 4 else ""
        said = f"each top-level child ({', '.join(children[:4])}{more})"
    return (f"fully_shard on {said} and on the root, as torchtitan and Hugging Face's FSDP2 "
            f"plugin wrap; ZeRO-3 gathers each submodule's own weights")


def shapes(model: torch.nn.Module) -> Shapes:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    units = blocks(model)
    in_blocks = {id(p) for b in units for p in b.parameters()}
    root = [p for p in params if id(p) not in in_blocks]
    leaves = [list(m.parameters(recurse=False)) for m in model.modules()]
    return Shapes(
        weights_bytes=_bytes(params), gradients_bytes=_bytes(params, trainable=True),
        gradient_itemsize=max((p.element_size() for p in trainable), default=4),
        trainable_numel=sum(p.numel() for p in trainable), numel=sum(p.numel() for p in params),
        weight_itemsize=max((p.element_size() for p in params), default=4),
        largest_leaf_bytes=max((_bytes(leaf) for leaf in leaves), default=0),
        root_bytes=_bytes(root),
        largest_block_bytes=max((_bytes(list(b.parameters())) for b in units), default=0),
        largest_unit_gradient_bytes=max(
            (_bytes(u, trainable=True) for u in [*(list(b.parameters()) for b in units), root]),
            default=0),
        trainable_sizes=tuple(p.numel() for p in trainable))


def optimizer_share(sizes: tuple[int, ...], world_size: int) -> float:
    """The largest rank's share of the optimizer state when whole parameters are dealt out
    largest first to the emptiest rank (ZeroRedundancyOptimizer's partition)."""
    ranks = [0] * world_size
    for size in sorted(sizes, reverse=True):
        ranks[ranks.index(min(ranks))] += size
    return max(ranks) / max(sum(ranks), 1)


def _buffers(strategy: str, model: Shapes) -> int:
    """The communication buffers one rank holds (NOTE [ Per-rank memory by strategy ])."""
    reduce_bucket = min(REDUCE_BUCKET_ELEMENTS, model.trainable_numel) * model.gradient_itemsize
    if strategy == "ddp":
        return model.gradients_bytes
    if strategy in ("zero1", "zero2"):
        return reduce_bucket
    if strategy == "zero3":
        prefetch = min(PREFETCH_BUCKET_ELEMENTS, model.numel) * model.weight_itemsize
        return min(model.largest_leaf_bytes + prefetch,
                   MAX_LIVE_ELEMENTS * model.weight_itemsize) + reduce_bucket
    return model.root_bytes + 2 * model.largest_block_bytes + model.largest_unit_gradient_bytes


def shares(strategy: str, world_size: int, model: Shapes) -> dict[str, float]:
    """Each kind's share on one rank (NOTE [ One rank's share of a trace ]); kinds not named
    are held whole."""
    level = 3 if strategy == "fsdp" else STRATEGIES.index(strategy)
    found: dict[str, float] = {}
    if level >= 1:
        found["optimizer"] = found["step"] = optimizer_share(model.trainable_sizes, world_size)
    if level >= 2:
        found["gradient"] = 1 / world_size
    if level >= 3:
        found["parameter"] = found["optimizer"] = found["step"] = 1 / world_size
    return found


def _share(nbytes: int, kind: str, of: dict[str, float]) -> int:
    share = of.get(kind)
    return nbytes if share is None else math.ceil(nbytes * share)


BUFFERS_KEY = -(10**15)  # the strategy's buffers in a rank's trace (no storage's key)


# NOTE [ A stage holds at most the stage below ]
# A ZeRO-1 rank holds what a DDP rank holds, less the optimizer state of the parameters other
# ranks step, with a reduce bucket no larger than DDP's buckets; a ZeRO-2 rank holds a ZeRO-1
# rank's, less the gradients other ranks reduce. So a stage fits at least the batch of the one
# below, and the plan of the one below (its peaks an upper bound of this stage's) stands where
# this stage's own plan says less: every optimizer-state tensor cut to the rank's share, where a
# real rank holds whole parameters' state or one flat partition, can fragment the allocator
# model's replay (a GPT-2 on 8xA100-80GB: ZeRO-1 41 against DDP's 42).
HOLDS_AT_MOST = {"zero1": "ddp", "zero2": "zero1"}

# NOTE [ The order of the strategies ]
# Per rank, a stage that shards more holds less: ddp <= zero1 <= zero2 <= zero3 and
# zero2 <= fsdp in the batch that fits. ZeRO-3 and FSDP2 buy their sharded weights with buffers
# ZeRO-2 does not have (ZeRO-3: the submodule it gathers and a prefetch bucket; FSDP2: the
# root's weights gathered from forward to backward, two blocks' at once, one unit's gradients
# to reduce-scatter), so they hold less than a ZeRO-2 rank when those buffers are smaller than
# the weights sharding takes off the rank ((N - 1)/N of them), at every op of the step. Then
# ZeRO-3, whose trace is ZeRO-2's with less at every op, stands on ZeRO-2's plan where its own
# replay says less (NOTE [ A stage holds at most the stage below ]). Where the buffers are the
# larger (a model made mostly of one embedding, two ranks), the order cannot hold and the
# report says why (report.parallel_order), with the bytes of each side.
ORDER = (("ddp", "zero1"), ("zero1", "zero2"), ("zero2", "zero3"), ("zero2", "fsdp"))


def _gathered_over_saved(name: str, world_size: int, model: Shapes) -> tuple[int, int]:
    """The buffers ``name`` holds beyond ZeRO-2's, and the weights its sharding takes off a
    rank (NOTE [ The order of the strategies ])."""
    extra = _buffers(name, model) - _buffers("zero2", model)
    return extra, model.weights_bytes - math.ceil(model.weights_bytes / world_size)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


_GATHERS = {"zero3": "ZeRO-3 gathers each submodule's weights with a prefetch bucket",
            "fsdp": "FSDP2 gathers the root's weights from forward to backward and two blocks' "
                    "at once, and reduce-scatters a whole unit's gradients"}


def parallel_order(found: dict[str, int], world_size: int, model: Shapes) -> str:
    """Why the per-rank order does not hold, where it does not ("" where it holds: NOTE [ The
    order of the strategies ])."""
    said = []
    for low, high in ORDER:
        if found[high] >= found[low]:
            continue
        extra, saved = _gathered_over_saved(high, world_size, model)
        reason = (f"{_GATHERS[high]} ({_gb(extra)} more than ZeRO-2's buffers), more than the "
                  f"{_gb(saved)} of weights sharding takes off a rank of {world_size}"
                  if high in _GATHERS and extra > saved else
                  f"the allocator's replay of the two traces differs ({_gb(extra)} of buffers "
                  f"against {_gb(saved)} of weights saved)" if high in _GATHERS else
                  "the allocator's replay of the two traces differs")
        said.append(f"{high} fits {found[high]} per rank, below {low}'s {found[low]}: {reason}")
    return "; ".join(said)


def rank_trace(trace: OpTrace, of: dict[str, float], buffers_bytes: int) -> OpTrace:
    """``trace`` on one rank: each storage at its kind's share ``of``, the strategy's buffers
    alive from the start (NOTE [ One rank's share of a trace ])."""
    n = len(trace.live)
    delta = [0] * (n + 1)
    for born, freed, nbytes, kind in trace.storages:
        less = nbytes - _share(nbytes, kind, of)
        if less:
            delta[max(born, 0)] -= less
            delta[n if freed is None else min(freed, n)] += less
    live = [value + buffers_bytes + less
            for value, less in zip(trace.live, itertools.accumulate(delta[:n]))]
    events = [(kind, key, _share(nbytes, shared, of) if kind == "alloc" else nbytes)
              for (kind, key, nbytes), shared in zip(trace.events, trace.event_kinds)]
    preallocated = [(key, _share(nbytes, kind, of))
                    for (key, nbytes), kind in zip(trace.preallocated, trace.preallocated_kinds)]
    kinds = list(trace.preallocated_kinds[:len(preallocated)])
    if buffers_bytes:
        preallocated.append((BUFFERS_KEY, buffers_bytes))
        kinds.append("communication")
    return dataclasses.replace(trace, live=live, events=events, preallocated=preallocated,
                               preallocated_kinds=kinds, parts={})


def per_rank(strategy: str, world_size: int, split: MemorySplit, model: Shapes) -> MemorySplit:
    """One rank's memory at the trace's peak under ``strategy`` (``communication_bytes`` added)."""
    of = shares(strategy, world_size, model)
    return dataclasses.replace(
        split, parameters_bytes=_share(split.parameters_bytes, "parameter", of),
        gradients_bytes=_share(split.gradients_bytes, "gradient", of),
        optimizer_bytes=_share(split.optimizer_bytes, "optimizer", of),
        communication_bytes=_buffers(strategy, model))


Pair = tuple[tuple[OpTrace, int], tuple[OpTrace, int]]


def plan_ranks(report: BatchSizeReport, model: torch.nn.Module, strategy: str, world_size: int,
               pair: Pair, plan: Callable[[Pair], BatchSizeReport],
               traced: dict[str, BatchSizeReport], units: tuple[str, ...] = (),
               traced_pairs: dict[str, Pair] | None = None) -> BatchSizeReport:
    """The per-rank report under ``strategy`` ("compare": the one with the largest per-rank
    batch), with every strategy's row, the wrapping assumed and why the order of the strategies
    does not hold, where it does not. ``plan(pair)`` is the one-rank plan from a pair of
    traces; ``traced`` has the strategies traced as they run (their reports per rank already)
    and ``traced_pairs`` their pairs of traces, where there are; ``units``: the user's own
    fully_shard units, where the model came sharded."""
    split = report.memory_split
    if split is None:
        raise RuntimeError("find_batch traced no memory split to plan ranks from; this is a bug "
                           "in batchwidgets; please report it with the report above")
    model_shapes = shapes(model)
    rows, reports = [], {}
    for name in STRATEGIES:
        rank = per_rank(name, world_size, split, model_shapes)
        if name in traced:
            own = traced[name]
            rank = _traced_split(own.memory_split or split, rank.communication_bytes)
            rank_pair = (traced_pairs or {}).get(name)
        else:
            of, buffers = shares(name, world_size, model_shapes), _buffers(name, model_shapes)
            rank_pair = tuple((rank_trace(trace, of, buffers), size) for trace, size in pair)
            own = plan(rank_pair)
        one = own
        below = reports.get(_holds_at_most(name, world_size, model_shapes))
        if below is not None and below.max_batch_size > one.max_batch_size:
            one = below  # see NOTE [ A stage holds at most the stage below ]
        reports[name] = dataclasses.replace(one, memory_split=rank)
        row = _row(name, world_size, one.max_batch_size, rank, model_shapes)
        rows.append(dataclasses.replace(row, activations_bytes=_activations_at_answer(
            row, rank_pair, own, one.limit_bytes)))
    chosen = strategy if strategy != "compare" else max(
        STRATEGIES, key=lambda name: (reports[name].max_batch_size, -STRATEGIES.index(name)))
    order = parallel_order({name: found.max_batch_size for name, found in reports.items()},
                           world_size, model_shapes)
    return dataclasses.replace(reports[chosen], parallel=chosen, world_size=world_size,
                               parallel_plans=tuple(rows), parallel_order=order,
                               wrapping=wrapping(model, units))


def _holds_at_most(name: str, world_size: int, model: Shapes) -> str:
    """The strategy whose rank holds at least what a rank of ``name`` holds at every op of the
    same trace, if any (NOTE [ The order of the strategies ]): FSDP2's own trace is not one."""
    if name == "zero3":
        extra, saved = _gathered_over_saved(name, world_size, model)
        return "zero2" if extra <= saved else ""
    return HOLDS_AT_MOST.get(name, "")


def _row(name: str, world_size: int, found: int, rank: MemorySplit,
         model: Shapes) -> ParallelPlan:
    """What a rank holds under ``name``: its weights and optimizer state (at the trace's peak),
    its share of every gradient (held from backward to the step, whether or not the peak comes
    before them: an LLM's comes in the forward) and the buffers; its activations at its answer
    come from the rank's own step at ``found`` (``_activations_at_answer``)."""
    return ParallelPlan(
        parallel=name, world_size=world_size, max_batch_size=found,
        parameters_bytes=rank.parameters_bytes,
        gradients_bytes=_share(model.gradients_bytes, "gradient",
                               shares(name, world_size, model)),
        optimizer_bytes=rank.optimizer_bytes, communication_bytes=rank.communication_bytes)


# NOTE [ A row's activations, at its answer ]
# A row's activations_bytes are the bytes saved for backward at the peak of the rank's own step
# at the row's answer: the rank's pair of traces (the one-GPU pair at the rank's shares, or one
# FSDP2 rank's own) scaled to the answer event by event, as the allocator's replay that decided
# it scales them, each storage counted by its kind until the live bytes peak. Not the traced
# split scaled by the batch: the small traced sizes peak elsewhere (a Llama's one-GPU trace in
# the optimizer step, where the activations are freed: 4 KiB a sample, its input ids), and the
# split of one FSDP2 rank's trace is not its peak's. The row's parts add up to at most what the
# rank needs at its answer, and that to at most the usable memory: every gradient is counted
# whole, though at a forward peak none exists yet, so where the parts would pass that need the
# activations are cut to it.
def _activations_at_answer(row: ParallelPlan, pair: Pair | None, own: BatchSizeReport,
                           usable_bytes: int | None) -> int:
    """The activations a rank holds at its peak at ``row``'s answer (NOTE [ A row's
    activations, at its answer ]), where the rank's pair scales to it (else 0)."""
    found = row.max_batch_size
    if not found or pair is None:
        return 0
    (small, b_small), (large, b_large) = pair
    if b_small == b_large:
        return 0
    events = memory.scale_events(small.events, b_small, large.events, b_large, found)
    if events is None:
        return 0
    held, peak = _saved_at_peak(events, large.event_kinds, small, large)
    need = max(peak, int(own.predict_peak_bytes(found) or 0))
    if usable_bytes is not None:
        need = min(need, usable_bytes)
    others = (row.parameters_bytes + row.gradients_bytes + row.optimizer_bytes
              + row.communication_bytes)
    return max(0, min(held, need - others))


def _saved_at_peak(events: list[tuple[str, int, int]], kinds: list[str], small: OpTrace,
                   large: OpTrace) -> tuple[int, int]:
    """The activation bytes alive where ``events`` (a pair scaled to one size, the storages
    alive before them ``large``'s, under ``small``'s keys, as scale_events keeps them) peak in
    live bytes, and that peak."""
    owner: dict[int, tuple[bool, int]] = {}  # key -> (an activation, its bytes)
    live = saved = 0
    for index, (key, nbytes) in enumerate(large.preallocated):
        kind = large.preallocated_kinds[index] if index < len(large.preallocated_kinds) else ""
        if index < len(small.preallocated):
            key = small.preallocated[index][0]
        owner[key] = (kind == "activation", nbytes)
        live += nbytes
        saved += nbytes if kind == "activation" else 0
    peak, at_peak = live, saved
    for index, (event, key, nbytes) in enumerate(events):
        if event == "free":
            activation, freed = owner.pop(key, (False, 0))
            live -= freed
            saved -= freed if activation else 0
            continue
        nbytes = memory.event_bytes(event, nbytes)
        activation = index < len(kinds) and kinds[index] == "activation"
        owner[key] = (activation, nbytes)
        live += nbytes
        saved += nbytes if activation else 0
        if live > peak:
            peak, at_peak = live, saved
    return at_peak, peak


def _traced_split(split: MemorySplit, buffers_bytes: int) -> MemorySplit:
    """A traced rank's split: the buffers its strategy gathers are among its temporaries."""
    moved = min(buffers_bytes, split.temporaries_bytes)
    return dataclasses.replace(split, temporaries_bytes=split.temporaries_bytes - moved,
                               communication_bytes=moved)
