"""Reports: frozen dataclasses that display themselves. Standard library only (no torch/Jupyter).

One module per engine module: ``probe`` (``Attempt``, ``BatchSizeReport``; ``memory``: its
``MemorySplit`` and ``MemoryTimeline``; ``_json``: a report as JSON and back; ``_snapshot``: its
traced step as PyTorch's memory snapshot), ``accumulate``,
``noise`` and ``noise_tracker`` (with the theory in ``_noise_theory``), ``critical``, ``loader``,
``live_loader``, ``schedule`` and ``split`` (what fit_trainer set); every name is re-exported here.
``_text`` writes every report's text form and every result's short repr (``_probe_text``: the
probe report's fitted line and folded what-if rows).

Usage:
    >>> from batchwidgets.results import Attempt, BatchSizeReport
    >>> r = BatchSizeReport(max_batch_size=96, first_oom_batch_size=97,
    ...                     attempts=(Attempt(96, True, 2**20, 0.1),
    ...                               Attempt(97, False, None, None)),
    ...                     device="cpu", budget_bytes=2**20)
    >>> r.recommended_batch_size
    86
"""

from ._noise_theory import (
    batch_variance,
    examples_over_min,
    lr_scale,
    noise_advice,
    population_estimates,
    population_rule,
    steps_over_min,
)
from ._snapshot import StepSnapshot
from .accumulate import AccumulationReport
from .critical import Branch, CriticalBatchReport
from .live_loader import LiveLoaderReport, LoaderSegment, LoaderSwitch
from .loader import DataStallReport, LoaderReport, LoaderTrial
from .noise import LayerNoise, NoiseReport
from .noise_tracker import LOSS_WINDOW, NoisePoint, NoiseTrackerReport
from .probe import (
    FASTER_BY,
    Attempt,
    BatchSizeReport,
    MemoryModel,
    MemorySplit,
    MemoryTimeline,
    ParallelPlan,
    PeakSegment,
    Remembered,
    WhatIf,
    attempts_table,
)
from .schedule import BatchSchedule, ScheduleChange, accumulation_advice, plan_batch
from .split import BatchSplitReport

__all__ = [
    "FASTER_BY",
    "LOSS_WINDOW",
    "AccumulationReport",
    "Attempt",
    "BatchSchedule",
    "BatchSizeReport",
    "BatchSplitReport",
    "Branch",
    "CriticalBatchReport",
    "DataStallReport",
    "LayerNoise",
    "LiveLoaderReport",
    "LoaderReport",
    "LoaderSegment",
    "LoaderSwitch",
    "LoaderTrial",
    "MemoryModel",
    "MemorySplit",
    "MemoryTimeline",
    "NoisePoint",
    "NoiseReport",
    "NoiseTrackerReport",
    "ParallelPlan",
    "PeakSegment",
    "Remembered",
    "ScheduleChange",
    "StepSnapshot",
    "WhatIf",
    "accumulation_advice",
    "attempts_table",
    "batch_variance",
    "examples_over_min",
    "lr_scale",
    "noise_advice",
    "plan_batch",
    "population_estimates",
    "population_rule",
    "steps_over_min",
]
