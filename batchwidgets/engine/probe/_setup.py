"""The data find_batch's stages hand each other: ``ProbeSetup``, the call resolved once (what
trains, where, under which limit, from which batches: ``_resolve.py`` makes it, the later stages
only read it), and ``Traced``, what one probe's trials found (``_probe.py`` makes it; the plan
and the measured answer are functions of it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...results import BatchSizeReport
from .._options import OnStep, ProbeStep, ShouldStop
from ..memory import OpTrace, PeakModel
from ._options import FindBatchRequest

SEARCH_CEILING = 2**24  # stop doubling here when nothing runs out of memory


@dataclass(frozen=True)
class ProbeSetup:
    """What one probe does: the request as find_batch was called, and each argument resolved
    once (see ``resolve`` in _resolve.py). An option kept as given is read through the request
    (``setup.amp`` is ``setup.request.amp``); a resolved one is a field of its own."""

    request: FindBatchRequest  # the options as given (probe/_options.py)
    # what trains
    model: torch.nn.Module | None  # the model form's module; None for a bare step(batch_size)
    step: ProbeStep | None  # a bare step(batch_size); None in the model form
    owner: torch.nn.Module | None  # whose weights, buffers and modes come back (model or step=)
    make: Callable[[int], Any] | None  # make(batch_size) -> batch, in the model form
    batch_description: str  # what make() repeats, when it reads a Dataset ("" otherwise)
    optimizer: torch.optim.Optimizer | None  # the user's, or a fresh AdamW in the model form
    # where, and under which limit
    device: torch.device  # where the trials run (the CPU for a target= plan)
    home: torch.device  # where the model lives now, and goes back to
    budget_bytes: int | None
    target: tuple[str, int] | None  # a GPU that is not here: (its name, the bytes usable on it)
    parallel: str | None  # a plan for world_size GPUs: the strategy (probe/_parallel.py)
    world_size: int
    trace: str  # "fake": the sizes run on fake tensors (see NOTE [ Fake trials ]); "real"
    fake_first: bool  # a local search traced on fake tensors first (NOTE [ A free first guess ])
    # the search
    start: int
    ceiling: int
    seq_len: tuple[int, ...] | None  # lengths for make(batch_size, seq_len): a frontier
    notes: tuple[str, ...]  # what the report says about what was probed
    assumed: tuple[str, ...]  # what the call left out and the probe assumed, for the report
    checkpointing: bool  # the model recomputes activations already (``checkpoints``, _checks.py)
    mesh: Any = None  # a fake mesh: the trials run one FSDP2 rank (NOTE [ One FSDP2 rank, traced ])
    # the modules the user's own fully_shard wrapped, by name ("" the root), where the model came
    # sharded: a plan for N GPUs wraps its meta replica the same (NOTE [ The wrapping a plan
    # assumes ] in _parallel.py)
    units: tuple[str, ...] = ()

    # The options kept as given, read through the request. The scaler is the user's GradScaler
    # (restored; fp16 without one gets its own per step); keep_output the loop modelled (NOTE
    # [ The loop the step models ] in _trials.py).
    @property
    def loss_fn(self) -> Callable | None:
        return self.request.loss_fn

    @property
    def scaler(self) -> Any:
        return self.request.scaler

    @property
    def scheduler(self) -> Any:
        return self.request.scheduler

    @property
    def amp(self) -> str | None:
        return self.request.amp

    @property
    def multiple_of(self) -> int:
        return self.request.multiple_of

    @property
    def max_batch_size(self) -> int | None:
        return self.request.max_batch_size

    @property
    def steps_per_trial(self) -> int:
        return self.request.steps_per_trial

    @property
    def what_if(self) -> bool:
        return self.request.what_if

    @property
    def on_step(self) -> OnStep | None:
        return self.request.on_step

    @property
    def should_stop(self) -> ShouldStop | None:
        return self.request.should_stop

    @property
    def keep_output(self) -> bool:
        return self.request.keep_output

    @property
    def headroom(self) -> float:
        return float(self.request.headroom)

    @property
    def extras(self) -> tuple[Any, Any]:
        """The other objects a step changes, snapshotted and restored with the model."""
        return self.scheduler, self.scaler

    @property
    def moves(self) -> bool:
        """The model is probed on another device than its own, and moved back afterwards."""
        return self.model is not None and self.home != self.device and self.trace == "real"

    def with_change(self, **change: Any) -> ProbeSetup:
        """The same probe with one change (``amp=`` or ``optimizer=``: a what-if, measured; or
        ``mesh=``), without the progress and what-ifs of the call it changes. A name the setup
        resolved (``optimizer``, ``model``) changes the setup; an option kept as given, the
        request."""
        own = {field.name for field in dataclasses.fields(self)}
        request = dataclasses.replace(
            self.request, on_step=None, what_if=False,
            **{name: value for name, value in change.items() if name not in own})
        return dataclasses.replace(self, request=request, **{
            name: value for name, value in change.items() if name in own})


Pair = tuple[tuple[OpTrace, int], tuple[OpTrace, int]]  # two traced sizes: (trace, batch size)


@dataclass(frozen=True)
class Traced:
    """What one probe's trials found, as plain values: the report of its search (the sizes
    tried, the answer on this device or under the meter's limit) and what a plan or a what-if
    predicts from (NOTE [ Predict, then verify ] in _search.py)."""

    report: BatchSizeReport  # the search's own answer, before any plan
    model: PeakModel | None  # the per-op model fitted on the traces, where one fits
    pair: Pair | None  # a plan's two traced sizes of one op sequence, to scale and replay
    limit_bytes: int | None  # the limit searched under (lowered after a real allocator failure)
    overhead_bytes: int  # reserved beyond the tensors (CUDA), from the traced sizes
    unseen_bytes: int  # real CUDA: reserved that the trace's replay does not explain
    replays: bool  # what runs out is reserved memory: traces replay through the allocator
    ceiling: int  # the largest size the search could try
    # fake trials whose optimizer's state was learned by shape (NOTE [ Optimizer state by
    # shape ] in _optimizer_shapes.py): one FSDP2 rank's cannot be
    state_by_shape: bool = False
    # a plan over N GPUs with parallel "fsdp" or "compare": one FSDP2 rank's traces on a fake
    # process group (NOTE [ One FSDP2 rank, traced ] in _sharded.py), or why there are none
    rank: Traced | None = None
    rank_note: str = ""

    @property
    def stopped(self) -> bool:
        return self.report.stop_reason == "stopped"


def at_length(make_batch: Callable, length: int, batch_size: int) -> Any:
    """make_batch(batch_size, length): the frontier's batches at one sequence length."""
    return make_batch(batch_size, length)
