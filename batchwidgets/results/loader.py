"""The input-pipeline reports: ``LoaderTrial``, ``LoaderReport``, ``DataStallReport``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _html
from ._text import Short, TextForm


@dataclass(frozen=True)
class LoaderTrial(Short):
    """One DataLoader setting, measured by ``measure_loader``: steady-state throughput over a
    bounded time, with the warm-up (worker start to the first batch) reported apart."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None  # None when num_workers == 0
    persistent_workers: bool
    batch_size: int | None  # None: the loader's own batch_sampler (or no batching) decides
    samples_per_s: float  # steady state, warm-up excluded; 0.0 when it failed
    batches_per_s: float
    bytes_per_s: float  # bytes of the batches' tensors (copied to the device when one is given)
    first_batch_s: float  # warm-up: from creating the iterator (worker start) to the first batch
    n_batches: int  # batches timed after the warm-up
    n_samples: int
    duration_s: float  # time spent timing, warm-up excluded
    device: str  # where batches were copied ("cpu": no copy)
    error: str = ""  # one line when this setting failed (a worker raised, pickling...)
    n_epoch_ends: int = 0  # times the loader ran out inside the timed window and was restarted
    cancelled: bool = False  # should_stop ended the timing before duration_s
    warnings: tuple[str, ...] = ()  # what measure_loader warned about for this setting

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def settings(self) -> dict[str, object]:
        """The DataLoader keyword arguments of this setting (``batch_size`` only when known)."""
        settings: dict[str, object] = {
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers}
        if self.batch_size is not None:
            settings["batch_size"] = self.batch_size
        return settings

    @property
    def bytes_per_batch(self) -> float:
        return self.bytes_per_s / self.batches_per_s if self.batches_per_s else 0.0

    @property
    def label(self) -> str:
        """Short name of the setting, e.g. ``'4 workers, pinned, prefetch 4, persistent'``."""
        parts = ["no workers" if self.num_workers == 0 else
                 f"{self.num_workers} worker{'s' if self.num_workers > 1 else ''}"]
        if self.pin_memory:
            parts.append("pinned")
        if self.num_workers:
            parts.append(f"prefetch {self.prefetch_factor}")
        if self.persistent_workers:
            parts.append("persistent")
        return ", ".join(parts)

    def summary(self) -> str:
        if not self.ok:
            return f"{self.label}: failed: {self.error}"
        return (f"{self.label}: {_html.format_number(self.samples_per_s)} samples/s, first batch "
                f"after {self.first_batch_s:.3f} s{' (cancelled)' if self.cancelled else ''}")


@dataclass(frozen=True)
class DataStallReport(TextForm):
    """What ``data_stall`` found: how much of a training step waits on the input pipeline."""

    stall_fraction: float  # share of the step's time spent waiting on data, in [0, 1]
    step_time_s: float  # per step with the real loader
    replay_step_time_s: float  # per step with one batch replayed from the device
    data_wait_s: float  # per step: step_time_s - replay_step_time_s, at least 0
    n_steps: int  # steps timed with each
    device: str

    def summary(self) -> str:
        return (f"{self.stall_fraction:.0%} of each step waits on data "
                f"({self.data_wait_s * 1e3:.3g} ms of {self.step_time_s * 1e3:.3g} ms, "
                f"{self.n_steps} steps on {self.device})")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        return [("data stall", f"{self.stall_fraction:.1%} of the step time"),
                ("step with the loader", f"{_html.format_number(self.step_time_s * 1e3)} ms"),
                ("step on a replayed batch",
                 f"{_html.format_number(self.replay_step_time_s * 1e3)} ms"),
                ("waiting on data per step", f"{_html.format_number(self.data_wait_s * 1e3)} ms"),
                ("steps timed", f"{self.n_steps} of each on {self.device}")]

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: data_stall", self.rows(), plot=False)


# NOTE [ A LoaderReport holds no data ]
# A report is plain data: compared with ==, pickled, turned into a dict by dataclasses.asdict.
# The loader or dataset measured is none of that (asdict deep-copied it, pickle wrote it), so no
# field holds it. ``report.make_loader()`` is still kept for convenience: the engine, which made
# the report, attaches a factory with ``with_factory`` (``make_loader`` over the data measured),
# as a private instance attribute (``_make_loader``, through object.__setattr__: the class is
# frozen) that is no dataclass field, so ==, repr, asdict and dataclasses.replace never see it,
# and ``__getstate__`` leaves it out of pickle and copy. So results/ needs no torch and never
# imports the engine, not even lazily. The factory lives as long as the report, as the
# DataLoader the user made does. A report without it (unpickled, copied, replaced, rebuilt)
# says in one line to call ``batchwidgets.make_loader(data, **report.best.settings)``.
_FACTORY = "_make_loader"


def with_factory(report: LoaderReport, factory: Callable[..., Any]) -> LoaderReport:
    """``report``, whose ``make_loader(**overrides)`` returns ``factory(**settings)`` (see NOTE
    [ A LoaderReport holds no data ]); returns the same object."""
    object.__setattr__(report, _FACTORY, factory)
    return report


