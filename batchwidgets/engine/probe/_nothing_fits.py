"""``NoBatchSizeFits``: not even the smallest batch trains, said with what would help, computed
from the model and the call (``Already``): nothing is suggested that is already so, the sizes are
in the user's units, and what holds the memory is named (NOTE [ Advice from the call ])."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from ...results import BatchSizeReport
from .. import memory


# NOTE [ Advice from the call ]
# What NoBatchSizeFits suggests is read from the model and the call, not a fixed list (issue 46:
# it told a bf16 model to train in bf16, and a batch of 1 to use "a smaller micro-batch"):
# * amp / bf16 weights: only where the weights are not in half precision and no autocast ran;
# * activation checkpointing: only where the model does not checkpoint already (a Hugging Face
#   model's is_gradient_checkpointing, a block whose forward goes through
#   torch.utils.checkpoint, a CheckpointWrapper), and only where the states fit, so that it is
#   the activations that do not;
# * freezing the base weights: only where most of them are trained;
# * an optimizer with less state: only where it keeps some (not plain SGD);
# * a smaller micro-batch with accumulation: only where the smallest size tried was above 1
#   (multiple_of=);
# * the states (weights, gradients, optimizer state) are counted from the parameters and the
#   optimizer: when they alone are over the limit, only the changes that shrink them are named.
# Sizes are in the units the user gave: binary (GiB, MiB) for "8GiB", "512M" or a byte count,
# decimal (GB, MB) for "8GB" and for a GPU named as its maker names it ("A100-80GB", "T4").
@dataclass(frozen=True)
class Already:
    """What the model and the call are already (plain values: the model is not kept)."""

    half: bool  # every floating-point weight in bf16/fp16
    amp: str | None
    checkpointing: bool
    trained_share: float  # of the parameters' elements, those with requires_grad
    parameters_bytes: int
    trained_bytes: int
    optimizer: str  # its class's name ("" without one)
    state_per_parameter: int  # tensors of a parameter's size the optimizer keeps (Adam: 2)
    smallest: int  # the smallest size the search may try (multiple_of)


def already(setup: Any) -> Already:
    """``Already`` from a probe's setup (``ProbeSetup``): its model, optimizer, amp, multiple_of."""
    module = setup.model if setup.model is not None else setup.owner
    params = list(module.parameters()) if module is not None else []
    floating = [p for p in params if p.is_floating_point()]
    size = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    count = sum(p.numel() for p in params)
    optimizer = setup.optimizer
    return Already(
        half=bool(floating) and all(p.dtype in (torch.bfloat16, torch.float16) for p in floating),
        amp=setup.amp, checkpointing=setup.checkpointing,
        trained_share=(sum(p.numel() for p in params if p.requires_grad) / count) if count else 1.0,
        parameters_bytes=size, trained_bytes=trained,
        optimizer=type(optimizer).__name__ if optimizer is not None else "",
        state_per_parameter=_state_per_parameter(optimizer), smallest=setup.multiple_of)


def _state_per_parameter(optimizer: Any) -> int:
    if optimizer is None:
        return 0
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum") else 0
    if isinstance(optimizer, (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)):
        return 1 if not isinstance(optimizer, torch.optim.Adadelta) else 2
    return 2  # Adam, AdamW and most others: two moments per parameter


def binary_units(said: str | int | None) -> bool:
    """Whether the user's size was binary ("8GiB", "512M", a byte count) or decimal ("8GB", a
    GPU named by its maker, "A100-80GB"): the units sizes are said back in."""
    if said is None:
        return False
    if isinstance(said, int):
        # the system whose larger unit divides it: 8GB is 8 x 1000^3, 8GiB 8 x 1024^3
        return _exact(said, 1024) >= _exact(said, 1000)
    found = re.findall(r"\d\s*([kmgt])(i?)(b?)", said.lower())
    if not found:
        return bool(re.fullmatch(r"\s*\d+\s*", said))
    _, binary, byte = found[-1]
    return bool(binary) or not byte


def _exact(n: int, base: int) -> int:
    power = 0
    while power < 4 and n % base ** (power + 1) == 0:
        power += 1
    return power


def sized(nbytes: float, binary: bool) -> str:
    """``nbytes`` in KiB..TiB or KB..TB, one decimal (bytes below one of those)."""
    step = 1024 if binary else 1000
    value, unit = float(nbytes), "B"
    for name in (("KiB", "MiB", "GiB", "TiB") if binary else ("KB", "MB", "GB", "TB")):
        if abs(value) < step:
            break
        value, unit = value / step, name
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def state_changes(call: Already, *, sharding: bool = True) -> list[str]:
    """The changes that shrink the states (weights, gradients, optimizer state), less those
    that are so already."""
    changes = []
    if not call.half:
        changes.append("weights in bf16 (model.to(torch.bfloat16))")
    if call.trained_share > 0.5:
        changes.append("freezing the base weights (requires_grad=False, as LoRA does)")
    if call.state_per_parameter:
        changes.append(f"an optimizer with less state than {call.optimizer} (SGD without "
                       f"momentum keeps none)")
    if sharding:
        changes.append("more GPUs that shard the states (FSDP, ZeRO)")
    return changes


def activation_changes(call: Already) -> list[str]:
    """The changes that shrink what one sample's step holds, less those that are so already."""
    changes = []
    if call.smallest > 1:
        changes.append(f"a smaller micro-batch than {call.smallest} (multiple_of=1) with "
                       f"gradient accumulation (batchwidgets.accumulate)")
    if call.amp is None and not call.half:
        changes.append("amp='bf16' (or 'fp16')")
    if not call.checkpointing:
        changes.append("activation checkpointing (model.gradient_checkpointing_enable() on a "
                       "Hugging Face model, torch.utils.checkpoint around each block otherwise)")
    return changes


