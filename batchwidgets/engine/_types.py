"""The engine's vocabulary: one name for each kind of argument, used in every signature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

# NOTE [ One vocabulary ]
# The same thing has the same name across the API:
# - Data. ``make_batch`` (find_batch) makes a batch of a given size: a callable
#   ``make_batch(batch_size)``, or a Dataset, DataLoader or example tensor it is built from;
#   ``data`` (measure_noise) is the examples themselves, a Dataset or DataLoader;
#   ``loader_or_dataset`` (tune_loader, measure_loader, make_loader, LoaderPanel) is what a
#   DataLoader is built from or is; ``batch`` (NoiseTracker.measure, a TrainStep) is one batch.
#   Positional names are kept as they were: renaming one breaks every keyword call.
# - Steps. A ``ProbeStep`` is ``step(batch_size)``: it builds its own batch and trains once
#   (find_batch(step), find_batch(model, step=...)); a ``TrainStep`` is ``step(batch)``: one
#   training step on the batch it is given (tune_loader(step=...), data_stall).
# - Progress and cancelling. A long measurement calls back on the measuring thread with each
#   row its report will hold, as soon as it exists: find_batch's ``on_step(attempt)``,
#   tune_loader's ``on_progress(trial)`` (the names the guides teach). A NoiseTracker, which
#   lives across a whole training run, takes listeners instead (``add_listener``).
#   ``should_stop()`` is polled between units of work to cancel.
# - AMP objects. ``scaler`` comes before ``scheduler`` wherever both are taken (accumulate's
#   positional order).
# - Choices among strings are ``Literal`` aliases below, and their tuples of allowed values
#   (for the checks) come from them.

ProbeStep = Callable[[int], Any]  # step(batch_size): builds its batch and trains once
TrainStep = Callable[[Any], Any]  # step(batch): one training step on the given batch
OnProgress = Callable[[Any], None]  # on_progress(row): each row of the report as it is made
ShouldStop = Callable[[], bool]
Clock = Callable[[], float]

Amp = Literal["bf16", "bfloat16", "fp16", "float16"]
Remainder = Literal["apply", "drop"]
NoiseMethod = Literal["auto", "vmap", "loop"]
Trace = Literal["fake", "real"]
AMP_NAMES: tuple[str, ...] = get_args(Amp)
REMAINDERS: tuple[str, ...] = get_args(Remainder)
NOISE_METHODS: tuple[str, ...] = get_args(NoiseMethod)
TRACES: tuple[str, ...] = get_args(Trace)

