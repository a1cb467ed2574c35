"""LoaderPanel: the DataLoader options as live controls, re-measured off the main thread; or,
given a live loader, the controls of the training loop that iterates it, switched at its next batch.
One object, one module: LoaderPanel in both its modes, over the 400-line mark (STYLE G10).

One anywidget widget (``_controls.Panel``): the readout first, then the controls, the chart and
the engine's warnings.

Usage:
    >>> import batchwidgets as bw
    >>> panel = bw.LoaderPanel(dataset, batch_size=64)  # measures the defaults  # doctest: +SKIP
    >>> panel.num_workers.value = 2          # re-measures in the background     # doctest: +SKIP
    >>> panel.wait().samples_per_s           # doctest: +SKIP
    >>> loader = panel.loader                # a new DataLoader, yours to keep   # doctest: +SKIP
    >>> live = bw.live_loader(dataset, batch_size=64)   # doctest: +SKIP
    >>> panel = bw.LoaderPanel(live)                    # doctest: +SKIP
    >>> for batch in live:                              # doctest: +SKIP
    ...     panel.num_workers.value = 2   # as a click does: the next batch comes from 2 workers
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
from .._kernel_poll import WidgetPoll
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
from ..plots import plot_live_loader, plot_loader
from ..results import LiveLoaderReport, LoaderReport, LoaderTrial
from . import _controls as widgets
from ._panel import ReportDisplay, figure_png
from ._runner import Runner, Task

JobKind = Literal["measure", "tune"]
PREFETCH_FACTORS = (1, 2, 4, 8)  # the choices offered besides DataLoader's default (None: 2)
CLOSE_TIMEOUT_S = 60.0  # close() waits this long for the measurement in flight to stop
REFRESH_S = 0.5  # a live loader's readout follows the loop at most this often
CHART_S = 30.0  # while the loop runs steadily, the chart at most this often; See NOTE below
PAUSE_S = 2.0  # no batch for this long: the loop has paused, the chart catches up
JOIN_S = 10.0  # close() waits this long for a refresh in flight

# NOTE [ Controls of a running loop ]
# The controls show ``live.requested``: the settings of the loop's next batch, the panel's own
# or those asked for by code (``live.set``) or autotune. A change of a control calls
# ``live.set`` at once (cheap: the loop switches at its next batch; nothing is measured here),
# so a click dispatched between batches lands at the very next one. The refresher thread then
# only follows what others asked for: it compares ``live.requested`` with what it last showed
# and, when they differ, sets the controls while ``_quiet`` is on in its own thread, so their
# observers do not call ``set`` back (which would turn autotune off). The readout, the chart and
# the autotune checkbox follow the report; nothing is computed here but formatting.
#
# The chart is a PNG that takes 70-95 ms of CPU to draw (2-core CPU), mostly holding the GIL the
# training loop needs too: drawn every 2 s, it would take 4-5% of the loop's time. So it is drawn
# after a switch, when the loop has paused (no batch for PAUSE_S: the cell ended, or it waits)
# and otherwise at most every CHART_S (under 0.3%). The readout, a few hundred bytes of HTML
# (0.25 ms a refresh), follows every REFRESH_S. ``wait()`` draws it at once.

# NOTE [ Clicks while the training cell runs ]
# A click reaches the kernel as a comm message. Sent to the kernel's main shell, it waits there
# while a cell runs: the panel of a live loader registers a kernel poll with the loader
# (``live.on_batch``), which dispatches the waiting comm messages between batches (NOTE [ Widget
# messages while a cell runs ] in _kernel_poll.py); the engine itself knows nothing of Jupyter.
# A front end that sends widget messages over kernel subshells (JupyterLab 4.4+ with ipykernel 7
# does by default; its "Kernel Comms over subshells" setting turns it off) puts a
# ``subshell_id`` in their header, and the kernel runs such a message on that subshell's thread
# while the cell runs on the main one: it lands mid-cell with no poll. Which way a message came
# is read from the message itself, never from version numbers: a ``subshell_id`` in its header
# and handled off the main thread. From such a message on, the panel leaves the poll out for the
# rest of that epoch; any message handled on the main thread turns the poll back on, and every
# new epoch polls again until one comes over a subshell, because the kernel decides per message
# where it runs: ipykernel 7.4 sends a comm's messages to the subshell it last published under,
# the main shell once the panel has published from a cell (its refresher does, under the cell),
# whatever the header says. Front ends that send no subshell_id, and kernels without subshells
# (ipykernel 6), reach only the main shell: the poll serves them.


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


def _part(name: str, value: str, unit: str = "") -> str:
    """One number of the readout in a named span (for stylesheets and browser tests)."""
    return (f'<span class="batchwidgets-loader-{name}">{html.escape(value)}</span>'
            f"{' ' + html.escape(unit) if unit else ''}")


def _live_readout(report: LiveLoaderReport, requested: dict[str, Any]) -> str:
    """The loop's samples/s and data stall with the setting in force, overall, the settings
    in force (and those of the next batch when a switch waits), and the last switch."""
    current = report.current
    lines = []
    if current is None:
        lines.append(f"<b>{_part('samples-per-s', '-', 'samples/s')}</b> (no batch drawn yet)")
    else:
        lines.append(" &middot; ".join([
            f"<b>{_part('samples-per-s', f'{current.samples_per_s:,.0f}', 'samples/s')}</b> "
            f"of the loop with these settings",
            f"{_part('stall', f'{current.stall_fraction:.0%}')} of its time waiting for data",
            f"overall {_part('overall-samples-per-s', f'{report.samples_per_s:,.0f}')} "
            f"samples/s, {report.stall_fraction:.0%} waiting, {report.n_batches} batches"]))
    in_force = ", ".join(f"{k}={v!r}" for k, v in report.settings.items())
    lines.append(f"in force: {_part('settings', in_force)}")
    if requested != report.settings:
        asked = ", ".join(f"{k}={v!r}" for k, v in requested.items() if report.settings[k] != v)
        lines.append(f"from the next batch: {_part('requested', asked)}")
    if report.switches:
        lines.append(f"last switch: {_part('last-switch', report.switches[-1].summary())}")
    if report.autotune_status:
        lines.append(f"autotune: {_part('autotune-status', report.autotune_status)}")
    return "<br>".join(lines)


def _offer(dropdown: widgets.Dropdown, value: Any) -> None:
    """Offer ``value`` too, when code or autotune asked for a setting the dropdown lacks."""
    pairs = [option if isinstance(option, tuple) else (str(option), option)
             for option in dropdown.options]
    if value not in [offered for _, offered in pairs]:
        pairs.append((str(value), value))
        dropdown.options = sorted(pairs, key=lambda pair: (pair[1] is not None, pair[1] or 0))


class LoaderPanel(ReportDisplay, widgets.Panel):
    """Controls named after the DataLoader options; each change re-measures the loader in the
    background (``measure_loader``), shows samples/s, bytes/s to the device and the time to the
    first batch, and adds the setting to a chart. "Auto-tune" runs ``tune_loader`` and sets the
    controls to the best setting measured.

    Given a live loader (``bw.live_loader``) instead, the panel is bound to the training loop
    that iterates it: no measurement of its own; its controls call ``live.set`` (the loop
    switches at its next batch, also on a click while the training cell runs), an "autotune"
    checkbox sets ``live.autotune``, and a daemon thread refreshes the readout from
    ``live.report``, the loop's own numbers.

    Parameters
    ----------
    loader_or_dataset : DataLoader, Dataset or LiveLoader
        What to measure; a DataLoader's options are the controls' starting values. A live
        loader: the loop to follow and switch (the panel never closes it).
    device : str or torch.device, optional
        Where batches are copied; default the accelerator when there is one, else no copy. None
        for a live loader (the loop copies its batches itself).
    batch_size : int, optional
        The starting batch size instead of the loader's (a Dataset's default is 32). None for a
        live loader (the epoch's batches cannot change while it runs).
    duration_s : float
        Seconds each setting is timed, after its first batch (not used for a live loader).
    max_workers : int, optional
        Largest ``num_workers`` offered, and tried by auto-tune (default: the usable CPUs).
    start : bool
        Measure the starting settings right away, in the background (not for a live loader).
    refresh_s : float
        A live loader's: seconds between two looks at the loop's report (the readout changes
        only with it).

    Attributes
    ----------
    num_workers, pin_memory, prefetch_factor, persistent_workers, batch_size : widgets
        The controls. Set ``.value`` (or click them) to measure another setting; only the
        latest of quick changes is measured. Without workers, ``prefetch_factor`` (None) and
        ``persistent_workers`` (False) are disabled, as DataLoader requires. For a live loader
        they start at its settings and switch the running loop at its next batch; a bad setting
        is shown in ``status`` (one line, also in ``error``) and the control goes back; they
        follow switches asked for by code or autotune; ``batch_size`` is shown, disabled.
    autotune : Button or Checkbox
        Runs ``tune_loader`` in the background, then shows the best setting measured in this
        panel (tune's own, or an earlier one that ran faster) in the controls, the readout and
        ``report`` (its ``current`` is then its ``best``). For a live loader, a checkbox:
        ``live.autotune``; a control changed by hand turns it off, as ``live.set`` does.
    report : LoaderReport, LiveLoaderReport or None
        Every setting measured in this panel (the latest measurement of each); ``current`` is
        the one measured last, so ``report.samples_per_s`` is the latest samples/s. For a live
        loader, ``live.report``: the loop's own numbers so far.
    loader : DataLoader or LiveLoader
        A new DataLoader with the current settings. It is the caller's: the panel keeps no
        reference to it and never starts its workers, so its (persistent) workers live and
        stop as with any DataLoader you make. For a live loader, the live loader itself.
    error : Exception or None
        What the last measurement (or ``live.set``) raised, also shown in the panel; None after
        a success.

    Examples
    --------
    >>> panel = LoaderPanel(dataset, batch_size=64)          # doctest: +SKIP
    >>> panel.num_workers.value = 2                          # doctest: +SKIP
    >>> panel.wait().samples_per_s                           # doctest: +SKIP
    """

    def __init__(self, loader_or_dataset: DataLoader | Any, device: Any = None, *,
                 batch_size: int | None = None, duration_s: float = 1.0,
                 max_workers: int | None = None, start: bool = True,
                 refresh_s: float = REFRESH_S) -> None:
        if not isinstance(duration_s, (int, float)) or duration_s <= 0:
            raise ValueError(f"duration_s should be a positive number of seconds, but got "
                             f"duration_s={duration_s!r}; 1.0 is a good start.")
        if not isinstance(refresh_s, (int, float)) or refresh_s <= 0:
            raise ValueError(f"refresh_s should be a positive number of seconds, but got "
                             f"refresh_s={refresh_s!r}; {REFRESH_S} is a good start.")
        self._live = loader_or_dataset if isinstance(loader_or_dataset, LiveLoader) else None
        for name, value in (("device", device), ("batch_size", batch_size)):
            if self._live is not None and value is not None:
                raise ValueError(f"{name} should be None for a live loader, whose loop sets it, "
                                 f"but got {name}={value!r}; leave it out.")
        self.source, self.device, self.duration_s = loader_or_dataset, device, duration_s
        self.refresh_s = refresh_s
        self.max_workers = usable_cpus() if max_workers is None else max_workers
        self.error: Exception | None = None
        self._report: LoaderReport | None = None  # all panel state: every setting measured
        self._measuring_s = 0.0  # time spent measuring in this panel
        self._quiet = threading.local()  # set while the panel itself changes its controls
        if self._live is None:
            self._runner = Runner(on_error=self._show_error, name="batchwidgets-loader")
            self._build(make_loader(loader_or_dataset, batch_size=batch_size))  # no workers
            if start:
                self._post(_Job("measure", self.settings))
        else:
            self._bind()

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
        if self._live is not None:  # the live loader's own autotune
            checkbox = widgets.Checkbox(value=self._live.autotune, description="autotune")
            checkbox.observe(self._on_autotune_box, names="value")
            return checkbox
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

    def _bind(self) -> None:
        """Bound to a live loader: the controls at its settings, its loop's numbers, a refresher
        thread, and the kernel poll between its batches (NOTE [ Clicks while the training cell
        runs ])."""
        live = self._live
        self._epoch_seen = -1  # the epoch of the loop's last batch
        self._subshell_epoch: int | None = None  # an epoch whose clicks came over a subshell
        self._refreshing = threading.RLock()
        self._shown: dict[str, Any] = {}  # the controls show live.requested from refresh()
        self._seen: tuple | None = None
        self._chart_at = -CHART_S  # time.monotonic() of the last chart
        self._chart_seen = (0, 0)  # (segments, batches) it showed
        self._batches_seen = (0, time.monotonic())  # batches at the last look, when they grew
        self._build(live)
        self.batch_size.disabled = True
        self.status.value = "bound to the running loop"
        self.refresh()
        self._poll = WidgetPoll()
        live.on_batch(self._between_batches)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, daemon=True,
                                           name="batchwidgets-live-panel")
        self._refresher.start()

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
    def report(self) -> LoaderReport | LiveLoaderReport | None:
        """Every setting measured in this panel; ``current`` is the one measured last. For a
        live loader, ``live.report``: the running loop's own numbers (any thread)."""
        return self._live.report if self._live is not None else self._report

    @property
    def loader(self) -> DataLoader:
        """A new DataLoader with the current settings; the caller owns it and its workers. For
        a live loader, the live loader itself (the panel neither copies nor closes it)."""
        return self._live if self._live is not None else make_loader(self.source,
                                                                     **self.settings)

    # -- user actions -> requests for the background thread ------------------------------------

    def _on_control(self, _change: dict) -> None:  # cheap: runs in the kernel's main thread
        if getattr(self._quiet, "on", False):
            return
        if self._live is not None:
            self._switch_live()
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
        """What a measurement (or ``live.set``) raised: shown in the panel; the kernel and the
        panel live on."""
        self.error = error
        self.status.value = one_line(error)
        if self._live is None:
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

    # -- a live loader: user actions -> live.set, at once -------------------------------------

    def _switch_live(self) -> None:
        with self._refreshing:  # the refresher does not write the controls meanwhile
            self._sync_worker_options()
            settings = {k: v for k, v in self.settings.items() if k != "batch_size"}
            try:
                self._live.set(**settings)
            except (TypeError, ValueError) as error:  # the engine's one-line checks
                self._show_error(error)
            else:
                self.error = None
                self.status.value = "switching at the next batch"
            self._follow(force=True)  # autotune is off now; a refused setting goes back

    def _on_autotune_box(self, change: dict) -> None:
        if getattr(self._quiet, "on", False):
            return
        with self._refreshing:
            try:
                self._live.autotune = change["new"]
            except (ImportError, ValueError) as error:
                self._show_error(error)
            else:
                self.error = None
                self.status.value = f"autotune {'on' if change['new'] else 'off'}"
            self._follow(force=True)

    def _handle_msg(self, msg: dict) -> None:
        """A message from the front end: which way it came, for a live loader's poll (NOTE
        [ Clicks while the training cell runs ]), then as every widget handles it."""
        if self._live is not None:
            over_subshell = (bool((msg.get("header") or {}).get("subshell_id"))
                             and threading.current_thread() is not threading.main_thread())
            self._subshell_epoch = self._epoch_seen if over_subshell else None
        super()._handle_msg(msg)

    def _between_batches(self, epoch: int, batch: int) -> None:
        """The live loader's ``on_batch``: dispatch the clicks waiting in the kernel, unless
        this epoch's come over a subshell (NOTE [ Clicks while the training cell runs ])."""
        self._epoch_seen = epoch
        if self._subshell_epoch != epoch:
            # its one warning points at the loop: poll, here, LiveLoader._next, Epoch.__next__
            self._poll.poll(stacklevel=5)

    # -- a live loader: the loop -> the panel ---------------------------------------------------

    def _follow(self, force: bool = False) -> None:
        """Show ``live.requested`` and ``live.autotune`` in the controls without calling ``set``
        (NOTE [ Controls of a running loop ]): when they changed since last shown, or ``force``."""
        requested, autotune = self._live.requested, self._live.autotune
        if not force and requested == self._shown and autotune == self.autotune.value:
            return  # the refresher's common case: it writes nothing a user may be changing
        self._quiet.on = True
        try:
            if force or requested != self._shown:
                self._shown = requested
                for name, value in requested.items():
                    control = getattr(self, name)
                    if isinstance(control, widgets.Dropdown):
                        _offer(control, value)
                    control.value = value
            self.autotune.value = autotune
        finally:
            self._quiet.on = False
        self._sync_worker_options()

    def refresh(self, *, chart: bool = False) -> LiveLoaderReport:
        """Show the loop's numbers now (the refresher does it every ``refresh_s`` while they
        change; any thread) and return ``report``; ``chart``: draw the chart too if it is out
        of date (it is drawn seldom while the loop runs)."""
        with self._refreshing:
            report, requested = self._live.report, self._live.requested
            self._follow()
            seen = (report.n_batches, len(report.switches), tuple(requested.items()),
                    report.autotune, report.autotune_status, report.warnings)
            if seen != self._seen:
                self._seen = seen
                self.readout.value = _live_readout(report, requested)
                self.messages.value = "".join(f"<p>&#9888; {html.escape(note)}</p>"
                                              for note in report.warnings)
                if self.error is None:
                    self.status.value = report.summary()
            self._draw_chart(report, now=chart)
            return report

    def _draw_chart(self, report: LiveLoaderReport, now: bool) -> None:
        """Draw the chart when it is out of date and the loop can spare it (NOTE [ Controls of
        a running loop ])."""
        chart, clock = (len(report.segments), report.n_batches), time.monotonic()
        if report.n_batches != self._batches_seen[0]:
            self._batches_seen = (report.n_batches, clock)
        if chart[1] == self._chart_seen[1]:
            return
        switched = chart[0] != self._chart_seen[0] and chart[0] > 1
        paused = clock - self._batches_seen[1] >= PAUSE_S
        if now or switched or paused or clock - self._chart_at >= CHART_S:
            self._chart_seen, self._chart_at = chart, time.monotonic()
            self.chart.value = figure_png(plot_live_loader(report))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    # -- waiting, measuring now, closing -------------------------------------------------------

    def wait(self, timeout: float | None = None) -> LoaderReport | LiveLoaderReport | None:
        """Wait until nothing is measured or waiting to be; return ``report``, also written into
        the static copy of the panel's displays (what a saved notebook shows). Raises nothing:
        an error is shown in the panel and kept in ``error``. For a live loader nothing is
        measured: the readout and chart are refreshed now."""
        if self._live is not None:
            report = self.refresh(chart=True)
        else:
            self._runner.wait(timeout)
            report = self._report
        if threading.current_thread() is threading.main_thread():  # the kernel's, not a runner's
            self.refresh_displays()
        return report

    def measure(self) -> LoaderReport | LiveLoaderReport | None:
        """Measure the current settings (again) and return ``report`` when done; a live loader's
        loop measures itself: the same as ``wait()``."""
        if self._live is None:
            self._post(_Job("measure", self.settings), again=True)
        return self.wait()

    def close(self) -> None:
        """Stop the measurement in flight (its workers shut down), or a live loader's refresher
        and poll (the loader runs on: yours); then close the widgets."""
        runner, refresher = self.__dict__.get("_runner"), self.__dict__.get("_refresher")
        if runner is not None:  # either is None when __init__ failed
            runner.close(CLOSE_TIMEOUT_S)
        if refresher is not None:
            self._live.on_batch(self._between_batches, remove=True)
            self._stop.set()
            if refresher is not threading.current_thread():
                refresher.join(JOIN_S)
        super().close()
