"""One rank of FSDP2, traced: a meta copy of the user's model, ``fully_shard`` on each block and
the root over a fake process group's mesh, its shards fake tensors; the world the fake trials
of ``parallel="fsdp"`` start from (NOTE [ One FSDP2 rank, traced ])."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ._fakes import fully_shard_function, in_fake_mode
from ._parallel import blocks

# NOTE [ One FSDP2 rank, traced ]
# parallel="fsdp" traces what one rank of the job would run: the user's model is copied with its
# parameters and buffers on the meta device (nothing of it materialised, the user's module only
# read), fully_shard (FSDP2) wraps each block (the modules of each ModuleList, else the top-level
# children) and then the root, over a 1-D mesh of the fake process group (NOTE [ A fake process
# group, behind one adapter ] in _fakes.py), and the copy is materialised as fake tensors:
# each parameter a DTensor around this rank's padded 1/N shard. The optimizer is a shallow copy
# of the user's over those shards, its state empty (each trial's first step makes it; the second
# step holds it, as the real job's does). The training step then runs as it would on rank 0:
# FSDP2's own all-gather buffers before each block, their frees after it (resharded after
# forward, the root's kept to backward), the unsharded gradients reduce-scattered into sharded
# ones, the optimizer stepping over the shards, every storage counted by the same tracker as a
# real job's (a DTensor's bytes are its local shard's). So the plan needs no rule for FSDP2: its
# buffers, prefetch and the optimizer step's temporaries over a shard are in the trace.


class ShardingError(ValueError):
    """fully_shard cannot wrap the model (the message says why, and the fix)."""


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device: the same
    classes, hooks and attributes, nothing of the weights copied."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                             requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def sharded_units(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of the modules fully_shard wrapped in ``model`` ("" the root), in module
    order: fully_shard makes each one's class FSDP<Class>(FSDPModule, Class)."""
    return tuple(name for name, module in model.named_modules()
                 if any(base.__name__ == "FSDPModule" for base in type(module).__mro__))


def shard_copy(model: torch.nn.Module, mesh: Any, units: tuple[str, ...] = ()) -> torch.nn.Module:
    """``model``'s meta copy under ``fully_shard`` per block and at the root (still on meta);
    ``units``: the modules to wrap instead, by name (the user's own wrapping), deepest first."""
    fully_shard = fully_shard_function()
    sharded = _meta_copy(model)
    named = dict(sharded.named_modules())
    wrapped = ([named[name] for name in sorted(units, key=lambda n: -n.count(".") - bool(n))
                if name in named and name] if units else blocks(sharded))
    try:
        for unit in wrapped:
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
    except Exception as error:
        raise ShardingError(
            f"model should be one that FSDP2's fully_shard can wrap (each block, then the "
            f"root), but fully_shard raised {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}; plan with parallel='zero3' "
            f"(the same sharding by its published rules) instead.") from error
    return sharded


# NOTE [ FSDP2's setup before the first trial ]
# FSDP2 sets a model up at its first forward (FSDPState._lazy_init: which state is the root, the
# parameters' views) and each unit's unsharded parameters at its first all-gather (an empty
# tensor and views per parameter; later all-gathers grow the same storages back from 0 bytes),
# once for the sharded copy that every trial reuses. Inside the first trial that added 84 ops of
# a small Llama's 1,895 that the second lacked, so the two sizes' op sequences differed, no
# per-op model was fitted, and the plan searched by measured peaks: 7, 6 and 7 per rank on 2, 4
# and 8 GPUs, predictions 90 MiB over the traced step. So the copy is set up before the trials:
# the root's lazy init (a private method of FSDP2's, torch 2.4-2.13; skipped without it), then
# every unit gathered and freed again (FSDPModule.unshard and reshard).
def _set_up(sharded: torch.nn.Module) -> None:
    state = getattr(sharded, "_get_fsdp_state", None)
    lazy_init = getattr(state(), "_lazy_init", None) if callable(state) else None
    if callable(lazy_init):
        lazy_init()
    for module in sharded.modules():
        if callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard",
                                                                           None)):
            module.unshard()
            module.reshard()


class ShardedWorld:
    """The fake trials' world under FSDP2 (the interface of ``FakeWorld``): one rank's sharded
    model and optimizer over fake tensors, each trial from an empty optimizer state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 mode: FakeTensorMode, mesh: Any, units: tuple[str, ...] = ()) -> None:
        sharded = shard_copy(model, mesh, units)
        self.mode = mode
        names = {id(p): name for name, p in model.named_parameters()}
        with mode:
            sharded.to_empty(device="cpu")
            _set_up(sharded)  # NOTE [ FSDP2's setup before the first trial ]
        self.model = sharded
        own = dict(sharded.named_parameters())
        self.params = list(own.values())
        self.optimizer = copy.copy(optimizer)
        self.optimizer.param_groups = [
            dict(group, params=[own[names[id(p)]] for p in group["params"] if id(p) in names])
            for group in optimizer.param_groups]
        self.optimizer.state = collections.defaultdict(dict)
        self.restore()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Nothing to swap: the sharded copy holds its fake shards itself."""
        yield

    def tensors(self) -> list:
        """What the step holds before it starts: shards, buffers, gradients, optimizer state."""
        return [*self.params, *self.model.buffers(),
                *[p.grad for p in self.params if p.grad is not None],
                *[dict(state) for state in self.optimizer.state.values()]]

    def marked(self) -> list[torch.Tensor]:
        return [*self.params, *self.model.buffers()]

    def restore(self) -> None:
        for param in self.params:
            param.grad = None
        self.optimizer.state.clear()

    def active(self) -> contextlib.AbstractContextManager:
        return in_fake_mode(self.mode)  # the cycle collector paused, as FakeWorld's
