"""Plans for N GPUs from one process (``target="8xA100-80GB", parallel="fsdp"``): the one-rank
plan's trace, with each rank's share of the weights, gradients and optimizer state and the
communication buffers its strategy adds, by the strategies' published rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...results import BatchSizeReport, MemorySplit, ParallelPlan

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")  # least communication first
PARALLEL = (*STRATEGIES, "compare")
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), in elements
REDUCE_BUCKET_ELEMENTS = 500_000_000  # reduce_bucket_size
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size
MAX_LIVE_ELEMENTS = 1_000_000_000  # stage3_max_live_parameters

# NOTE [ Per-rank memory by strategy ]
# A plan for N GPUs traces one rank at its own batch (the one-GPU plan's fake trace), then takes
# from the memory the trace holds at its peak what the strategy does not keep on a rank and adds
# the buffers it does keep; the same trace is replayed under the target's memory shifted by that
# difference. These are the published rules, not a fake process group: FSDP2 on a fake mesh
# would trace one rank's collectives exactly, but the fake process group lives in
# torch.testing._internal, and the rules below are what the documentation states.
# - "ddp": every rank holds the weights, gradients and optimizer state, plus DDP's gradient
#   buckets: with gradient_as_bucket_view=False (the default) the buckets are a second copy of
#   every gradient (bucket_cap_mb=25 only splits them into buckets; DDP's docs: "the saved memory
#   size will be equal to the total gradients size" with gradient_as_bucket_view=True).
# - "zero1"/"zero2"/"zero3": DeepSpeed's stages (the ZeRO paper; DeepSpeed's config docs).
#   Stage 1 shards the optimizer state (1/N a rank), stage 2 the gradients too, stage 3 the
#   weights too. Stages 1-2 reduce gradients through a bucket of reduce_bucket_size (5e8)
#   elements; stage 3 also gathers each submodule's weights as it runs, plus a prefetch bucket
#   of stage3_prefetch_bucket_size (5e7) elements, at most stage3_max_live_parameters (1e9).
# - "fsdp": FSDP2 fully_shard on every block (the modules of each ModuleList, else the top-level
#   children) and on the root: weights, gradients and optimizer state sharded 1/N; each block's
#   weights are all-gathered as one flat buffer when it runs and resharded after forward, the
#   next block's gathered ahead (prefetch: two blocks' weights), one block's gradients in the
#   reduce-scatter's input; the root's own weights (embeddings, head) stay gathered from forward
#   to backward (FSDP2 does not reshard the root after forward).
# ZeRO-3 and FSDP2 differ in those buffers: ZeRO-3 gathers by submodule in fixed-size buckets
# and reduces gradients in a fixed bucket, FSDP2 gathers and reduce-scatters whole blocks.
# Weights and optimizer state are alive through the whole step, and the buffers too, so moving
# them moves every op's memory alike; gradients are taken as the trace holds them at its peak.
# The states at the optimizer step (weights, all gradients, optimizer state, buffers) must fit
# too. What is not modelled: the optimizer's temporaries over a shard (taken as over the whole
# model) and the allocator's rounding of the shards.


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


def _bytes(params: list[torch.nn.Parameter], trainable: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP2's units below the root: each ModuleList's modules, else the top-level children."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return [b for lst in lists for b in lst] or list(model.children())


def shapes(model: torch.nn.Module) -> Shapes:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    blocks = _blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in params if id(p) not in in_blocks]
    leaves = [list(m.parameters(recurse=False)) for m in model.modules()]
    units = [list(b.parameters()) for b in blocks] + [root]
    return Shapes(
        weights_bytes=_bytes(params), gradients_bytes=_bytes(params, trainable=True),
        gradient_itemsize=max((p.element_size() for p in trainable), default=4),
        trainable_numel=sum(p.numel() for p in trainable), numel=sum(p.numel() for p in params),
        weight_itemsize=max((p.element_size() for p in params), default=4),
        largest_leaf_bytes=max((_bytes(leaf) for leaf in leaves), default=0),
        root_bytes=_bytes(root),
        largest_block_bytes=max((_bytes(list(b.parameters())) for b in blocks), default=0),
        largest_unit_gradient_bytes=max((_bytes(u, trainable=True) for u in units), default=0))


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


def per_rank(strategy: str, world_size: int, split: MemorySplit, model: Shapes) -> MemorySplit:
    """One rank's memory at the trace's peak under ``strategy`` (``communication_bytes`` added)."""
    level = STRATEGIES.index(strategy) if strategy != "fsdp" else STRATEGIES.index("zero3")
    share = lambda nbytes, sharded: -(-nbytes // world_size) if sharded else nbytes  # noqa: E731
    return dataclasses.replace(
        split, parameters_bytes=share(split.parameters_bytes, level >= 3),
        gradients_bytes=share(split.gradients_bytes, level >= 2),
        optimizer_bytes=share(split.optimizer_bytes, level >= 1),
        communication_bytes=_buffers(strategy, model))


def _states(split: MemorySplit) -> int:
    return (split.parameters_bytes + split.gradients_bytes + split.optimizer_bytes
            + split.communication_bytes)


def plan_ranks(report: BatchSizeReport, model: torch.nn.Module, strategy: str, world_size: int,
               usable_bytes: int, plan: Callable[[int], BatchSizeReport]) -> BatchSizeReport:
    """The per-rank report under ``strategy`` ("compare": the one with the largest per-rank
    batch), with every strategy's row; ``plan(bytes)`` is the one-rank plan under that memory."""
    split = report.memory_split
    if split is None:
        raise RuntimeError("find_batch traced no memory split to plan ranks from; this is a bug "
                           "in batchwidgets; please report it with the report above")
    model_shapes = shapes(model)
    at_step = dataclasses.replace(split, gradients_bytes=model_shapes.gradients_bytes)
    rows, reports = [], {}
    for name in STRATEGIES:
        rank = per_rank(name, world_size, split, model_shapes)
        shift = _states(split) - _states(rank)
        one = plan(usable_bytes + shift)
        if _states(per_rank(name, world_size, at_step, model_shapes)) > usable_bytes:
            one = dataclasses.replace(one, max_batch_size=0, target_band=(0, 0))  # at the step
        reports[name] = _shifted(one, rank, shift, usable_bytes)
        rows.append(ParallelPlan(
            parallel=name, world_size=world_size, max_batch_size=one.max_batch_size,
            parameters_bytes=rank.parameters_bytes, gradients_bytes=rank.gradients_bytes,
            optimizer_bytes=rank.optimizer_bytes, communication_bytes=rank.communication_bytes))
    chosen = strategy if strategy != "compare" else max(
        STRATEGIES, key=lambda name: (reports[name].max_batch_size, -STRATEGIES.index(name)))
    return dataclasses.replace(reports[chosen], parallel=chosen, world_size=world_size,
                               parallel_plans=tuple(rows))


def _shifted(report: BatchSizeReport, rank: MemorySplit, shift: int,
             usable_bytes: int) -> BatchSizeReport:
    """The one-rank report under shifted memory, put back on the rank's terms: its limit, its
    peaks (the trace's less what the rank does not hold), its memory split."""
    peaks = tuple((size, peak - shift) for size, peak in report.target_peaks)
    return dataclasses.replace(report, limit_bytes=usable_bytes, target_peaks=peaks,
                               memory_split=rank)
