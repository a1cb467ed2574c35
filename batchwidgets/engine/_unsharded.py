"""A plain replica of a model sharded by FSDP2 (``fully_shard``), holding its full weights, for
what needs every weight in one process at once: ``measure_noise``'s per-example gradients and
``NoiseTracker.measure``'s split batches.

Usage (on every rank, as the gathers are collectives):
    >>> replica = unsharded(model)                                         # doctest: +SKIP
    >>> loss = loss_fn(replica(x), y)   # no all-gather, no reduce-scatter  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ._grads import is_sharded

# NOTE [ An unsharded replica ]
# Per-example gradients (vmap over functional_call, or one autograd.grad per example) need every
# weight at once, and FSDP2's own forward cannot give them: its hooks all-gather and reshard
# around each unit, issue collectives inside vmap, and reduce-scatter every gradient (averaged
# over the ranks, so no longer one example's). So the measurement runs on a replica: each module
# copied shallowly into its original class (fully_shard makes FSDP<Class>(FSDPModule, Class)),
# its parameters the full tensors gathered from the shards (DTensor.full_tensor, an all-gather in
# module order, the same on every rank), its buffers and other attributes shared, and FSDP's
# forward hooks left out (the user's own hooks stay). The user's model, its shards and its hooks
# are not touched. It costs the full weights once more on each rank, at full precision (a
# MixedPrecisionPolicy's param_dtype is the training's compute, not the weights').


def unsharded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` itself when its parameters are not sharded, else a replica with full weights
    (NOTE [ An unsharded replica ]); call it on every rank."""
    if not is_sharded(list(model.parameters())):
        return model
    gathered: dict[int, torch.nn.Parameter] = {}
    replicas: dict[int, torch.nn.Module] = {}

    def full(param: torch.Tensor) -> torch.nn.Parameter:
        if id(param) not in gathered:
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            gathered[id(param)] = torch.nn.Parameter(tensor.detach(),
                                                     requires_grad=param.requires_grad)
        return gathered[id(param)]

    def replica(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in replicas:  # a module used twice stays one module
            return replicas[id(module)]
        cls = _original_class(type(module))
        copy = cls.__new__(cls)
        copy.__dict__.update(module.__dict__)
        replicas[id(module)] = copy
        copy.__dict__["_parameters"] = {name: None if p is None else full(p)
                                        for name, p in module._parameters.items()}
        copy.__dict__["_modules"] = {name: None if m is None else replica(m)
                                     for name, m in module._modules.items()}
        _drop_fsdp_hooks(copy)
        return copy

    return replica(model)


def _original_class(cls: type) -> type:
    """The class fully_shard subclassed: FSDP<Class> has bases (FSDPModule, Class)."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1]
    return cls


def _is_fsdp_hook(hook: Any) -> bool:
    """FSDP2's forward hooks are FSDPState's bound methods, or functools.wraps of them."""
    owner = getattr(getattr(hook, "__wrapped__", hook), "__self__", None)
    return type(owner).__name__ == "FSDPState"


def _drop_fsdp_hooks(module: torch.nn.Module) -> None:
    """New hook dicts on the replica without FSDP's (its keyword and always-called flags too)."""
    for hooks, flags in (("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
                         ("_forward_hooks", ("_forward_hooks_with_kwargs",
                                             "_forward_hooks_always_called"))):
        kept = type(getattr(module, hooks))(
            (key, hook) for key, hook in getattr(module, hooks).items()
            if not _is_fsdp_hook(hook))
        module.__dict__[hooks] = kept
        for name in flags:
            if name in module.__dict__:
                module.__dict__[name] = {key: value for key, value
                                         in module.__dict__[name].items() if key in kept}
