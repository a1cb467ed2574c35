"""accumulate's options, each declared once (NOTE [ Options declared once ] in engine/_options.py):
``%%accumulate``'s N and flags read their defaults and help from here."""

from __future__ import annotations

from .._options import Option, Options, positive_integer
from .._types import REMAINDERS


def steps_or_auto(text: str) -> int | str:
    """``%%accumulate 8`` or ``%%accumulate auto``."""
    return "auto" if text == "auto" else positive_integer(text)


ACCUMULATE = Options(
    "accumulate",
    Option("steps", 4, "micro-steps per optimizer update, or auto: follow the noise tracker's "
                       "batch-size schedule", flag="positional", metavar="N",
           parse=steps_or_auto),
    # %%accumulate finds these in the notebook when they are left out: its own flags
    Option("model", None, "the model the optimizer trains; needed for DDP", flag=""),
    Option("scaler", None, "the loop's GradScaler, updated once per real step", flag=""),
    Option("scheduler", None, "the LR scheduler, stepped once per real step", flag=""),
    Option("remainder", "apply", "micro-steps left at the end: one smaller step (apply) or "
                                 "none (drop)", choices=REMAINDERS),
    Option("track_grad_norms", False, "record each micro-batch's gradient norm in the report",
           flag="switch"),
    Option("batch_size", None, "instead of N: the batch each update should see; N = "
                               "ceil(B / micro-batch)", metavar="B", parse=positive_integer),
    Option("micro_batch_size", None, "with batch_size: the micro-batch the loop feeds (e.g. "
                                     "find_batch's recommended_batch_size)", flag=""),
    Option("noise", None, "a NoiseTracker following the losses and the gradient noise scale "
                          "from the micro-batches", flag=""),
)
