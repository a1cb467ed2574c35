"""LoaderPanel: the DataLoader options as live controls, re-measured off the main thread.

One anywidget widget (``_controls.Panel``): the readout first, then the controls, the chart and
the engine's warnings.

Usage:
    >>> import batchwidgets as bw
    >>> panel = bw.LoaderPanel(dataset, batch_size=64)  # measures the defaults  # doctest: +SKIP
    >>> panel.num_workers.value = 2          # re-measures in the background     # doctest: +SKIP
    >>> panel.wait().samples_per_s           # doctest: +SKIP
    >>> loader = panel.loader                # a new DataLoader, yours to keep   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import html
import threading
import time
import warnings
from typing import Any, Literal

from torch.utils.data import DataLoader

from .. import _html
from .._warnings import BatchwidgetsWarning
from ..engine.loader import (
    LiveLoader,
    loader_report,
    make_loader,
    measure_loader,
    one_line,
    tune_loader,
    usable_cpus,
    with_data,
)
from ..plots import plot_loader
from ..results import LoaderReport, LoaderTrial
from . import _controls as widgets
from ._live_panel import LiveBinding
from ._panel import ReportDisplay, figure_png
from ._runner import Runner, Task

JobKind = Literal["measure", "tune"]
PREFETCH_FACTORS = (1, 2, 4, 8)  # the choices offered besides DataLoader's default (None: 2)
CLOSE_TIMEOUT_S = 60.0  # close() waits this long for the measurement in flight to stop


class _Job:
    """One thing for the background runner to do: measure ``settings``, or auto-tune from them
    (its ``key``: the same job asked for again while it runs is not started twice)."""

    def __init__(self, kind: JobKind, settings: dict[str, Any]) -> None:
        self.kind, self.settings = kind, settings
        self.key = (kind, tuple(settings.items()))


def _rate(trial: LoaderTrial) -> str:
    return f"{trial.samples_per_s:,.0f} samples/s"


def _readout(trial: LoaderTrial | None) -> str:
    """samples/s, bytes/s to the device and the first batch's latency, each in a named span."""
    def part(name: str, value: str, unit: str) -> str:
        return (f'<span class="batchwidgets-loader-{name}">{html.escape(value)}</span> '
                f"{html.escape(unit)}")
    if trial is None:
        return f"<b>{part('samples-per-s', '-', 'samples/s')}</b>"
    return " &middot; ".join([
        f"<b>{part('samples-per-s', f'{trial.samples_per_s:,.0f}', 'samples/s')}</b>",
        part("bytes-per-s", f"{_html.format_bytes(trial.bytes_per_s)}/s", f"to {trial.device}"),
        part("first-batch-s", f"{trial.first_batch_s:.3f} s", "to the first batch"),
    ])


def _status_line(job: _Job) -> str:
    what = "auto-tuning from" if job.kind == "tune" else "measuring"
    return f"{what} " + ", ".join(f"{name}={value}" for name, value in job.settings.items())


