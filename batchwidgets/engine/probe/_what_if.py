"""What-ifs: the largest batch under each change the user could make, predicted from the per-op
model where the trace says what the change removes, measured (a probe with the change) where it
does not.

Usage:
    >>> from batchwidgets.engine.memory import OpTrace, PeakModel
    >>> t2 = OpTrace(["step"], [300], ["optimizer step"], parts={"optimizer": [200]})
    >>> t4 = OpTrace(["step"], [500], ["optimizer step"], parts={"optimizer": [200]})
    >>> [(r.name, r.max_batch_size) for r in predicted(PeakModel.fit(t2, 2, t4, 4), 1000,
    ...                                                multiple_of=1, ceiling=10**6, modules=())]
    [('SGD without momentum (no optimizer state)', 11)]
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from ...results import BatchSizeReport, WhatIf
from .._grads import is_sharded
from .._unsharded import shallow_replica
from ..memory import OpTrace, PeakModel
from ._setup import ProbeSetup, Traced

CHECKPOINT_ROWS = 3  # activation checkpointing of the blocks that save the most
COSTS = {
    "sgd": "no optimizer state; plain SGD usually needs a retuned learning rate and more steps "
           "than Adam to reach the same loss",
    "checkpoint": "recomputes the block's forward during backward: about one more forward of it "
                  "per step (+20-35% step time for a large block), same numerics",
    "bf16": "autocast to bfloat16: smaller activations, fp32 weights kept; 8-bit mantissa, "
            "usually fine for training; slow on CPUs without bf16 instructions",
    "fp16": "autocast to float16 with a GradScaler: smaller activations; loss scaling needed, "
            "values above 65504 overflow",
    "expandable": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts): "
                  "segments grow in place, so rounding and fragmentation stop costing memory; "
                  "an upper bound, since workspaces still need room",
    "every block": "recomputes every block's forward during backward: about one more forward "
                   "per step (+20-35% step time), same numerics; on a Hugging Face model "
                   "model.gradient_checkpointing_enable(), else torch.utils.checkpoint."
                   "checkpoint(block, ..., use_reentrant=False) around each block",
    "foreach": "foreach=False: the optimizer steps one parameter at a time: less temporary memory "
               "in the step, a slower step (a kernel per parameter)",
    "output": "a loop that frees the model's output before backward (del outputs, or the "
              "Hugging Face Trainer's compute_loss); same numerics, nothing to log from it",
}
FREED_OUTPUT = "keep_output=False (frees the output before backward)"


def _largest(small: OpTrace, large: OpTrace, model: PeakModel, limit_bytes: int,
             multiple_of: int, ceiling: int) -> int:
    changed = PeakModel.fit(small, model.batch_small, large, model.batch_large)
    return 0 if changed is None else changed.largest_batch_size(
        limit_bytes, multiple_of=multiple_of, ceiling=ceiling)


def _checkpointed(trace: OpTrace, module: str) -> OpTrace:
    """Activation checkpointing of ``module``: what it saved is gone, except while its own
    backward recomputes it."""
    part = trace.parts.get(f"activation of {module}", ())
    live = [value - (0 if where.startswith(f"backward of {module}") else part[i])
            for i, (value, where) in enumerate(zip(trace.live, trace.where))]
    return OpTrace(names=trace.names, live=live, where=trace.where)


def checkpoint_candidates(setup: ProbeSetup, model: torch.nn.Module | None) -> dict[str, str]:
    """The submodules a user would checkpoint, by name, with their class names: those that hold
    parameters. A parameter-free activation or pool alone (a ReLU, a MaxPool2d) saves its input
    for backward, but checkpointing it by itself is a choice nobody makes (issue 41). None
    where the model checkpoints already: a row would suggest what is so (issue 46)."""
    if model is None or setup.checkpointing:
        return {}
    return {name: type(module).__name__ for name, module in model.named_modules()
            if name and next(module.parameters(), None) is not None}


def predicted(model: PeakModel, limit_bytes: int, *, multiple_of: int, ceiling: int,
              modules: Collection[str] | Mapping[str, str]) -> list[WhatIf]:
    """Rows predicted from the per-op model: no optimizer state (SGD without momentum), and
    activation checkpointing of each of the modules that save the most for backward (only
    ``modules``, the model's own submodules, qualify; a mapping gives their class names)."""
    small, large = model.small, model.large
    rows = freed_output(model, limit_bytes, multiple_of=multiple_of, ceiling=ceiling)
    if any(large.parts.get("optimizer", ())):
        rows.append(WhatIf("SGD without momentum (no optimizer state)",
                           _largest(small.without("optimizer"), large.without("optimizer"), model,
                                    limit_bytes, multiple_of, ceiling), False, COSTS["sgd"]))
    blocks = [part for part in large.parts  # largest first (see TracingTracker.record_parts)
              if part.startswith("activation of ") and part in small.parts
              and part.removeprefix("activation of ") in modules][:CHECKPOINT_ROWS]
    for part in blocks:
        module = part.removeprefix("activation of ")
        kind = f" ({modules[module]})" if isinstance(modules, Mapping) else ""
        rows.append(WhatIf(f"checkpoint {module}{kind}",
                           _largest(_checkpointed(small, module), _checkpointed(large, module),
                                    model, limit_bytes, multiple_of, ceiling),
                           False, COSTS["checkpoint"]))
    return rows


def freed_output(model: PeakModel, limit_bytes: int, *, multiple_of: int,
                 ceiling: int) -> list[WhatIf]:
    """The loop that frees the output before backward, where the step kept it: the trace
    without what only the loop's variables held (NOTE [ The loop the step models ])."""
    small, large = model.small, model.large
    if not any(large.parts.get("output", ())) or "output" not in small.parts:
        return []
    return [WhatIf(FREED_OUTPUT, _largest(small.without("output"), large.without("output"),
                                          model, limit_bytes, multiple_of, ceiling),
                   False, COSTS["output"])]


def expandable(model: PeakModel, limit_bytes: int, found: int, *, multiple_of: int,
               ceiling: int) -> list[WhatIf]:
    """On CUDA: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the reserved memory
    stays close to the tensors' own bytes; a row when that would fit more than ``found``."""
    largest = model.largest_batch_size(limit_bytes, multiple_of=multiple_of, ceiling=ceiling)
    if largest <= found:
        return []
    return [WhatIf("expandable_segments", largest, False, COSTS["expandable"])]


# NOTE [ Checkpointing every block ]
# The per-op rows checkpoint one module at a time, those that save the most; what users do is
# checkpoint every block of the model (gradient_checkpointing_enable() on a Hugging Face model),
# and what that frees is not a sum of per-module parts (each block still saves its input, and
# its backward recomputes it). So that row is probed (or, for a target, planned) again on a
# replica of the model: the same parameter and buffer objects, new module objects, so the
# user's modules are not touched. The blocks are the outermost ModuleLists' entries (a model
# without two of them gets no row). A Hugging Face model that supports it is checkpointed by
# its own gradient_checkpointing_enable() with its defaults, as the user would call it
# (reentrant in transformers 4.46, non-reentrant in 5; use_cache off in a config of the
# replica's own, as HF turns it off when checkpointing), any other by each block's forward
# through torch.utils.checkpoint (non-reentrant). A model that checkpoints already gets no row,
# nor does one sharded by FSDP2 (its replica would lose the hooks that gather the shards) or
# compiled by torch.compile (its compiled forward is bound to the original modules).
def checkpointed(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """A replica of ``model`` with every block checkpointed, and its row's name; None without
    two blocks, or when ``model`` is checkpointed already (NOTE [ Checkpointing every block ])."""
    units = _outermost_blocks(model)
    if (len(units) < 2 or getattr(model, "is_gradient_checkpointing", False)
            or hasattr(model, "_orig_mod") or is_sharded(list(model.parameters()))):
        return None
    kinds = "/".join(sorted({type(model.get_submodule(unit)).__name__ for unit in units}))
    replica = shallow_replica(model)
    if getattr(replica, "supports_gradient_checkpointing", False):
        config = getattr(replica, "config", None)
        if getattr(config, "use_cache", False):
            quiet = copy.copy(config)
            quiet.use_cache = False
            for module in replica.modules():
                if module.__dict__.get("config") is config:
                    module.__dict__["config"] = quiet
        with warnings.catch_warnings():  # as the user would call it (transformers 5 renamed it)
            warnings.simplefilter("ignore")
            getattr(replica, "activation_checkpointing_enable",
                    replica.gradient_checkpointing_enable)()
    else:
        for name in units:
            unit = replica.get_submodule(name)
            unit.forward = functools.partial(torch.utils.checkpoint.checkpoint, unit.forward,
                                             use_reentrant=False)
    return replica, f"checkpoint every block ({len(units)} {kinds})"


def _outermost_blocks(model: torch.nn.Module, prefix: str = "") -> list[str]:
    """The names of the entries of the ModuleLists met first on each path from the root."""
    found: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            found += [f"{prefix}{name}.{index}" for index in range(len(child))]
        else:
            found += _outermost_blocks(child, f"{prefix}{name}.")
    return found


@dataclass(frozen=True)
class Change:
    """One change the user could make, probed (or, for a target, planned) again with
    ``what_if=True``: its row's name and cost, and what it changes in the call (the keywords of
    ``ProbeSetup.with_change``)."""

    name: str
    cost: str
    change: Mapping[str, Any]


def changes(setup: ProbeSetup, traced: Traced) -> list[Change]:
    """The changes to probe again (``what_if=True``, the model form): every block checkpointed,
    mixed precision, SGD, foreach=False, each where it is not so already. A target's plan for
    one GPU only: a plan for N GPUs has its strategies' rows instead, a stopped one none."""
    if not setup.what_if or setup.model is None:
        return []
    if setup.target is not None and (setup.parallel is not None or traced.stopped):
        return []
    found = []
    replica = checkpointed(setup.model)
    if replica is not None:
        found.append(Change(replica[1], COSTS["every block"],
                            {"model": replica[0], "checkpointing": True}))
    optimizer = setup.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    half = all(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if setup.amp is None and not half:  # weights already in half precision compute in it
        found += [Change("bf16", COSTS["bf16"], {"amp": "bf16"}),
                  Change("fp16", COSTS["fp16"], {"amp": "fp16"})]
    if not isinstance(optimizer, torch.optim.SGD) or optimizer.defaults.get("momentum"):
        lr = optimizer.param_groups[0].get("lr", 1e-3)
        found.append(Change("SGD without momentum (no optimizer state)", COSTS["sgd"],
                            {"optimizer": torch.optim.SGD(params, lr=lr)}))
    if "foreach" in optimizer.defaults and optimizer.defaults.get("foreach") is not False:
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted
                    and k not in ("foreach", "fused", "differentiable")}
        try:
            sequential = type(optimizer)(params, **defaults, foreach=False)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            sequential = None
        if sequential is not None:
            found.append(Change("foreach=False", COSTS["foreach"], {"optimizer": sequential}))
    return found


def with_rows(setup: ProbeSetup, traced: Traced, report: BatchSizeReport,
              tried: Sequence[tuple[Change, BatchSizeReport | None]]) -> BatchSizeReport:
    """``report`` with its what-if rows: the per-op model's, predicted where it was fitted, and
    each change of ``changes`` with the report of the probe that tried it (None: nothing fitted,
    or the change cannot run). A target's rows are all predicted (nothing runs on the target):
    a change planned again replaces the per-op model's guess at the same change."""
    if setup.target is None:
        rows = _predicted_here(setup, traced)
        rows += [_row(change, found, measured=True) for change, found in tried]
        return dataclasses.replace(report, what_if=tuple(rows)) if rows else report
    if traced.stopped or setup.model is None or setup.parallel is not None:
        return report
    planned = [_row(change, found, measured=False) for change, found in tried]
    rows = []
    model, found = traced.model, report.max_batch_size
    if model is not None:
        rows += [row for row in predicted(model, model.peak_bytes(found),
                                          multiple_of=setup.multiple_of, ceiling=setup.ceiling,
                                          modules=checkpoint_candidates(setup, setup.model))
                 if row.name not in {other.name for other in planned}]
        rows += expandable(model, setup.target[1], found, multiple_of=setup.multiple_of,
                           ceiling=setup.ceiling)
    return dataclasses.replace(report, what_if=tuple(rows + planned))


def _row(change: Change, report: BatchSizeReport | None, measured: bool) -> WhatIf:
    if report is None:
        return WhatIf(change.name, 0, measured, change.cost)
    top = max((a for a in report.attempts if a.fits and not a.fake), key=lambda a: a.batch_size,
              default=None)
    speed = None if top is None or not measured else top.samples_per_s
    return WhatIf(change.name, report.max_batch_size, measured, change.cost, speed)


def _predicted_here(setup: ProbeSetup, traced: Traced) -> list[WhatIf]:
    """The rows the per-op model predicts on this device, where it was fitted."""
    if traced.model is None or traced.limit_bytes is None:
        return []
    modules = checkpoint_candidates(setup, setup.owner)
    found = traced.report.max_batch_size
    # On CUDA the tensors' bytes are not what runs out: the boundary found says where, in
    # tensor bytes, the reserved memory ran out, and the rows are predicted against that. So
    # too where the device ran out below the limit (the limit then lowered to the live bytes of
    # its failure, often taken early in a step): a change that only frees memory never fits
    # fewer than the answer, so the rows' limit is at least what the answer's step needs.
    answer_bytes = traced.model.peak_bytes(found) if found else 0
    row_limit = (answer_bytes if traced.replays and found
                 else max(traced.limit_bytes - traced.overhead_bytes, answer_bytes))
    rows = predicted(traced.model, row_limit, multiple_of=setup.multiple_of,
                     ceiling=setup.ceiling, modules=modules)
    if traced.replays:  # the allocator's segments and rounding gone: tensors and workspaces
        rows += expandable(traced.model, traced.limit_bytes - traced.unseen_bytes,
                           found, multiple_of=setup.multiple_of, ceiling=setup.ceiling)
    return rows
