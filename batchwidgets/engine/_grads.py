"""Gradient norms on the device, without a host sync: fused per group of one device and dtype
(as ``clip_grad_norm_`` groups them), and a GradScaler's scale to divide them by. Shared by the
noise tracker, accumulate's per-micro-batch norms and the trainer callbacks; and DDP's average
of the gradients done by hand (``average_gradients``), for the probe's steps in a job and
accumulate's remainder.

Usage:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
    >>> sum_of_squares(grad_norms(group_by_device_and_dtype([p]))).item()
    16.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)


def group_by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors in groups of one device and dtype, in first-seen order (as the fused norm of
    ``torch.nn.utils.clip_grad_norm_`` groups them)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


# NOTE [ Norms of sharded gradients ]
# Under FSDP2 (``fully_shard``) each gradient is a DTensor whose local shard holds a slice of the
# full gradient. A norm of it is a DTensor too, partial on every rank (the local shard's norm);
# the noise estimates need the full gradient's, the quantity DDP and one process give. So a
# group's norms are stacked and made full at once (one all-reduce of the squares per group, the
# same call on every rank, as the training step's own collectives), and plain tensors leave
# here: the norms never mix with the losses as DTensors.


def grad_norms(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The 2-norm of each parameter's ``.grad`` (skipping None), one fused ``_foreach_norm`` per
    group of ``group_by_device_and_dtype``; all on one device and of one dtype (float32 for
    half types and for mixed dtypes), ready to stack. No host sync. Sharded (FSDP2) gradients
    give the full gradient's norms (NOTE [ Norms of sharded gradients ])."""
    norms: list[torch.Tensor] = []
    device = None
    for group in groups:
        grads = [p.grad for p in group if p.grad is not None]
        if not grads:
            continue
        wide = torch.float32 if grads[0].dtype in _HALF else None
        if hasattr(torch, "_foreach_norm"):  # fused: one kernel for the group on a GPU
            part = list(torch._foreach_norm(grads, 2, dtype=wide))
        else:  # an old torch: one reduction per tensor
            part = [torch.linalg.vector_norm(g, dtype=wide) for g in grads]
        if hasattr(part[0], "full_tensor"):  # see NOTE [ Norms of sharded gradients ]
            part = list(torch.stack(part).full_tensor().unbind())
        if device is None:
            device = part[0].device
        elif part[0].device != device:  # a model split across devices
            part = [n.to(device) for n in part]
        norms.append(part)
    if len(norms) > 1 and len({part[0].dtype for part in norms}) > 1:
        norms = [[n.float() for n in part] for part in norms]
    return [n for part in norms for n in part]


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether the parameters are sharded DTensors (FSDP2's ``fully_shard``): their gradients
    arrive reduce-scattered, averaged over the ranks, and per-parameter hooks never see them."""
    return any(hasattr(p, "full_tensor") for p in params)


def loss_scale(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """The GradScaler's current scale (float32, on ``device``), None without one in use."""
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    return scale.to(device).float() if isinstance(scale, torch.Tensor) else None


def unscale_divisor(scaler: Any, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> torch.Tensor | None:
    """The GradScaler's scale squared while ``optimizer``'s gradients are scaled, else None."""
    scale = loss_scale(scaler, device)
    # GradScaler keeps a stage per optimizer; after unscale_(optimizer) the grads are unscaled
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    if scale is not None and getattr(state.get("stage"), "name", "") != "UNSCALED":
        return scale.square()
    return None


def sum_of_squares(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared norm of a whole gradient from its per-parameter norms (``grad_norms``):
    float32, 0-dim, on their device; two small ops, no host sync."""
    stacked = torch.stack(list(norms)).float()
    return torch.dot(stacked, stacked)


# NOTE [ DDP's average, by hand ]
# The probe's steps in a job and accumulate's remainder all-reduce the gradients themselves (DDP's
# reducer was kept out: no_sync). Every rank must reduce the same tensors in the same order, or
# gloo aborts the job on a size mismatch ("collective mismatch") and NCCL hangs or mixes
# gradients. A model under find_unused_parameters=True leaves a parameter without a gradient on
# a rank that did not use it (a mixture of experts, a branch per rank): so every parameter that
# trains takes part, with zeros where this rank has none, and ends as DDP's reducer leaves it:
# the average where any rank used it, None where no rank did (one reduce of the used flags).
def average_gradients(params: Sequence[torch.Tensor], group: Any = None) -> None:
    """The ranks' mean of every gradient of ``params``, in place (NOTE [ DDP's average, by
    hand ])."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    works = [torch.distributed.all_reduce(t, group=group, async_op=True) for t in (used, *grads)]
    for work in works:
        work.wait()
    size = torch.distributed.get_world_size(group)
    for param, grad, anyone in zip(params, grads, used.tolist()):
        if anyone:
            param.grad = grad.div_(size)  # the same tensor where this rank had one