class LoaderPanel(ReportDisplay, widgets.Panel):
    """Controls named after the DataLoader options; each change re-measures the loader in the
    background (``measure_loader``), shows samples/s, bytes/s to the device and the time to the
    first batch, and adds the setting to a chart. "Auto-tune" runs ``tune_loader`` and sets the
    controls to the best setting measured.

    Given a live loader (``bw.live_loader``) instead, the panel is bound to the training loop
    that iterates it: its controls switch that loader at its next batch, and its readout shows
    the loop's own numbers (see ``LivePanel``, the class it then is; ``isinstance(panel,
    LoaderPanel)`` holds).

    Parameters
    ----------
    loader_or_dataset : DataLoader or Dataset
        What to measure. A DataLoader's options are the controls' starting values.
    device : str or torch.device, optional
        Where batches are copied; default the accelerator when there is one, else no copy.
    batch_size : int, optional
        The starting batch size instead of the loader's (a Dataset's default is 32).
    duration_s : float
        Seconds each setting is timed, after its first batch.
    max_workers : int, optional
        Largest ``num_workers`` offered, and tried by auto-tune (default: the usable CPUs).
    start : bool
        Measure the starting settings right away, in the background.

    Attributes
    ----------
    num_workers, pin_memory, prefetch_factor, persistent_workers, batch_size : widgets
        The controls. Set ``.value`` (or click them) to measure another setting; only the
        latest of quick changes is measured. Without workers, ``prefetch_factor`` (None) and
        ``persistent_workers`` (False) are disabled, as DataLoader requires.
    autotune : Button
        Runs ``tune_loader`` in the background, then shows the best setting measured in this
        panel (tune's own, or an earlier one that ran faster) in the controls, the readout and
        ``report`` (its ``current`` is then its ``best``).
    report : LoaderReport or None
        Every setting measured in this panel (the latest measurement of each); ``current`` is
        the one measured last, so ``report.samples_per_s`` is the latest samples/s.
    loader : DataLoader
        A new DataLoader with the current settings. It is the caller's: the panel keeps no
        reference to it and never starts its workers, so its (persistent) workers live and
        stop as with any DataLoader you make.
    error : Exception or None
        What the last measurement raised (also shown in the panel); None after a success.

    Examples
    --------
    >>> panel = LoaderPanel(dataset, batch_size=64)          # doctest: +SKIP
    >>> panel.num_workers.value = 2                          # doctest: +SKIP
    >>> panel.wait().samples_per_s                           # doctest: +SKIP
    """

    def __new__(cls, loader_or_dataset: Any = None, *args: Any, **kwargs: Any) -> LoaderPanel:
        if cls is LoaderPanel and isinstance(loader_or_dataset, LiveLoader):
            cls = LivePanel  # bound to the running loop: its __init__ runs instead
        return super().__new__(cls, loader_or_dataset, *args, **kwargs)

    def __init__(self, loader_or_dataset: DataLoader | Any, device: Any = None, *,
                 batch_size: int | None = None, duration_s: float = 1.0,
                 max_workers: int | None = None, start: bool = True) -> None:
        if not isinstance(duration_s, (int, float)) or duration_s <= 0:
            raise ValueError(f"duration_s should be a positive number of seconds, but got "
                             f"duration_s={duration_s!r}; 1.0 is a good start.")
        initial = make_loader(loader_or_dataset, batch_size=batch_size)  # no workers start
        self.source, self.device, self.duration_s = loader_or_dataset, device, duration_s
        self.max_workers = usable_cpus() if max_workers is None else max_workers
        self.error: Exception | None = None
        self._report: LoaderReport | None = None  # all panel state: every setting measured
        self._measuring_s = 0.0  # time spent measuring in this panel
        self._runner = Runner(on_error=self._show_error, name="batchwidgets-loader")
        self._quiet = threading.local()  # set while the panel itself changes its controls
        self._build(initial)
        if start:
            self._post(_Job("measure", self.settings))

    # -- layout --------------------------------------------------------------------------------

    def _build(self, initial: DataLoader) -> None:
        workers = initial.num_workers
        self.num_workers = widgets.Dropdown(
            options=sorted({*range(self.max_workers + 1), workers}), value=workers,
            description="num_workers")
        self.pin_memory = widgets.Checkbox(value=initial.pin_memory, description="pin_memory")
        prefetch = initial.prefetch_factor if workers else None
        self.prefetch_factor = widgets.Dropdown(
            options=[("default", None),
                     *((str(n), n) for n in sorted({*PREFETCH_FACTORS, prefetch or 2}))],
            value=prefetch, description="prefetch_factor")
        self.persistent_workers = widgets.Checkbox(
            value=bool(workers and initial.persistent_workers), description="persistent_workers")
        self._batching = initial.batch_size is not None  # False: the loader's batch_sampler
        self.batch_size = widgets.BoundedIntText(
            value=initial.batch_size or 1, min=1, max=2**24, description="batch_size",
            disabled=not self._batching)
        self.autotune = self._autotune_control()
        self.status = widgets.Label(value="ready")
        self.readout = widgets.HTML(value=_readout(None))
        self.chart = widgets.Image(format="png")
        self.messages = widgets.HTML()  # the engine's warnings
        for control in self._controls:
            control.observe(self._on_control, names="value")
        self._sync_worker_options()
        names = [control.description for control in self._controls]
        widgets.Panel.__init__(self, css_name="loader", layout=[
            {"parts": ["readout"]}, {"parts": names}, {"parts": ["autotune", "status"]},
            {"parts": ["chart"]}, {"parts": ["warnings"]},
        ], autotune=self.autotune, status=self.status, readout=self.readout, chart=self.chart,
            warnings=self.messages, **dict(zip(names, self._controls)))

    def _autotune_control(self) -> widgets.Control:
        button = widgets.Button(description="Auto-tune",
                                tooltip="tune_loader: measure a few settings, keep the fastest "
                                        "(off the main thread)")
        button.on_click(self._on_autotune)
        return button

    @property
    def _controls(self) -> list[widgets.Control]:
        return [self.num_workers, self.pin_memory, self.prefetch_factor,
                self.persistent_workers, self.batch_size]

    def _sync_worker_options(self) -> None:
        """DataLoader takes prefetch_factor and persistent_workers only with workers."""
        no_workers = self.num_workers.value == 0
        self._quiet.on = True
        try:
            if no_workers:
                self.prefetch_factor.value, self.persistent_workers.value = None, False
            if self.prefetch_factor.value is None:  # show "default"
                self.prefetch_factor.index = 0
            self.prefetch_factor.disabled = self.persistent_workers.disabled = no_workers
        finally:
            self._quiet.on = False

    # -- state ---------------------------------------------------------------------------------

    @property
    def settings(self) -> dict[str, Any]:
        """The DataLoader options the controls show, as ``measure_loader`` keywords."""
        workers = self.num_workers.value
        return {"num_workers": workers, "pin_memory": self.pin_memory.value,
                "prefetch_factor": self.prefetch_factor.value if workers else None,
                "persistent_workers": bool(workers and self.persistent_workers.value),
                "batch_size": self.batch_size.value if self._batching else None}

    @property
    def report(self) -> LoaderReport | None:
        """Every setting measured in this panel; ``current`` is the one measured last."""
        return self._report

    @property
    def loader(self) -> DataLoader:
        """A new DataLoader with the current settings; the caller owns it and its workers."""
        return make_loader(self.source, **self.settings)

    # -- user actions -> requests for the background thread ------------------------------------

    def _on_control(self, _change: dict) -> None:  # cheap: runs in the kernel's main thread
        if getattr(self._quiet, "on", False):
            return
        self._sync_worker_options()
        self._post(_Job("measure", self.settings))

    def _on_autotune(self, _button: Any) -> None:
        self._post(_Job("tune", self.settings))

    def _post(self, job: _Job, again: bool = False) -> None:
        """Make ``job`` the next thing to do (cheap, from any thread): only the latest request
        runs, and the one in flight stops early unless it does the same already (or ``again``)."""
        if self._runner.submit(lambda task: self._run(job, task), key=job.key, again=again):
            self.status.value = _status_line(job)

    # -- one request -> one engine call, in the background thread ------------------------------

    def _run(self, job: _Job, task: Task) -> None:
        self.error = None
        self.autotune.disabled = job.kind == "tune"
        self.status.value = _status_line(job)
        # The panel shows the engine's warnings itself; they are not printed again from this
        # thread (into whichever cell runs then). Only warnings issued from this module.
        warnings.filterwarnings("ignore", category=BatchwidgetsWarning, module=__name__)
        started = time.perf_counter()
        try:
            if job.kind == "tune":
                self._tune(job, task)
            else:
                self._measure(job, task)
        finally:
            self._measuring_s += time.perf_counter() - started
            self.autotune.disabled = False

    def _show_error(self, error: Exception) -> None:
        """What a measurement raised: shown in the panel; the kernel and the panel live on."""
        self.error = error
        self.status.value = one_line(error)
        self.readout.value = _readout(None)  # no numbers for the setting shown

    def _measure(self, job: _Job, task: Task) -> None:
        trial = measure_loader(self.source, **job.settings, device=self.device,
                               duration_s=self.duration_s, should_stop=task.should_stop)
        if not trial.cancelled:  # a control changed meanwhile: its setting is measured next
            self.render(self._with(trial))

    def _tune(self, job: _Job, task: Task) -> None:
        tuned = tune_loader(self.source, self.device, batch_size=job.settings["batch_size"],
                            max_workers=self.max_workers, duration_s=self.duration_s,
                            on_progress=self._on_trial, should_stop=task.should_stop)
        if task.cancelled:
            return
        # The best of everything this panel measured (tune's trials replaced earlier ones of the
        # same setting): the controls, the readout and the report all show that one setting.
        report = self._with(tuned.best, tuned.warnings)
        report = with_data(dataclasses.replace(report, current_index=report.best_index),
                           self.source)
        self._set_controls(report.best.settings)
        self.render(report)

    def _on_trial(self, trial: LoaderTrial) -> None:
        """Progress from ``tune_loader``: each setting joins the chart as it is measured."""
        if not trial.cancelled:
            self.render(self._with(trial))
            self.status.value = f"auto-tuning: {trial.label} ran at {_rate(trial)}..."

    def _with(self, trial: LoaderTrial, notes: tuple[str, ...] = ()) -> LoaderReport:
        """The panel's report with ``trial`` as the current one (replacing an earlier
        measurement of the same setting); the engine ranks the trials."""
        report = self._report
        trials = list(report.trials) if report is not None else []
        same = [i for i, t in enumerate(trials) if t.settings == trial.settings]
        if same:
            trials[same[0]] = trial
        else:
            trials.append(trial)
        new = loader_report(trials, current_index=same[0] if same else -1,
                            max_workers=self.max_workers, search_time_s=self._measuring_s)
        old_notes = report.warnings if report is not None else ()
        notes = tuple(dict.fromkeys([*old_notes, *new.warnings, *notes]))
        return with_data(dataclasses.replace(new, warnings=notes), self.source)  # make_loader()

    def _set_controls(self, settings: dict[str, Any]) -> None:
        """Show ``settings`` in the controls without measuring them again."""
        self._quiet.on = True
        try:
            for name, value in settings.items():
                getattr(self, name).value = value
        finally:
            self._quiet.on = False
        self._sync_worker_options()

    # -- rendering: report fields -> widget values ---------------------------------------------

    def render(self, report: LoaderReport) -> None:
        """Show ``report``: the readout of ``current``, a chart of every trial (any thread)."""
        self._report = report
        current, best = report.current, report.best
        self.readout.value = _readout(current)
        self.chart.value = figure_png(plot_loader(report))
        self.messages.value = "".join(f"<p>&#9888; {html.escape(note)}</p>"
                                      for note in report.warnings)
        self.status.value = (f"{current.label}: {_rate(current)}; best so far: "
                             f"{best.label}, {_rate(best)}")

    # -- waiting, measuring now, closing -------------------------------------------------------

    def wait(self, timeout: float | None = None) -> LoaderReport | None:
        """Wait until nothing is measured or waiting to be; return ``report``, also written into
        the static copy of the panel's displays (what a saved notebook shows). Raises nothing:
        an error is shown in the panel and kept in ``error``."""
        self._runner.wait(timeout)
        if threading.current_thread() is threading.main_thread():  # the kernel's, not a runner's
            self.refresh_displays()
        return self._report

    def measure(self) -> LoaderReport | None:
        """Measure the current settings (again) and return ``report`` when done."""
        self._post(_Job("measure", self.settings), again=True)
        return self.wait()

    def close(self) -> None:
        """Stop the measurement in flight (its workers shut down), then close the widgets."""
        self._runner.close(CLOSE_TIMEOUT_S)
        super().close()


class LivePanel(LiveBinding, LoaderPanel):
    """``LoaderPanel(live)`` for a live loader: the controls switch it at the next batch of the
    running loop, the readout shows that loop's numbers (``_live_panel.LiveBinding``)."""
