"""What-ifs: the largest batch under each change the user could make, predicted from the per-op
model where the trace says what the change removes, measured (a probe with the change) where it
does not.

Usage:
    >>> from batchwidgets.engine._trace import OpTrace, PeakModel
    >>> t2 = OpTrace(["step"], [300], ["optimizer step"], parts={"optimizer": [200]})
    >>> t4 = OpTrace(["step"], [500], ["optimizer step"], parts={"optimizer": [200]})
    >>> [(r.name, r.max_batch_size) for r in predicted(PeakModel.fit(t2, 2, t4, 4), 1000,
    ...                                                multiple_of=1, ceiling=10**6, modules=())]
    [('SGD without momentum (no optimizer state)', 11)]
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ..._warnings import BatchwidgetsWarning
from ...results import BatchSizeReport, WhatIf
from ..memory import OpTrace, PeakModel

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
    "foreach": "foreach=False: the optimizer steps one parameter at a time: less temporary memory "
               "in the step, a slower step (a kernel per parameter)",
}


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


def predicted(model: PeakModel, limit_bytes: int, *, multiple_of: int, ceiling: int,
              modules: Collection[str] | Mapping[str, str]) -> list[WhatIf]:
    """Rows predicted from the per-op model: no optimizer state (SGD without momentum), and
    activation checkpointing of each of the modules that save the most for backward (only
    ``modules``, the model's own submodules, qualify; a mapping gives their class names)."""
    small, large = model.small, model.large
    rows = []
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


def expandable(model: PeakModel, limit_bytes: int, found: int, *, multiple_of: int,
               ceiling: int) -> list[WhatIf]:
    """On CUDA: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the reserved memory
    stays close to the tensors' own bytes; a row when that would fit more than ``found``."""
    largest = model.largest_batch_size(limit_bytes, multiple_of=multiple_of, ceiling=ceiling)
    if largest <= found:
        return []
    return [WhatIf("expandable_segments", largest, False, COSTS["expandable"])]


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
             amp: str | None) -> list[WhatIf]:
    """Rows measured by probing again with the change: mixed precision, SGD, foreach=False.
    ``probe(**change)`` runs find_batch with the same arguments and the change."""
    rows = []
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
               probe: Callable[..., BatchSizeReport], optimizer: torch.optim.Optimizer,
               amp: str | None, *, multiple_of: int, ceiling: int,
               modules: Mapping[str, str]) -> tuple[WhatIf, ...]:
    """A target plan's what-ifs, every row predicted (nothing runs on the target): the per-op
    model's rows against the tensor bytes at the target's answer ``found``, and each change
    (bf16, fp16, SGD, foreach=False) planned again for the target by ``probe(**change)``, on
    fake tensors as the plan was, so a meta model is never materialised or changed."""
    planned = [dataclasses.replace(row, measured=False, samples_per_s=None)
               for row in measured(probe, optimizer, amp)]
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
