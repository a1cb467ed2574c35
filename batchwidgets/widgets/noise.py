"""NoisePanel: per-batch losses and the gradient noise scale, drawn live while a training loop runs
in the same cell (one image redrawn in place, throttled), and as a static report everywhere else.

Usage:
    >>> tracker = bw.NoiseTracker()                                   # doctest: +SKIP
    >>> noise = bw.measure_noise(model, data, loss_fn)                # doctest: +SKIP
    >>> panel = bw.NoisePanel(tracker, report=noise)                  # doctest: +SKIP
    >>> display(panel)                                                # doctest: +SKIP
    >>> with bw.accumulate(optimizer, steps=4, model=model, noise=tracker):  # doctest: +SKIP
    ...     train()
    >>> panel.refresh()          # the last numbers, also into the saved notebook  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Callable

from .. import _html
from ..engine.noise import NoiseTracker
from ..plots import plot_noise_panel
from ..results import CriticalBatchReport, NoiseReport, NoiseTrackerReport
from . import _controls as widgets
from ._panel import ReportDisplay, figure_png

# After a redraw that took t seconds, the next waits max(min_interval_s, DRAW_SHARE * t): drawing
# then takes at most 1 / (1 + DRAW_SHARE) of the training loop's time however slow it is.
DRAW_SHARE = 4.0


def _status(report: NoiseTrackerReport) -> str:
    number = _html.format_number
    loss = (f"loss {number(report.loss_mean)} ± {number(report.loss_std, 2)} (mean ± std of "
            f"the last {report.n_losses_recent} batches)" if report.loss_std is not None else
            "no losses yet")
    stall = (f" · waiting for data {100 * report.data_stall_share:.3g}% of each step"
             if report.data_stall_share is not None else "")
    sampled = f" · 1 update in {report.sample_every} measured" if report.sample_every > 1 else ""
    return (f"<b>batchwidgets: noise</b> · {html.escape(report.summary())} · "
            f"{html.escape(loss)} · {report.n_losses_seen} batches{sampled}{stall}")


class NoisePanel(ReportDisplay, widgets.Panel):
    """Per-batch losses and the gradient noise scale of a ``NoiseTracker``, live.

    Three plots in one image: each batch's loss with its rolling mean and a band of one
    standard deviation; the gradient variance against the batch size with the 1/B line (the
    tracker's two batch sizes, and every batch size of a ``measure_noise`` report if given);
    B_simple over the updates with a band of one standard error. Below them "What batch should
    I train at?": the batch the schedule suggests, the measured critical batch (the tracker's
    ``critical``, from ``critical_batch``) and B_simple, and when to trust each. Then the advice:
    critical batch size, steps-versus-examples trade-off, learning rate, the batch-size
    schedule from here, and, when the accumulated batch is well above B_simple, that
    accumulating to it does not pay (with the steps saved and the examples spent).

    The panel listens to the tracker and redraws in place, synchronously, on the thread that
    trains (widget updates reach the front end while the cell still runs), at most every
    ``min_interval_s`` and so that drawing takes at most a fifth of the time. Call
    ``refresh()`` after the loop to draw the last numbers and store the final picture in the
    notebook's static copy.

    Parameters
    ----------
    tracker : NoiseTracker, optional
        The tracker to follow; a new one (``panel.tracker``) if not given.
    report : NoiseReport, optional
        A ``measure_noise`` report: its variance at each batch size joins the middle plot.
    critical : CriticalBatchReport, optional
        A critical batch measured by ``critical_batch``: set on the tracker
        (``tracker.critical``), so the schedule follows it; the section "What batch should I
        train at?" shows it beside B_simple, with which to trust.
    min_interval_s : float
        Seconds between redraws, at least.
    clock : callable
        Seconds as a float (injectable for tests).

    Examples
    --------
    >>> panel = NoisePanel()                                            # doctest: +SKIP
    >>> display(panel)                                                  # doctest: +SKIP
    >>> with accumulate(optimizer, steps=4, model=model, noise=panel.tracker):  # doctest: +SKIP
    ...     train()
    >>> panel.refresh(); panel.report.advice                            # doctest: +SKIP
    """

    def __init__(self, tracker: NoiseTracker | None = None, *, report: NoiseReport | None = None,
                 critical: CriticalBatchReport | None = None, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tracker is not None and not isinstance(tracker, NoiseTracker):
            raise TypeError(f"tracker should be a batchwidgets.NoiseTracker, but got "
                            f"tracker={tracker!r}; e.g. NoisePanel(bw.NoiseTracker()).")
        if report is not None and not isinstance(report, NoiseReport):
            raise TypeError(f"report should be a NoiseReport from measure_noise, but got "
                            f"report={type(report).__name__}; e.g. "
                            f"NoisePanel(tracker, report=bw.measure_noise(model, data, loss_fn)).")
        if (isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float))
                or not min_interval_s >= 0):
            raise ValueError(f"min_interval_s should be a number >= 0, but got "
                             f"min_interval_s={min_interval_s!r}; e.g. 0.5.")
        if critical is not None and not isinstance(critical, CriticalBatchReport):
            raise TypeError(f"critical should be a CriticalBatchReport from critical_batch, but "
                            f"got critical={type(critical).__name__}; e.g. NoisePanel(tracker, "
                            f"critical=bw.critical_batch(model, data, optimizer=optimizer)).")
        self.tracker = tracker if tracker is not None else NoiseTracker()
        if critical is not None:
            self.tracker.critical = critical
        self.noise_report = report
        self.report: NoiseTrackerReport | None = None  # the last report drawn: all panel state
        self.min_interval_s, self._clock = float(min_interval_s), clock
        self._next_draw_s = 0.0  # the clock's time of the next redraw the tracker may trigger
        self.status = widgets.HTML()
        self.plot = widgets.Image(format="png")
        self.choice = widgets.HTML()  # what batch to train at, and the numbers behind it
        self.advice = widgets.HTML()
        super().__init__(css_name="noise", layout=[{"parts": ["status"]}, {"parts": ["plot"]},
                                                   {"parts": ["choice"]}, {"parts": ["advice"]}],
                         status=self.status, plot=self.plot, choice=self.choice,
                         advice=self.advice)
        self._draw()
        self.tracker.add_listener(self._on_tracker)

    # -- rendering: report fields -> widget values ------------------------------------------

    def render(self, report: NoiseTrackerReport) -> None:
        """Show ``report``: the image, the status line and the advice."""
        self.report = report
        with self.hold_sync():
            self._render(report)

    def _render(self, report: NoiseTrackerReport) -> None:
        self.plot.value = figure_png(plot_noise_panel(report, self.noise_report))
        self.status.value = _status(report)
        self.choice.value = _html.table(report.batch_choice(),
                                        caption="What batch should I train at?")
        self.advice.value = f"<p>{html.escape(report.advice)}</p>"

    def _draw(self) -> None:
        started = self._clock()
        self.render(self.tracker.report)
        finished = self._clock()
        self._next_draw_s = finished + max(self.min_interval_s, DRAW_SHARE * (finished - started))

    def _on_tracker(self, _tracker: NoiseTracker) -> None:
        """The tracker's listener: redraw unless the last redraw was too recent."""
        if self._clock() >= self._next_draw_s:
            self._draw()

    def refresh(self) -> None:
        """Redraw now from the tracker, and update the static copy of every display of the
        panel (what nbviewer, GitHub and a notebook without widget state show)."""
        self._draw()
        self.refresh_displays()

    def detach(self) -> None:
        """Stop following the tracker; the panel keeps its last picture."""
        tracker = getattr(self, "tracker", None)  # None: __init__ raised (ipywidgets' __del__)
        if tracker is not None:
            tracker.remove_listener(self._on_tracker)

    def close(self) -> None:
        """Stop following the tracker and close the widgets (the outputs keep the report)."""
        self.detach()
        super().close()

    # -- display: a live panel where widgets run, the static report everywhere else ---------

    def _static(self) -> tuple[str, str]:
        """The static copy: the report's table and the picture the panel drew (not redrawn)."""
        report = self.report
        png = base64.b64encode(bytes(self.plot.value)).decode("ascii")
        return (f'<div>{self.choice.value}{report.summary_table()}<img alt="batchwidgets plot" '
                f'src="data:image/png;base64,{png}"/></div>', f"NoisePanel({report.summary()})")
