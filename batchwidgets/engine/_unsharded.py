"""A plain replica of a model sharded by FSDP2 (``fully_shard``), holding its full weights, for
what needs every weight in one process at once: ``measure_noise``'s per-example gradients and
``NoiseTracker.measure``'s split batches.

Usage (on every rank, as the gathers are collectives):
    >>> replica = unsharded(model)                                         # doctest: +SKIP
    >>> loss = loss_fn(replica(x), y)   # no all-gather, no reduce-scatter  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
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
    return _replica(model, lambda param: param.full_tensor() if hasattr(param, "full_tensor")
                    else param)[0]


def shallow_replica(model: torch.nn.Module) -> torch.nn.Module:
    """A replica of ``model`` over the same parameter and buffer objects, each module a new
    object with registries of its own, so attributes set on it (a checkpointed forward) and
    tensors swapped into it leave ``model`` as it is; training it trains ``model``'s weights."""
    return _replica(model, None)[0]


def meta_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """A sharded model's replica on the meta device, of its full shapes (a DTensor's shape is the
    global one), and its optimizer over the replica, its state on meta too: what a plan for a
    target traces (fake tensors need shapes only). No collective, nothing copied."""
    replica, twins = _replica(model, lambda param: torch.empty(param.shape, dtype=param.dtype,
                                                               device="meta"))
    if optimizer is None:
        return replica, None
    return replica, optimizer_twin(optimizer, twins, _meta_state)


def optimizer_twin(optimizer: torch.optim.Optimizer, twins: dict[int, torch.nn.Parameter],
                   state_twin: Callable[[Any], Any]) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` over ``twins`` (a parameter's twin by the original's
    id; one without a twin stays itself), each state value ``state_twin(value)``: the same
    class, hyperparameters and hooks, so its step runs the same ops. A host scalar (Adam's
    ``step``, ``is_host_scalar``) must keep its number, as the step reads it back."""
    twin = copy.copy(optimizer)
    twin.param_groups = [dict(group, params=[twins.get(id(p), p) for p in group["params"]])
                         for group in optimizer.param_groups]
    twin.state = collections.defaultdict(dict)
    for param, state in optimizer.state.items():
        twin.state[twins.get(id(param), param)] = {key: state_twin(value)
                                                   for key, value in state.items()}
    return twin


def is_host_scalar(value: Any) -> bool:
    """A one-element tensor in host memory (Adam's ``step``), not a shard of one."""
    return (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta
            and value.device.type == "cpu" and not hasattr(value, "full_tensor"))


def _meta_state(value: Any) -> Any:
    """An optimizer state value on meta at its global shape; a host scalar stays itself."""
    if not isinstance(value, torch.Tensor) or is_host_scalar(value):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _replica(model: torch.nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] | None
             ) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter]]:
    """The replica of ``model`` whose parameters are ``whole(param)``, each once, in module
    order (None: the parameters themselves); and each parameter's replica by the original's
    id."""
    gathered: dict[int, torch.nn.Parameter] = {}
    replicas: dict[int, torch.nn.Module] = {}

    def full(param: torch.Tensor) -> torch.nn.Parameter:
        if whole is None:
            return param
        if id(param) not in gathered:
            gathered[id(param)] = torch.nn.Parameter(whole(param).detach(),
                                                     requires_grad=param.requires_grad)
        return gathered[id(param)]

    def replica(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in replicas:  # a module used twice stays one module
            return replicas[id(module)]
        cls = _original_class(type(module))
        clone = cls.__new__(cls)
        clone.__dict__.update({key: value for key, value in module.__dict__.items()
                               if not key.startswith(_COMPOSABLE)})
        replicas[id(module)] = clone
        clone.__dict__["_parameters"] = {name: None if p is None else full(p)
                                         for name, p in module._parameters.items()}
        clone.__dict__["_buffers"] = dict(module._buffers)  # the same tensors
        clone.__dict__["_modules"] = {name: None if m is None else replica(m)
                                      for name, m in module._modules.items()}
        _drop_fsdp_hooks(clone)
        return clone

    return replica(model), gathered


# fully_shard's registry and state in a module's __dict__ (torch.distributed._composable.contract):
# a replica is no composable module, so fully_shard can wrap it (or its meta copy) anew
_COMPOSABLE = "__composable_api_state_key"


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
                flags_of = module.__dict__[name]  # an OrderedDict: hooks keep weak references
                module.__dict__[name] = type(flags_of)(
                    (key, value) for key, value in flags_of.items() if key in kept)
