"""``LoaderPanel(live)``: the panel's controls bound to a live loader's running training loop, its
readout that loop's own numbers, refreshed from a small daemon thread while the cell runs.

Usage:
    >>> live = bw.live_loader(dataset, batch_size=64)   # doctest: +SKIP
    >>> panel = bw.LoaderPanel(live)                    # doctest: +SKIP
    >>> for batch in live:                              # doctest: +SKIP
    ...     panel.num_workers.value = 2   # as a click does: the next batch comes from 2 workers
"""

from __future__ import annotations

import html
import threading
import time
from typing import TYPE_CHECKING, Any

from ..engine.loader import LiveLoader, one_line, usable_cpus
from ..plots import plot_live_loader
from ..results import LiveLoaderReport
from . import _controls as widgets
from ._panel import ReportDisplay, figure_png

if TYPE_CHECKING:
    from .loader import LoaderPanel

REFRESH_S = 0.5  # the readout follows the loop at most this often
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


class LiveBinding:
    """What ``LoaderPanel(live)`` does differently (mixed in before ``LoaderPanel``): no
    measurement of its own; the controls call ``live.set``, an "autotune" checkbox sets
    ``live.autotune``, and a daemon thread refreshes the readout from ``live.report()``.

    Parameters
    ----------
    live : LiveLoader
        The loader the training loop iterates (``bw.live_loader``); the panel never closes it.
    max_workers : int, optional
        Largest ``num_workers`` offered (default: the usable CPUs).
    refresh_s : float
        Seconds between two looks at the loop's report (the readout changes only with it).

    Attributes
    ----------
    num_workers, pin_memory, prefetch_factor, persistent_workers : widgets
        Start at the loader's settings; set ``.value`` (or click) to switch the running loop at
        its next batch. Bad settings are shown in ``status`` (one line, also in ``error``) and
        the control goes back. They follow switches asked for by code or autotune.
    batch_size : BoundedIntText
        Shown, disabled: the epoch's batches cannot change while it runs.
    autotune : Checkbox
        ``live.autotune``; a control changed by hand turns it off, as ``live.set`` does.
    report : LiveLoaderReport
        ``live.report()``: the loop's own numbers so far.
    loader : LiveLoader
        ``live`` itself.
    """

    def __init__(self: LoaderPanel, live: LiveLoader, *, max_workers: int | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        if not isinstance(refresh_s, (int, float)) or refresh_s <= 0:
            raise ValueError(f"refresh_s should be a positive number of seconds, but got "
                             f"refresh_s={refresh_s!r}; {REFRESH_S} is a good start.")
        self._live, self.refresh_s = live, refresh_s
        self.source, self.device = live, None
        self.max_workers = usable_cpus() if max_workers is None else max_workers
        self.error: Exception | None = None
        self._quiet = threading.local()  # See NOTE [ Controls of a running loop ]
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
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, daemon=True,
                                           name="batchwidgets-live-panel")
        self._refresher.start()

    def _autotune_control(self) -> widgets.Checkbox:
        checkbox = widgets.Checkbox(value=self._live.autotune, description="autotune")
        checkbox.observe(self._on_autotune_box, names="value")
        return checkbox

    # -- state ---------------------------------------------------------------------------------

    @property
    def report(self) -> LiveLoaderReport:
        """``live.report()``: the running loop's own numbers (any thread)."""
        return self._live.report()

    @property
    def loader(self) -> LiveLoader:
        """The live loader itself (the panel neither copies nor closes it)."""
        return self._live

    # -- user actions -> live.set, at once -----------------------------------------------------

    def _on_control(self: LoaderPanel, _change: dict) -> None:
        if getattr(self._quiet, "on", False):
            return
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

    def _on_autotune_box(self: LoaderPanel, change: dict) -> None:
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

    def _show_error(self, error: Exception) -> None:
        self.error = error
        self.status.value = one_line(error)

    # -- the loop -> the panel -----------------------------------------------------------------

    def _follow(self: LoaderPanel, force: bool = False) -> None:
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

    def refresh(self: LoaderPanel, *, chart: bool = False) -> LiveLoaderReport:
        """Show the loop's numbers now (the refresher does it every ``refresh_s`` while they
        change; any thread) and return ``report``; ``chart``: draw the chart too if it is out
        of date (it is drawn seldom while the loop runs)."""
        with self._refreshing:
            report, requested = self._live.report(), self._live.requested
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

    def wait(self, timeout: float | None = None) -> LiveLoaderReport:
        """Refresh now and return ``report``, also written into the static copy of the panel's
        displays (what a saved notebook shows). Nothing is measured, so nothing to wait for."""
        report = self.refresh(chart=True)
        if threading.current_thread() is threading.main_thread():
            self.refresh_displays()
        return report

    def measure(self) -> LiveLoaderReport:
        """The loop measures itself: the same as ``wait()``."""
        return self.wait()

    def close(self) -> None:
        """Stop the refresher, then close the widgets; the live loader runs on (yours)."""
        refresher = self.__dict__.get("_refresher")  # None when __init__ failed
        if refresher is not None:
            self._stop.set()
            if refresher is not threading.current_thread():
                refresher.join(JOIN_S)
        ReportDisplay.close(self)  # not LoaderPanel.close: there is no measurement to stop
