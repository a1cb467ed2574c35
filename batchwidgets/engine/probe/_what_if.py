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
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.utils.checkpoint

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport, WhatIf
from .._grads import is_sharded
from .._unsharded import shallow_replica
from ..memory import OpTrace, PeakModel
from ._nothing_fits import checkpoints

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


def checkpoint_candidates(model: torch.nn.Module) -> dict[str, str]:
    """The submodules a user would checkpoint, by name, with their class names: those that hold
    parameters. A parameter-free activation or pool alone (a ReLU, a MaxPool2d) saves its input
    for backward, but checkpointing it by itself is a choice nobody makes (issue 41). None
    where the model checkpoints already: a row would suggest what is so (issue 46)."""
    if checkpoints(model):
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
    if (getattr(model, "is_gradient_checkpointing", False) or hasattr(model, "_orig_mod")
            or is_sharded(list(model.parameters()))):
        return None
    replica = shallow_replica(model)
    units = _outermost_blocks(replica)
    if len(units) < 2:
        return None
    kinds = "/".join(sorted({type(unit).__name__ for unit in units}))
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
        for unit in units:
            unit.forward = functools.partial(torch.utils.checkpoint.checkpoint, unit.forward,
                                             use_reentrant=False)
    return replica, f"checkpoint every block ({len(units)} {kinds})"


def _outermost_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries of the ModuleLists met first on each path from the root."""
    found: list[torch.nn.Module] = []
    for child in model.children():
        found += list(child) if isinstance(child, torch.nn.ModuleList) else (
            _outermost_blocks(child))
    return found


def _row(name: str, cost: str, probe: Callable[..., BatchSizeReport], **change: Any) -> WhatIf:
    try:
        with warnings.catch_warnings():  # the row's cost line says it; no warning per probe
            warnings.simplefilter("ignore", BatchwidgetsWarning)
            report = probe(**change)
    except RuntimeError as error:  # NoBatchSizeFits (a RuntimeError), or the change cannot run
        if type(error).__name__ != "NoBatchSizeFits" and "autocast" not in str(error):
            raise
        return WhatIf(name, 0, True, cost)
    top = max((a for a in report.attempts if a.fits and not a.fake), key=lambda a: a.batch_size,
              default=None)
    return WhatIf(name, report.max_batch_size, True, cost,
                  None if top is None else top.samples_per_s)


def measured(probe: Callable[..., BatchSizeReport], optimizer: torch.optim.Optimizer,
             amp: str | None, model: torch.nn.Module | None = None) -> list[WhatIf]:
    """Rows measured by probing again with the change: mixed precision, SGD, foreach=False,
    ``model`` with every block checkpointed. ``probe(**change)`` runs find_batch with the same
    arguments and the change."""
    rows = []
    replica = checkpointed(model) if model is not None else None
    if replica is not None:
        rows.append(_row(replica[1], COSTS["every block"], probe, model=replica[0]))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    half = all(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if amp is None and not half:  # weights already in half precision compute in it
        rows += [_row("bf16", COSTS["bf16"], probe, amp="bf16"),
                 _row("fp16", COSTS["fp16"], probe, amp="fp16")]
    if not isinstance(optimizer, torch.optim.SGD) or optimizer.defaults.get("momentum"):
        lr = optimizer.param_groups[0].get("lr", 1e-3)
        rows.append(_row("SGD without momentum (no optimizer state)", COSTS["sgd"], probe,
                         optimizer=torch.optim.SGD(params, lr=lr)))
    if "foreach" in optimizer.defaults and optimizer.defaults.get("foreach") is not False:
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted
                    and k not in ("foreach", "fused", "differentiable")}
        try:
            sequential = type(optimizer)(params, **defaults, foreach=False)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            sequential = None
        if sequential is not None:
            rows.append(_row("foreach=False", COSTS["foreach"], probe, optimizer=sequential))
    return rows


def for_target(model: PeakModel | None, found: int, usable_bytes: int,
               probe: Callable[..., BatchSizeReport] | None, optimizer: torch.optim.Optimizer,
               amp: str | None, *, multiple_of: int, ceiling: int,
               modules: Mapping[str, str], module: torch.nn.Module | None = None
               ) -> tuple[WhatIf, ...]:
    """A target plan's what-ifs, every row predicted (nothing runs on the target): the per-op
    model's rows against the tensor bytes at the target's answer ``found``, and each change
    (bf16, fp16, SGD, foreach=False, ``module`` with every block checkpointed) planned again
    for the target by ``probe(**change)``, on fake tensors as the plan was, so a meta model is
    never materialised or changed. ``probe`` None (``what_if=False``): the per-op rows alone."""
    planned = [dataclasses.replace(row, measured=False, samples_per_s=None)
               for row in measured(probe, optimizer, amp, module)] if probe is not None else []
    rows = []
    if model is not None:
        # a change planned again for the target (replayed through its allocator) replaces the
        # per-op model's guess at the same change: one row a name
        rows += [row for row in predicted(model, model.peak_bytes(found),
                                          multiple_of=multiple_of, ceiling=ceiling,
                                          modules=modules)
                 if row.name not in {other.name for other in planned}]
        rows += expandable(model, usable_bytes, found, multiple_of=multiple_of, ceiling=ceiling)
    return tuple(rows + planned)
