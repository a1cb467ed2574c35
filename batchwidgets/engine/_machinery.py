"""The training machinery a step leaves half way when it stops at an op (out of memory in
forward, in backward mid-reduction, in the optimizer step): DistributedDataParallel's reducer and
its flags, FSDP2's per-unit training state, hooks' state and unsharded parameters. Put back by the
state guard (engine/_state.py, ``TrainingState``) before the tensors, so the model trains its next
steps as if the probe had never run.

Usage:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> machinery = Machinery(model)   # no wrapper: nothing to put back
    >>> machinery.reset(); machinery.restore()
"""

from __future__ import annotations

from typing import Any

import torch

# NOTE [ A reducer left mid-reduction ]
# DDP's C++ reducer expects every backward that its forward prepared to finish: a backward that
# stopped (out of memory between two buckets' all-reduces) leaves it "unfinalized", and the next
# forward raises "Expected to have finished reduction in the prior iteration" for ever after. No
# public API resets it: ``Reducer._reset_state()`` (private; what DDP's own
# ``_update_process_group`` calls) clears the flags, and is called only when
# ``Reducer._check_reducer_finalized()`` (private too, what DDP's ``_check_reducer_finalized``
# wraps) says it is not finalized. The reset also has the reducer rebuild its buckets after the
# next backward, in the order that backward makes its gradients, which is the order they were
# built in (a broadcast of the order, on every rank: in a job every rank resets together, as
# every rank's backward stopped; a rank that fails alone never reaches the reducer, NOTE [ A rank
# that runs out alone ] in probe/_ranks.py). DDP's own Python flags (``require_forward_param_sync``,
# which a forward under ``no_sync()`` clears and which decides whether the next forward
# broadcasts the buffers) are put back as they were. Pinned to torch 2.13 by
# tests/test_device_disagrees.py.
#
# NOTE [ An FSDP2 unit left mid-step ]
# FSDP2 (``fully_shard``) keeps per unit a training state (FORWARD, PRE_BACKWARD, ...), the
# unsharded parameters registered in the module while it computes, pending all-gathers and
# reduce-scatters, and on the root the iteration's bookkeeping (the final callback queued, the
# forward root). A step stopped in between leaves them so: the next forward mixes sharded and
# unsharded parameters ("got mixed torch.Tensor and DTensor"). ``FSDPModule.reset_iter_state()``
# (public since torch 2.12, on the root) waits on what is in flight, reshards every unit and
# clears the bookkeeping. It leaves the unsharded gradients the stopped backward made (autograd
# accumulates into ``FSDPParam._unsharded_param.grad`` and ``unsharded_accumulated_grad``,
# private) in place, where the next backward would add to them: they are cleared here. Where
# ``reset_iter_state`` is missing (older torch) each unit's ``reshard()`` is the fallback.


def _ddps(model: Any) -> list[Any]:
    ddp = torch.nn.parallel.DistributedDataParallel
    return [m for m in model.modules() if isinstance(m, ddp)] if isinstance(
        model, torch.nn.Module) else []


def _fsdp_units(model: Any) -> list[Any]:
    """The FSDP2 units in ``model`` (modules ``fully_shard`` made FSDPModules)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if hasattr(m, "_get_fsdp_state") and hasattr(m, "reshard")]


_DDP_FLAGS = ("require_forward_param_sync", "require_backward_grad_sync")


class Machinery:
    """What the wrappers in ``model`` (DDP, FSDP2) hold beside its tensors: reset after a step
    that stopped half way (``reset``), and their flags put back (``restore``)."""

    def __init__(self, model: Any) -> None:
        self.ddps = [(ddp, {name: getattr(ddp, name) for name in _DDP_FLAGS
                            if hasattr(ddp, name)}) for ddp in _ddps(model)]
        self.units = _fsdp_units(model)

    def reset(self) -> None:
        """The wrappers' machinery back to between two steps (NOTE [ A reducer left
        mid-reduction ], NOTE [ An FSDP2 unit left mid-step ])."""
        for ddp, _ in self.ddps:
            _reset_reducer(ddp)
        if self.units:
            _reset_fsdp(self.units)

    def restore(self) -> None:
        for ddp, flags in self.ddps:
            for name, value in flags.items():
                setattr(ddp, name, value)


def _reset_reducer(ddp: Any) -> None:
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_reset_state"):
        return
    try:
        reducer._check_reducer_finalized()
    except RuntimeError:  # a backward it prepared did not finish
        reducer._reset_state()


def _reset_fsdp(units: list[Any]) -> None:
    roots = [unit for unit in units if getattr(unit._get_fsdp_state(), "_is_root", None) is True]
    for root in roots:
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
    for unit in units:
        state = unit._get_fsdp_state()
        if not roots or not hasattr(units[0], "reset_iter_state"):
            unit.reshard()
        for group in getattr(state, "_fsdp_param_groups", ()) or ():
            for param in getattr(group, "fsdp_params", ()):
                if getattr(param, "unsharded_accumulated_grad", None) is not None:
                    param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    unsharded.grad = None
