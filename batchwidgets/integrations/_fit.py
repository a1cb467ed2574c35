"""What ``fit_trainer`` (Hugging Face) and ``BatchSizeCallback`` (Lightning) share: their
find_batch options checked, the global batch a trainer's arguments give, and the split of it
into the per-device batch that fits and the accumulation steps (NOTE [ Keeping the global
batch ] in engine/accumulate/_split.py)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .._warnings import BatchwidgetsWarning
from ..engine import check_options, options_of
from ..engine.accumulate import split
from ..engine.probe import FindBatchRequest
from ..results import BatchSizeReport, BatchSplitReport

# find_batch options a trainer decides: its model's step, its data, this device
DECIDED = ("step", "seq_len", "target", "parallel", "scheduler")


def fit_options(options: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """``options`` as find_batch's keywords, checked: a name find_batch lacks, or one the
    trainer decides, is a TypeError naming the ones it takes."""
    names = [option.name for option in options_of(FindBatchRequest)]
    for name in options:
        if name not in names or name in DECIDED:
            takes = [taken for taken in names if taken not in DECIDED]
            why = ("the trainer decides it" if name in DECIDED
                   else "find_batch has no such option")
            raise TypeError(f"{caller} got the option {name!r}, but {why}; it takes "
                            f"global_batch_size and find_batch's options {takes}.")
    check_options(FindBatchRequest(**options))
    return dict(options)


def check_global(global_batch_size: Any) -> None:
    if global_batch_size is not None and (isinstance(global_batch_size, bool) or not isinstance(
            global_batch_size, int) or global_batch_size < 1):
        raise ValueError(f"global_batch_size should be a positive int or None (the batch the "
                         f"trainer's arguments give), but got global_batch_size="
                         f"{global_batch_size!r}.")


def split_report(probe: BatchSizeReport, global_batch_size: int, world_size: int,
                 stacklevel: int) -> BatchSplitReport:
    """The global batch as per-device batch x steps x devices, the per-device batch up to the
    probe's recommendation; one warning when that is below half of it (``stacklevel``: the
    user's line)."""
    max_per_device = probe.recommended_batch_size
    per_device, steps, advice = split(global_batch_size, max_per_device, world_size)
    if advice:
        warnings.warn(advice, BatchwidgetsWarning, stacklevel=stacklevel + 1)
    return BatchSplitReport(global_batch_size=global_batch_size, world_size=world_size,
                            per_device_batch_size=per_device, accumulation_steps=steps,
                            max_per_device=max_per_device, probe=probe)
