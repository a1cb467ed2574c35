"""What a live loader measured in the training loop that iterates it: ``LoaderSegment`` (one
setting, from one switch to the next), ``LoaderSwitch`` (a change of settings and what it cost)
and ``LiveLoaderReport`` (all of them, and the loop's samples/s and data stall overall)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .. import _html
from ._text import Short, TextForm


def _label(settings: dict[str, object]) -> str:
    """``'2 workers, pinned, prefetch 4, persistent'``: as a LoaderTrial names its setting."""
    workers = settings.get("num_workers") or 0
    parts = ["no workers" if not workers else f"{workers} worker{'s' if workers > 1 else ''}"]
    if settings.get("pin_memory"):
        parts.append("pinned")
    if workers:
        parts.append(f"prefetch {settings.get('prefetch_factor') or 2}")
    if workers and settings.get("persistent_workers"):
        parts.append("persistent")
    return ", ".join(parts)


def _rate(n_samples: int, wall_s: float) -> float:
    return n_samples / wall_s if wall_s > 0 else 0.0


def _stall(wait_s: float, wall_s: float) -> float:
    return min(1.0, wait_s / wall_s) if wall_s > 0 else 0.0


@dataclass(frozen=True)
class LoaderSegment(Short):
    """The training loop's own numbers while one setting was in force: from the batch after a
    switch (or the first batch) to the batch before the next switch."""

    settings: dict[str, object]  # num_workers, pin_memory, prefetch_factor, persistent_workers
    n_batches: int
    n_samples: int
    wall_s: float  # the loop's wall time over these batches: its steps plus its waits
    wait_s: float  # time the loop spent inside next(), waiting for a batch
    epoch: int  # the epoch (0-based) and batch (0-based) at which the segment began
    batch: int

    @property
    def samples_per_s(self) -> float:
        return _rate(self.n_samples, self.wall_s)

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's wall time spent waiting for data, in [0, 1]."""
        return _stall(self.wait_s, self.wall_s)

    @property
    def step_s(self) -> float:
        """Mean time per batch outside next(): the training step itself."""
        return (self.wall_s - self.wait_s) / self.n_batches if self.n_batches else 0.0

    @property
    def label(self) -> str:
        return _label(self.settings)

    def summary(self) -> str:
        return (f"{self.label}: {_html.format_number(self.samples_per_s)} samples/s, "
                f"{self.stall_fraction:.0%} waiting for data ({self.n_batches} batches)")


@dataclass(frozen=True)
class LoaderSwitch(Short):
    """One change of settings: asked for (by ``set``, a panel or autotune), applied at the next
    batch, or at the next epoch where the position cannot be carried over."""

    old: dict[str, object]
    new: dict[str, object]
    epoch: int  # where it took effect: the first batch (0-based) with the new settings
    batch: int
    shutdown_s: float  # stopping the old workers
    cost_s: float  # the loop's wait for its first batch after the switch, shutdown included
    by: str = "set"  # "set", "autotune"
    note: str = ""  # e.g. why it waited for the next epoch

    def summary(self) -> str:
        return (f"epoch {self.epoch}, batch {self.batch}: {_label(self.old)} -> "
                f"{_label(self.new)} ({self.by}; the next batch waited {self.cost_s * 1e3:.0f} "
                f"ms){' ' + self.note if self.note else ''}")


@dataclass(frozen=True)
class LiveLoaderReport(TextForm):
    """What ``live.report`` says: the loop's throughput and data stall, overall and per
    setting, each switch with its cost, and the settings in force."""

    segments: tuple[LoaderSegment, ...]
    switches: tuple[LoaderSwitch, ...]
    settings: dict[str, object]  # in force now
    epoch: int  # epochs begun (the running one included)
    autotune: bool = False
    autotune_status: str = ""  # what autotune is doing, in one line ("" when it is off)
    warnings: tuple[str, ...] = ()

    def __call__(self) -> LiveLoaderReport:
        """``live.report()``, from when ``report`` was a method: the report itself."""
        warnings.warn("live.report() is deprecated: live.report is the report itself (a "
                      "property, as acc.report and panel.report are); drop the ().",
                      DeprecationWarning, stacklevel=2)
        return self

    @property
    def n_batches(self) -> int:
        return sum(s.n_batches for s in self.segments)

    @property
    def n_samples(self) -> int:
        return sum(s.n_samples for s in self.segments)

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.segments)

    @property
    def wait_s(self) -> float:
        return sum(s.wait_s for s in self.segments)

    @property
    def samples_per_s(self) -> float:
        """Over every batch the loop drew: its samples over its wall time (steps and waits)."""
        return _rate(self.n_samples, self.wall_s)

    @property
    def stall_fraction(self) -> float:
        """Time the loop waited in next() over its wall time, over every batch, in [0, 1]."""
        return _stall(self.wait_s, self.wall_s)

    @property
    def current(self) -> LoaderSegment | None:
        """The segment of the settings in force (the latest); None before the first batch."""
        return self.segments[-1] if self.segments else None

    @property
    def best(self) -> LoaderSegment | None:
        """The segment whose loop ran fastest (samples/s), among those with batches."""
        measured = [s for s in self.segments if s.n_batches]
        return max(measured, key=lambda s: s.samples_per_s) if measured else None

    def summary(self) -> str:
        if not self.n_batches:
            return f"{_label(self.settings)}: no batch drawn yet"
        n = len(self.switches)
        switched = f", {n} switch{'es' if n > 1 else ''}" if n else ""
        return (f"{_label(self.settings)}: the loop ran {_html.format_number(self.samples_per_s)}"
                f" samples/s, {self.stall_fraction:.0%} of its time waiting for data "
                f"({self.n_batches} batches{switched})")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        rows: list[tuple[str, object]] = [
            ("settings in force", ", ".join(f"{k}={v!r}" for k, v in self.settings.items())),
            ("samples/s (the loop's)", _html.format_number(self.samples_per_s)),
            ("waiting for data", f"{self.stall_fraction:.1%} of the loop's wall time"),
            ("batches", f"{self.n_batches} in {self.epoch} epoch(s)"),
            ("autotune", self.autotune_status or ("on" if self.autotune else "off")),
        ]
        rows += [("switch", switch.summary()) for switch in self.switches]
        rows += [("warning", text) for text in self.warnings]
        return rows

    def _repr_html_(self) -> str:
        segments = _html.table(
            [(i + 1, s.label, s.epoch, s.batch, s.n_batches,
              _html.format_number(s.samples_per_s, 4), f"{s.stall_fraction:.1%}",
              f"{s.step_s * 1e3:.3g} ms") for i, s in enumerate(self.segments)],
            caption="the loop's own numbers, per setting",
            header=("#", "setting", "from epoch", "batch", "batches", "samples/s",
                    "waiting for data", "step ms"))
        return _html.report_html(self, "batchwidgets: live_loader", self.rows(), segments)
