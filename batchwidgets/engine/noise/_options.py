"""critical_batch's options as one frozen dataclass, ``CriticalBatchRequest``, each declared once
(NOTE [ Options declared once ] in engine/_options.py): critical_batch's signature takes its
defaults from ``CRITICAL_BATCH``, and ``%critical_batch``'s flags read its fields."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._options import integers, number, option, positive_integer

if TYPE_CHECKING:
    import torch

    from ...results import BatchSizeReport


@dataclass(frozen=True)
class CriticalBatchRequest:
    """critical_batch's keyword options, in its signature's order (model, data and optimizer
    are its own)."""

    loss_fn: Callable | None = option(
        None, "loss_fn(output, target) (default: the output's .loss)", flag="name")
    target_loss: float | None = option(
        None, "the loss every branch runs to (default: 90% of the way to the loss the base "
              "batch reaches in --base-steps steps)", metavar="X", parse=number)
    base_batch_size: int | None = option(
        None, "the ladder's first batch (default: the DataLoader's, else 8)", metavar="N",
        parse=positive_integer)
    batch_sizes: Sequence[int] | None = option(
        None, "the ladder, e.g. 8,16,32,64,128 (default: the base x 1, 2, 4 ... 32)",
        metavar="N,N,...", parse=integers)
    base_steps: int = option(64, "steps of the base batch that set the target", metavar="N",
                             parse=positive_integer)
    lr_scaling: str | Callable[[float], float] | None = option(
        None, "how each branch's learning rate follows its batch (default: sqrt for the Adam "
              "family, linear otherwise)", choices=("linear", "sqrt", "none"))
    scheduler: Any = option(None, "an LR scheduler stepped in the branches", flag="name")
    seeds: int = option(2, "draws of the batches; two or more give an error bar", metavar="N",
                        parse=positive_integer)
    max_steps: int | None = option(None, "steps a branch may take (default: 4 x --base-steps)",
                                   metavar="N", parse=positive_integer)
    eval_examples: int = option(256, "examples the loss is evaluated on", metavar="N",
                                parse=positive_integer)
    noise: bool = option(True, "also measure B_simple at the same weights", flag="")
    fits_batch_size: int | BatchSizeReport | None = option(
        None, "the largest batch that fits (or a find_batch report): larger ones accumulate "
              "micro-batches", flag="")
    criterion: str = option(
        "steps", "loss: also Merrill et al.'s largest batch within --loss-tolerance of the "
                 "base's loss at equal examples", choices=("steps", "loss"))
    loss_tolerance: float = option(0.01, "with --criterion loss: relative, 0.01 is 1%",
                                   metavar="X", parse=number)
    device: torch.device | str | None = option(
        None, "where the branches run (default: the model's)")


CRITICAL_BATCH = CriticalBatchRequest()  # critical_batch's defaults, which its signature spells