@dataclass(frozen=True)
class LoaderReport(TextForm):
    """What ``tune_loader`` (or a ``LoaderPanel``) measured: every DataLoader setting tried, the
    fastest, and the one this report is about (``current``: the best, or the panel's latest)."""

    trials: tuple[LoaderTrial, ...]  # in the order measured
    best_index: int  # fastest trial that ran
    current_index: int
    device: str
    grid_size: int  # settings in the full grid, of which the search measured len(trials)
    search_time_s: float
    warnings: tuple[str, ...] = ()
    stall: DataStallReport | None = None  # with tune_loader(step=...): for the best setting
    # No field holds the data measured: see NOTE [ A LoaderReport holds no data ].

    @property
    def best(self) -> LoaderTrial:
        return self.trials[self.best_index]

    @property
    def current(self) -> LoaderTrial:
        return self.trials[self.current_index]

    @property
    def samples_per_s(self) -> float:
        return self.current.samples_per_s

    @property
    def n_trials(self) -> int:
        """Settings measured (of ``grid_size`` in the full grid)."""
        return len(self.trials)

    @property
    def baseline(self) -> LoaderTrial | None:
        """The first trial with no workers that ran (what ``speedup`` compares against)."""
        return next((t for t in self.trials if t.num_workers == 0 and t.ok), None)

    @property
    def speedup(self) -> float | None:
        """samples/s of the best setting over that with no workers; None without that trial."""
        base = self.baseline
        if base is None or not base.samples_per_s:
            return None
        return self.best.samples_per_s / base.samples_per_s

    def make_loader(self, **overrides: object) -> Any:
        """A ``torch.utils.data.DataLoader`` over the data measured with the best settings;
        ``overrides`` (e.g. ``num_workers=2``) replace single settings. Same as
        ``batchwidgets.make_loader(data, **report.best.settings)``, which also works on a
        report that was pickled, copied or rebuilt (they keep no data)."""
        factory = self.__dict__.get(_FACTORY)
        if factory is None:
            raise ValueError("report should come from tune_loader or a LoaderPanel in this "
                             "process, but got a report without its data (pickled, copied or "
                             "rebuilt; reports keep no data); call "
                             "batchwidgets.make_loader(data, **report.best.settings).")
        return factory(**{**self.best.settings, **overrides})

    def __getstate__(self) -> dict[str, Any]:  # pickle and copy: the fields, never the data
        return {name: value for name, value in self.__dict__.items() if name != _FACTORY}

    def summary(self) -> str:
        best = self.best
        faster = (f", {self.speedup:.2g}x no workers" if self.speedup and best.num_workers
                  else "")
        return (f"best: {best.label} at {_html.format_number(best.samples_per_s)} samples/s"
                f"{faster} ({self.n_trials} of {self.grid_size} settings tried in "
                f"{self.search_time_s:.1f} s on {self.device})")

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        best = self.best
        rows: list[tuple[str, object]] = [
            ("device", self.device),
            ("best setting", ", ".join(f"{k}={v!r}" for k, v in best.settings.items())),
            ("samples/s (best)", _html.format_number(best.samples_per_s)),
            ("speedup over no workers", "-" if self.speedup is None
             else f"{self.speedup:.2f}x"),
            ("time to first batch (best)", f"{best.first_batch_s:.3f} s"),
            ("settings tried", f"{self.n_trials} of {self.grid_size} in the full grid, "
                               f"{self.search_time_s:.1f} s"),
        ]
        if self.current_index != self.best_index:
            current = f"{self.current.label}: {_html.format_number(self.samples_per_s)} samples/s"
            rows.insert(1, ("current setting", current))
        if self.stall is not None:
            rows.append(("data stall (best setting)", self.stall.summary()))
        rows += [("warning", text) for text in self.warnings]
        return rows

    def _trial_rows(self) -> list[tuple[object, ...]]:
        rows = []
        for i, t in enumerate(self.trials):
            mark = "best" if i == self.best_index else ("current" if i == self.current_index
                                                        else "")
            rows.append((i + 1, mark, t.num_workers, t.pin_memory, t.prefetch_factor or "-",
                         t.persistent_workers, _html.format_number(t.samples_per_s, 4),
                         _html.format_number(t.batches_per_s), _html.format_bytes(t.bytes_per_s),
                         f"{t.first_batch_s:.3f}", t.error or ("cancelled" if t.cancelled else "")))
        return rows

    def _repr_html_(self) -> str:
        trials = _html.table(self._trial_rows(), caption="settings, in the order measured",
                             header=("#", "", "num_workers", "pin_memory", "prefetch_factor",
                                     "persistent_workers", "samples/s", "batches/s",
                                     "bytes/s", "first batch s", "error"))
        return _html.report_html(self, "batchwidgets: tune_loader", self.rows(), trials)