def states_bytes(call: Already) -> tuple[int, int, int]:
    """Weights, gradients and optimizer state as the model and the optimizer make them."""
    return (call.parameters_bytes, call.trained_bytes,
            call.trained_bytes * call.state_per_parameter)


class NoBatchSizeFits(RuntimeError):
    """Even the smallest batch size ran out of memory; ``.report`` holds every attempt.
    ``call``: what the model and the call already are, so the advice leaves it out."""

    def __init__(self, report: BatchSizeReport, call: Already | None = None) -> None:
        self.report = report
        self.call = call
        if report.target is not None:
            super().__init__(_nothing_fits_on_target(report, call))
            return
        super().__init__(_nothing_fits_here(report, call))


def _nothing_fits_here(report: BatchSizeReport, call: Already | None) -> str:
    real = [a for a in report.attempts if not a.fake]  # not the fake search's
    ran_out = [a for a in real if not memory.cannot_train_alone(a.error)] or real
    smallest = min(ran_out or report.attempts, key=lambda a: a.batch_size)
    alone = ("; batch_size=1 cannot train this model (BatchNorm needs more than one value "
             "per channel)" if len(ran_out) < len(real) else "")
    binary = binary_units(report.budget_bytes)
    limit = report.budget_bytes  # the device's own limit is not known here as the user's
    budget = (f"a budget of {sized(report.budget_bytes, binary)}" if report.budget_bytes
              else "the whole device")
    peak = (f" (peak {sized(smallest.peak_memory_bytes, binary)} or more)"
            if smallest.peak_memory_bytes else "")
    call = call or Already(half=False, amp=report.amp, checkpointing=False, trained_share=1.0,
                           parameters_bytes=0, trained_bytes=0, optimizer="",
                           state_per_parameter=0, smallest=smallest.batch_size)
    held = ""
    states = states_bytes(call)
    if limit and sum(states) > limit:
        held = (f" The model's states alone ({_parts(states, binary)}) need "
                f"{sized(sum(states), binary)}, more than {sized(limit, binary)}.")
        changes = state_changes(call, sharding=False)
    else:
        changes = activation_changes(call) + state_changes(call, sharding=False)
    changes += ["a larger budget" if report.budget_bytes else "a GPU with more memory",
                "a smaller model"]
    error = f" Last error: {smallest.error}" if smallest.error else ""
    return (f"No batch size fits: batch_size={smallest.batch_size} ran out of memory on "
            f"{report.device} with {budget}{peak}{alone}.{held} Try {_listed(changes)}.{error}")


def _parts(values: tuple[int, ...], binary: bool,
           names: tuple[str, ...] = ("weights", "gradients", "optimizer state")) -> str:
    return ", ".join(f"{name} {sized(value, binary)}" for name, value in zip(names, values)
                     if value) or "none"


def _nothing_fits_on_target(report: BatchSizeReport, call: Already | None) -> str:
    """A target plan where not even one sample fits: what does not, and what would help."""
    split, usable = report.memory_split, report.limit_bytes or 0
    binary = binary_units(report.target.partition("@")[2] or report.target)
    call = call or Already(half=False, amp=report.amp, checkpointing=False, trained_share=1.0,
                           parameters_bytes=0, trained_bytes=0, optimizer="",
                           state_per_parameter=2, smallest=1)
    if report.parallel is not None:
        return _nothing_fits_on_ranks(report, call, binary)
    of = f"{sized(usable, binary)} usable"
    if split is None:
        held = f"the step at batch size 1 needs more than the {of}"
        changes = activation_changes(call) + state_changes(call)
    else:
        values = (split.parameters_bytes, split.gradients_bytes, split.optimizer_bytes)
        states = sum(values)
        if states > usable:
            held = (f"the model's states alone ({_parts(values, binary)}) need "
                    f"{sized(states, binary)}, more than the {of}")
            changes = state_changes(call)
        else:
            held = (f"the model's states ({_parts(values, binary)}) take {sized(states, binary)}"
                    f" of the {of}, and one sample's step needs more than the "
                    f"{sized(usable - states, binary)} left beside them (less the GPU libraries' "
                    f"workspaces, cuBLAS's: 65 MiB on a Hopper)")
            changes = activation_changes(call) + state_changes(call)
    changes.append("a GPU with more memory")
    return (f"No batch size fits on {report.target} (predicted, not run): {held}. Try "
            f"{_listed(changes)}.")


def _nothing_fits_on_ranks(report: BatchSizeReport, call: Already, binary: bool) -> str:
    """A plan for N GPUs where not one sample fits on a rank: what a rank holds, and which
    strategies would fit."""
    split, usable = report.memory_split, report.limit_bytes or 0
    parts = _parts((split.parameters_bytes, split.gradients_bytes, split.optimizer_bytes,
                    split.communication_bytes), binary,
                   ("weights", "gradients", "optimizer state", "communication buffers"))
    fitting = [f"parallel={row.parallel!r} (batch {row.max_batch_size} per rank)"
               for row in report.parallel_plans if row.max_batch_size > 0]
    would = (f"These fit: {', '.join(fitting)}." if fitting else
             "No strategy fits on this many GPUs: try " + _listed(
                 ["more GPUs (a larger count in target=)", *state_changes(call, sharding=False)])
             + ".")
    return (f"No batch size fits on each of {report.world_size}x{report.target} under "
            f"parallel={report.parallel!r} (predicted, not run): a rank holds {parts} of "
            f"{sized(usable, binary)} usable, and the step needs more with one sample. {would}")
