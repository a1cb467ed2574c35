"""accumulate's options as one frozen dataclass, ``AccumulateRequest``, each declared once (NOTE
[ Options declared once ] in engine/_options.py): accumulate's signature takes its defaults from
``ACCUMULATE``, and ``%%accumulate``'s N and flags read its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._options import REMAINDERS, Remainder, option, positive_integer

if TYPE_CHECKING:
    import torch

    from ..noise import NoiseTracker


def steps_or_auto(text: str) -> int | str:
    """``%%accumulate 8`` or ``%%accumulate auto``."""
    return "auto" if text == "auto" else positive_integer(text)


@dataclass(frozen=True)
class AccumulateRequest:
    """accumulate's keyword options, in its signature's order (the optimizer is its own)."""

    steps: int | str = option(
        4, "micro-steps per optimizer update, or auto: follow the noise tracker's batch-size "
           "schedule", flag="positional", metavar="N", parse=steps_or_auto)
    # %%accumulate finds these in the notebook when they are left out: its own flags
    model: torch.nn.Module | None = option(
        None, "the model the optimizer trains; needed for DDP", flag="")
    scaler: Any = option(None, "the loop's GradScaler, updated once per real step", flag="")
    scheduler: Any = option(None, "the LR scheduler, stepped once per real step", flag="")
    remainder: Remainder = option(
        "apply", "micro-steps left at the end: one smaller step (apply) or none (drop)",
        choices=REMAINDERS)
    track_grad_norms: bool = option(
        False, "record each micro-batch's gradient norm in the report", flag="switch")
    batch_size: int | None = option(
        None, "instead of N: the batch each update should see; N = ceil(B / micro-batch)",
        metavar="B", parse=positive_integer)
    micro_batch_size: int | None = option(
        None, "with batch_size: the micro-batch the loop feeds (e.g. find_batch's "
              "recommended_batch_size)", flag="")
    noise: NoiseTracker | None = option(
        None, "a NoiseTracker following the losses and the gradient noise scale from the "
              "micro-batches", flag="")


ACCUMULATE = AccumulateRequest()  # accumulate's defaults, which its signature spells
