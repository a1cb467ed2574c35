"""The probe's reports: each size tried (``Attempt``) and ``BatchSizeReport``.
One object, one module: every field, line and row of the report says one thing about one probe,
and its summary, table and text form read them together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .. import _html
from ._probe_text import line_text, what_if_line, what_if_rows
from ._snapshot import StepSnapshot, write_snapshot
from ._text import Short, TextForm
from .memory import MemorySplit, MemoryTimeline


@dataclass(frozen=True)
class Attempt(Short):
    """One trial of the probe: did ``batch_size`` train, and what did it cost."""

    batch_size: int
    fits: bool
    peak_memory_bytes: int | None  # tensor bytes at the peak of the step (None if unmeasured)
    step_time_s: float | None  # one steady-state step (the last of the trial); None on OOM
    peak_reserved_bytes: int | None = None  # CUDA caching allocator's peak; None elsewhere
    activation_peak_bytes: int | None = None  # forward+backward peak, what the model is fitted on
    error: str = ""  # first line of the out-of-memory message when it did not fit
    # what the per-op model predicted before the size ran (None: no model yet); a miss is a
    # prediction that went the other way, and the search steps out from the first real one
    predicted_peak_bytes: int | None = None
    predicted_fits: bool | None = None
    fake: bool = False  # traced on fake tensors (shapes, no storage): nothing ran, nothing fit

    @property
    def samples_per_s(self) -> float | None:
        if not self.fits or not self.step_time_s:
            return None
        return self.batch_size / self.step_time_s


@dataclass(frozen=True)
class MemoryModel(Short):
    """Peak memory as ``fixed_bytes + per_sample_bytes * batch_size``, fitted on measured steps."""

    fixed_bytes: float
    per_sample_bytes: float

    def predict_bytes(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def largest_batch_size(self, limit_bytes: float, multiple_of: int = 1) -> int | None:
        """Largest multiple of ``multiple_of`` predicted to fit in ``limit_bytes``, or None."""
        if self.per_sample_bytes <= 0:
            return None
        size = int((limit_bytes - self.fixed_bytes) // self.per_sample_bytes)
        return max(0, size // multiple_of * multiple_of)


@dataclass(frozen=True)
class PeakSegment(Short):
    """From ``batch_size`` on (until the next segment) the step's peak is ``fixed_bytes +
    per_sample_bytes * B``, held by the op at ``where`` ("encoder.layer.5 (BertLayer) backward,
    at aten.bmm.default"). The peak is convex in B, so at any size it is the largest of the
    segments' lines."""

    batch_size: int
    fixed_bytes: float
    per_sample_bytes: float
    where: str

    def predict_bytes(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


@dataclass(frozen=True)
class WhatIf(Short):
    """The largest batch under one change the user could make (``report.what_if``)."""

    name: str  # "bf16", "SGD (no optimizer state)", "checkpoint encoder.layer.0", ...
    max_batch_size: int
    measured: bool  # True: probed with the change; False: predicted from the per-op model
    cost: str  # what the change costs, in one line (speed, numerics)
    samples_per_s: float | None = None  # at max_batch_size, where it was run

    def row(self) -> tuple[object, ...]:
        return (self.name, self.max_batch_size, "measured" if self.measured else "predicted",
                _html.format_number(self.samples_per_s, 4), self.cost)


@dataclass(frozen=True)
class ParallelPlan(Short):
    """One strategy's plan for N GPUs (``report.parallel_plans``): the largest batch on each rank
    and what a rank holds, predicted for the same target."""

    parallel: str  # "ddp", "zero1", "zero2", "zero3", "fsdp"
    world_size: int
    max_batch_size: int  # per rank; 0 when not even one sample fits
    parameters_bytes: int  # a rank's weights (its shard, where they are sharded)
    gradients_bytes: int  # a rank's gradients after backward (its shard from ZeRO-2 on)
    optimizer_bytes: int  # a rank's optimizer state (its shard from ZeRO-1 on)
    communication_bytes: int  # the buffers the strategy adds
    activations_bytes: int = 0  # saved for backward at the rank's peak, at max_batch_size

    @property
    def global_batch_size(self) -> int:
        return self.max_batch_size * self.world_size

    def row(self) -> tuple[object, ...]:
        return (self.parallel, self.max_batch_size, self.global_batch_size,
                *(_html.format_bytes(n) for n in (self.parameters_bytes, self.gradients_bytes,
                                                  self.optimizer_bytes, self.communication_bytes,
                                                  self.activations_bytes)))


@dataclass(frozen=True)
class Remembered(Short):
    """Where a remembered answer comes from (``report.remembered``): when and where the probe
    that measured it ran, and the file that keeps it (``batchwidgets.forget()`` clears them)."""

    measured_at: str  # ISO 8601 with its UTC offset, when the probe finished
    host: str  # the machine it ran on
    path: str  # the JSON file it is kept in

    def __str__(self) -> str:
        return f"measured {self.measured_at[:19].replace('T', ' ')} on {self.host}"


def attempts_table(attempts: tuple[Attempt, ...] | list[Attempt]) -> str:
    """The probe's attempts as an escaped HTML table (the report's and the live panel's)."""
    rows = [(a.batch_size, "traced (fake)" if a.fake else "yes" if a.fits else "OOM",
             _html.format_bytes(a.peak_memory_bytes),
             _html.format_number(a.step_time_s), _html.format_number(a.samples_per_s, 4))
            for a in attempts]
    return _html.table(rows, caption="attempts, in order",
                       header=("batch size", "fits", "peak memory", "step s", "samples/s"))


def _sizes(sizes: list[int]) -> str:
    return ", ".join(str(size) for size in sizes) or "none"


def _interpolate(points: tuple[tuple[int, int], ...], x: int) -> float:
    """Piecewise-linear through (size, bytes) points, the end segments extended."""
    if len(points) == 1:
        return float(points[0][1])
    segment = next((i for i in range(len(points) - 1) if x <= points[i + 1][0]),
                   len(points) - 2)
    (x0, y0), (x1, y1) = points[segment], points[segment + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_LOOPS = {  # how the table says each loop
    "keeps output": "keeps the output and loss until the next forward (keep_output=True)",
    "frees output": "frees the output before backward (keep_output=False)",
    "your step": "your own step, measured as it runs",
    "your cell": "your cell, measured as it runs (%%find_batch)",
}

# A smaller size must beat the largest one by this much (samples/s) to be preferred: fewer
# trials than a throughput curve needs, so small timing noise must not flip the recommendation.
FASTER_BY = 1.10


@dataclass(frozen=True)
class BatchSizeReport(TextForm):
    """What ``find_batch`` found: the largest batch size that trained, and every attempt."""

    max_batch_size: int  # largest size that ran (0 only inside NoBatchSizeFits)
    first_oom_batch_size: int | None  # smallest size that ran out of memory, None if none did
    attempts: tuple[Attempt, ...]
    device: str
    budget_bytes: int | None  # the cap the user asked for, None for the whole device
    limit_bytes: int | None = None  # the memory the search aimed at: budget or device capacity
    baseline_bytes: int | None = None  # memory held before the first step (weights, state)
    memory_model: MemoryModel | None = None
    headroom: float = 0.9  # recommended size is at most headroom * max_batch_size
    multiple_of: int = 1
    amp: str | None = None
    stop_reason: str = "boundary"  # boundary | max_batch_size | ceiling | nothing fits
    # The per-op peak model's shape over the sizes tried (empty when the search ran without
    # one), how the search went, and which sample the batches were built from.
    peak_segments: tuple[PeakSegment, ...] = ()
    method: str = ""
    worst_case: str = ""
    memory_split: MemorySplit | None = None
    memory_timeline: MemoryTimeline | None = None  # the step over its ops, at memory_split's size
    # find_batch(..., seq_len=[...]): the largest batch size at each sequence length; the rest of
    # the report is the probe at ``seq_len``, the longest length
    frontier: dict[int, int] | None = None
    seq_len: int | None = None
    what_if: tuple[WhatIf, ...] = ()
    target: str | None = None  # find_batch(..., target=): the GPU the answer is predicted for
    # the predicted max_batch_size's band on the target: from the answer times the lowest ratio of
    # true boundary to plan recorded on a real GPU (0.96) up to the tensors alone, without
    # convolution workspaces (see NOTE [ The band of a plan, from the evidence ] in probe/_plan.py)
    target_band: tuple[int, int] | None = None
    # what the answer rests on: "real" steps, or a "fake" trace (FakeTensorMode: shapes, no
    # compute, no memory) of the small sizes that a target's prediction is made from
    trace: str = "real"
    # a target plan's predicted peak (reserved bytes on the target) at sizes up to twice the
    # answer, (batch_size, bytes): what predict_peak_bytes interpolates for a target report
    target_peaks: tuple[tuple[int, int], ...] = ()
    # a plan for N GPUs (target="8xA100-80GB", parallel=): max_batch_size is per rank, on each of
    # world_size ranks under the strategy ``parallel``; ``parallel_plans`` has every strategy's
    world_size: int = 1
    parallel: str | None = None
    parallel_plans: tuple[ParallelPlan, ...] = ()
    # the wrapping a plan for N GPUs assumed (FSDP2's units: each block and the root by default,
    # the job's own where the model came sharded), and why the per-rank order ddp <= zero1 <=
    # zero2 <= zero3, zero2 <= fsdp does not hold among parallel_plans ("" where it holds)
    wrapping: str = ""
    parallel_order: str = ""
    # which step's memory was measured, where it is not plainly the model's own: a compiled
    # model's eager step, and why ("" for a model not compiled)
    measured_step: str = ""
    # find_batch(..., cache=True) gave the answer it kept from an earlier identical call (see
    # NOTE [ Remembered answers ] in engine/probe/_remember.py): when and where that one ran.
    # Not compared: a remembered report equals the one measured.
    remembered: Remembered | None = field(default=None, compare=False)
    # the loop the answer is for: "keeps output" (the model's output and loss alive until the
    # next step's forward returns, find_batch's default), "frees output" (keep_output=False),
    # "your step" (a step of the user's own, measured as it is), "your cell" (%%find_batch);
    # "" where not said
    loop: str = ""
    # what the call left out and the probe assumed ("optimizer AdamW (pass optimizer=)", ...)
    assumed: tuple[str, ...] = ()
    # the traced step at the answer, op by op, for save_snapshot (None: remembered, or no step)
    step_snapshot: StepSnapshot | None = field(default=None, repr=False, compare=False)

    def save_snapshot(self, path: str) -> str:
        """Write the traced step in the pickle format of ``torch.cuda.memory._snapshot()``, for
        pytorch.org/memory_viz or ``python -m torch.cuda._memory_viz``: the segments at its
        peak, and every allocation and free up to it with the module and op that made it. A
        probe on the CPU writes tensor events alone (no caching allocator there) and says so
        in the line it returns (see NOTE [ A step as a memory snapshot ])."""
        if self.step_snapshot is None:
            raise ValueError("report should hold its traced step to save a snapshot, but it has "
                             "none (a remembered answer keeps none); call find_batch again "
                             "with refresh=True.")
        return write_snapshot(self.step_snapshot, path)

    @property
    def global_batch_size(self) -> int:
        """The batch of one optimizer step over every rank: per rank x ranks."""
        return self.max_batch_size * self.world_size

    @property
    def frontier_tokens(self) -> dict[int, int] | None:
        """The frontier in tokens per batch: length x largest batch size."""
        if self.frontier is None:
            return None
        return {length: length * size for length, size in self.frontier.items()}

    def predict_peak_bytes(self, batch_size: int) -> float | None:
        """The step's peak at any size: on the target for a target plan (between the sizes it
        replayed, linearly), else by the per-op model (else the fitted line)."""
        if self.target_peaks:
            return _interpolate(self.target_peaks, batch_size)
        if self.peak_segments:
            return max(s.predict_bytes(batch_size) for s in self.peak_segments)
        return None if self.memory_model is None else self.memory_model.predict_bytes(batch_size)

    @property
    def peak_location(self) -> str:
        """Where the peak sits at max_batch_size ("layers.9 (Linear) backward, at aten.mm")."""
        if not self.peak_segments:
            return ""
        size = self.max_batch_size or 1
        return max(self.peak_segments, key=lambda s: s.predict_bytes(size)).where

    @property
    def n_attempts(self) -> int:
        return len(self.attempts)

    @property
    def n_ooms(self) -> int:
        """Out-of-memory errors real steps hit (one on fake tensors costs nothing), or a plan's."""
        return sum(not a.fits for a in self.attempts if not a.fake or self.trace == "fake")

    @property
    def n_fake(self) -> int:
        """Sizes traced on fake tensors: a plan's, or a local search's free first guess."""
        return sum(a.fake for a in self.attempts)

    @property
    def traced(self) -> str:
        """How each size was tried, from the attempts: what the answer rests on (``trace``)
        and any sizes traced on fake tensors first to choose where the real steps began."""
        fake = [a.batch_size for a in self.attempts if a.fake]
        real = [a.batch_size for a in self.attempts if not a.fake]
        if self.trace == "fake":
            return f"fake tensors at sizes {_sizes(fake)} (shapes only: nothing ran)"
        text = f"real steps at sizes {_sizes(real)}" if real else "no real step"
        if fake:
            text += (f", after fake tensors at sizes {_sizes(fake)} chose where they began "
                     f"(shapes only)")
        return text

    @property
    def _headroom_batch_size(self) -> int:
        m = self.multiple_of
        return max(min(m, self.max_batch_size), int(self.headroom * self.max_batch_size) // m * m)

    @property
    def _faster_smaller_attempt(self) -> Attempt | None:
        if self.device.startswith("cpu"):
            return None  # CPU step times include the probe's op-by-op memory tracking
        ran = [a for a in self.attempts if a.fits and a.samples_per_s]
        if not ran:
            return None
        fastest = max(ran, key=lambda a: a.samples_per_s)
        largest = max(ran, key=lambda a: a.batch_size)
        if (fastest.batch_size < self._headroom_batch_size
                and fastest.samples_per_s >= FASTER_BY * largest.samples_per_s):
            return fastest
        return None

    @property
    def recommended_batch_size(self) -> int:
        faster = self._faster_smaller_attempt
        return faster.batch_size if faster else self._headroom_batch_size

    @property
    def recommendation_rule(self) -> str:
        if self._faster_smaller_attempt:
            return (f"the fastest size measured: it ran at least {FASTER_BY - 1:.0%} more "
                    f"samples/s than the largest, so larger batches buy no throughput here")
        return (f"headroom {self.headroom:g} x max_batch_size, rounded down to a multiple of "
                f"{self.multiple_of}"
                + ("" if not self.device.startswith("cpu") else
                   " (on the CPU, step times include the probe's memory tracking, so they do "
                   "not rank throughput)"))

    @property
    def headroom_bytes(self) -> float | None:
        """Memory left under the limit at the recommended size, by the fitted model."""
        predicted = self.predict_peak_bytes(self.recommended_batch_size)
        if predicted is None or self.limit_bytes is None:
            return None
        return self.limit_bytes - predicted

    def with_headroom(self, headroom: float) -> BatchSizeReport:
        """The same measurements with another headroom (no re-probing)."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom should be in (0, 1], but got headroom={headroom!r}; "
                             f"use e.g. 0.9 to keep 10% of the memory free.")
        return dataclasses.replace(self, headroom=headroom)

    @property
    def other_loop(self) -> WhatIf | None:
        """The what-if row of the loop not modelled (keep_output's other value), if predicted."""
        return next((row for row in self.what_if if row.name.startswith("keep_output=")), None)

    @property
    def loop_line(self) -> str:
        """Which loop the answer is for, and the other loop's answer where it differs (what
        the summary adds; "" where the loop does not change the answer or was not said)."""
        other = self.other_loop
        if other is None or other.max_batch_size == self.max_batch_size:
            return ""
        said = ("the loop keeps the output and loss until the next forward"
                if self.loop == "keeps output" else "the loop frees the output before backward")
        return f"{said}; {other.name.split(' ', 1)[0]}: {other.max_batch_size}"

    def summary(self) -> str:
        # one short line (the panel shows it beside its progress bar), then what it rests on
        said = "; ".join(part for part in (self._answer_line(), self.loop_line,
                                           "assumed " + ", ".join(self.assumed)
                                           if self.assumed else "", *self._parallel_lines())
                         if part)
        return said if self.remembered is None else f"{said}; remembered, {self.remembered}"

    def _parallel_lines(self) -> tuple[str, ...]:
        """A plan for N GPUs: the wrapping it assumed, and why the strategies' order breaks."""
        return (f"wrapping: {self.wrapping}" if self.wrapping else "",
                f"order: {self.parallel_order}" if self.parallel_order else "",
                f"measured {self.measured_step}" if self.measured_step else "")

    def _answer_line(self) -> str:
        if self.target is not None and self.parallel is not None:
            return (f"max_batch_size={self.max_batch_size} per rank on {self.world_size}x"
                    f"{self.target} under {self.parallel}, global_batch_size="
                    f"{self.global_batch_size} (predicted, not run), recommended_batch_size="
                    f"{self.recommended_batch_size} per rank")
        if self.target is not None:
            traced = "a fake trace" if self.trace == "fake" else self.device
            return (f"max_batch_size={self.max_batch_size} on {self.target} (predicted, not run; "
                    f"band {self.target_band[0]}-{self.target_band[1]}), "
                    f"recommended_batch_size={self.recommended_batch_size}, traced on "
                    f"{traced} in {self.n_attempts} tries")
        real = self.n_attempts - self.n_fake
        fake = f" after {self.n_fake} on fake tensors" if self.n_fake else ""
        return (f"max_batch_size={self.max_batch_size}, "
                f"recommended_batch_size={self.recommended_batch_size} ({self.device}, "
                f"{real} tries{fake}, {self.n_ooms} OOM)")

    def text_parts(self) -> list[str]:
        """After the summary: the what-if rows in a line, where the report has them."""
        return [what_if_line(self)]

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        model = self.memory_model
        return [
            *([("target (predicted, not run)", f"{self.target}: band {self.target_band[0]}-"
                                               f"{self.target_band[1]}")] if self.target else []),
            *([("ranks", f"{self.world_size} under {self.parallel}: global_batch_size "
                         f"{self.global_batch_size} (max_batch_size is per rank)")]
              if self.parallel else []),
            *([("wrapping", self.wrapping)] if self.wrapping else []),
            *([("order of strategies", self.parallel_order)] if self.parallel_order else []),
            *([("measured", self.measured_step)] if self.measured_step else []),
            ("device", self.device),
            ("budget", _html.format_bytes(self.budget_bytes) if self.budget_bytes
             else "whole device"),
            *([("loop", _LOOPS.get(self.loop, self.loop) + (
                f" ({self.other_loop.name.split(' ', 1)[0]}: "
                f"{self.other_loop.max_batch_size})" if self.other_loop else ""))]
              if self.loop else []),
            *([("assumed", "; ".join(self.assumed))] if self.assumed else []),
            ("max_batch_size", self.max_batch_size),
            ("first_oom_batch_size", self.first_oom_batch_size),
            ("recommended_batch_size", self.recommended_batch_size),
            ("rule", self.recommendation_rule),
            ("headroom at recommended", _html.format_bytes(self.headroom_bytes)),
            ("memory model", "-" if model is None else line_text(model, self.max_batch_size)),
            ("peak at max_batch_size", self.peak_location or "-"),
            ("search", self.method or "-"),
            ("traced", self.traced),
            ("batches from", self.worst_case or "-"),
            ("amp", self.amp or "off"),
            ("attempts",
             f"{self.n_attempts} ({self.n_fake} on fake tensors, {self.n_ooms} out of memory); "
             f"stop: {self.stop_reason}"),
            *([("remembered", f"{self.remembered}, kept in {self.remembered.path} "
                              f"(refresh=True measures again)")] if self.remembered else []),
        ]

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: find_batch", self.rows(),
                                 details_html(self), attempts_table(self.attempts))


def details_html(report: BatchSizeReport) -> str:
    """The length frontier, the what-if table and where the memory goes, where the report has
    them: the report's HTML and the probe panel show the same tables."""
    parts = []
    if report.frontier:
        parts.append(_html.table(
            [(length, size, length * size) for length, size in report.frontier.items()],
            caption="largest batch at each sequence length",
            header=("sequence length", "batch size", "tokens per batch")))
    if report.what_if:
        parts.append(_html.table(what_if_rows(report), caption="what if",
                                 header=("change", "max batch size", "how", "samples/s", "cost")))
    if report.parallel_plans:
        parts.append(_html.table(
            [plan.row() for plan in report.parallel_plans],
            caption=f"strategies on {report.world_size}x{report.target} (predicted, per rank)",
            header=("parallel", "batch per rank", "global batch", "weights", "gradients",
                    "optimizer state", "communication", "activations")))
    if report.memory_split is not None:
        parts.append(report.memory_split._repr_html_())
    return "".join(parts)

