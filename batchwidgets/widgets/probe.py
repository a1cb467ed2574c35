"""ProbePanel: ``find_batch`` as a live panel (progress, plots, summary, headroom, code to copy).

One anywidget widget (``_controls.Panel``): the answer in one line first, the controls, the
plot beside the summary, and the attempts and details behind tabs.

Usage:
    >>> import functools, batchwidgets as bw
    >>> panel = bw.ProbePanel(probe=functools.partial(bw.find_batch, model, dataset,
    ...                                               budget="8GiB"))  # doctest: +SKIP
    >>> panel                    # click "Probe", or: panel.start(); panel.wait()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import _html
from ..engine import (
    ModelHeldError,
    check_free,
    copied,
    declared,
    held,
    memory,
    private_rng,
    state_bytes,
    usable_device,
)
from ..engine.probe import OPTIONS, FindBatchRequest, find_batch
from ..plots import plot_probe
from ..results import Attempt, BatchSizeReport, attempts_table
from ..results._snapshot import snapshot_link
from ..results.probe import details_html
from . import _controls as widgets
from ._panel import ReportDisplay, figure_png

# probe(on_step=..., headroom=...) -> report, e.g. functools.partial(find_batch, model, data)
Probe = Callable[..., BatchSizeReport]

EXPECTED_ATTEMPTS = 12  # length of the progress bar; the probe usually needs fewer, and it grows


def _attempt_line(attempt: Attempt) -> str:
    outcome = "fits" if attempt.fits else "out of memory"
    return (f"batch size {attempt.batch_size}: {outcome}, peak "
            f"{_html.format_bytes(attempt.peak_memory_bytes)}")


@contextlib.contextmanager
def _off_the_main_thread(probe: Probe) -> Iterator[Probe]:
    """The probe to run on a background thread: on a copy of the model and its optimizer where
    it fits, else with the model held (NOTE [ Probing in the background ] in
    engine/_background.py)."""
    is_model_probe = (isinstance(probe, functools.partial) and probe.func is find_batch
                      and probe.args and hasattr(probe.args[0], "parameters"))
    if not is_model_probe:  # a bare step: only the RNG can be kept apart
        yield probe
        return
    model = probe.args[0]
    check_free(model)  # held by another panel: its fake twins may stand in it now
    options = dict(probe.keywords)
    optimizer = options.get("optimizer")
    first = next(model.parameters(), None)
    device = usable_device(options.get("device") or (
        first.device if first is not None else "cpu"))
    room = None if device.type == "cuda" else memory.available_memory_bytes()
    if room is not None and 2 * state_bytes(model, optimizer) <= room:
        names = ("optimizer", "scheduler", "scaler")
        model, *extras = copied(model, *(options.get(name) for name in names))
        options.update({n: e for n, e in zip(names, extras) if e is not None})
        yield functools.partial(find_batch, model, *probe.args[1:], **options)
        return
    with held(model, optimizer, "a ProbePanel"):
        yield probe


HERE = "this device"  # the target dropdown's first entry: no target, probe here


def _accepts(probe: Probe, name: str) -> bool:
    """Whether ``probe`` takes the keyword ``name`` (find_batch does; a user's callable may not)."""
    try:
        parameters = inspect.signature(probe).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _answer(report: BatchSizeReport) -> str:
    """The answer in one line: the largest batch, per rank and global where it applies,
    predicted or measured (with its band), and where."""
    size = f'<b class="batchwidgets-answer">{report.max_batch_size}</b>'
    if report.target is not None and report.parallel is not None:
        where = (f"per rank &times; {report.world_size} = <b>{report.global_batch_size}</b> "
                 f"on {report.world_size}x{html.escape(report.target)} under "
                 f"{html.escape(report.parallel)}, predicted (not run)")
    elif report.target is not None:
        low, high = report.target_band or (report.max_batch_size, report.max_batch_size)
        where = f"on {html.escape(report.target)}, predicted (not run; band {low}-{high})"
    else:
        where = f"on {html.escape(report.device)}, measured"
    return (f"largest batch {size} {where} &middot; recommended "
            f"{report.recommended_batch_size} (headroom {report.headroom:g})")


def _summary_table(report: BatchSizeReport) -> str:
    return _html.table([
        ("max_batch_size", report.max_batch_size),
        ("first_oom_batch_size", report.first_oom_batch_size),
        ("recommended_batch_size", report.recommended_batch_size),
        ("headroom", f"{report.headroom:g}: {_html.format_bytes(report.headroom_bytes)} "
                     f"left at the recommended size"),
        ("limit", _html.format_bytes(report.limit_bytes)),
        *([("target", f"{report.target} (predicted, not run)"),
           ("traced on", "fake tensors" if report.trace == "fake" else report.device)]
          if report.target is not None else [("device", report.device)]),
    ], caption=f"find_batch on {report.target or report.device}")


class ProbePanel(ReportDisplay, widgets.Panel):
    """``find_batch`` with live progress, then memory and throughput plots, a summary, a
    headroom slider (recomputes the recommendation without probing again) and a line of code.

    Parameters
    ----------
    report : BatchSizeReport, optional
        A finished report to show.
    probe : callable, optional
        ``probe(on_step=..., headroom=...) -> BatchSizeReport``, for example
        ``functools.partial(batchwidgets.find_batch, model, dataset, budget="8GiB")``. With it,
        the "Probe" button runs it off the kernel's main thread (``start()``, then ``wait()``).

    Examples
    --------
    >>> panel = ProbePanel(report)                    # doctest: +SKIP
    >>> panel.headroom.value = 0.8                    # doctest: +SKIP
    >>> panel.code.value                              # doctest: +SKIP
    'DataLoader(dataset, batch_size=32)'
    """

    def __init__(self, report: BatchSizeReport | None = None, *,
                 probe: Probe | None = None) -> None:
        self.probe = probe
        self.report: BatchSizeReport | None = None  # the last report rendered: all panel state
        self.error: BaseException | None = None  # what the last background probe raised
        self.thread: threading.Thread | None = None
        self._attempts: list[Attempt] = []  # progress of the probe running now
        self._lock = threading.RLock()  # the slider's observer may render inside render
        self.probe_button = widgets.Button(description="Probe", disabled=probe is None,
                                           tooltip="run find_batch again (off the main thread); "
                                                   "a remembered answer is measured again")
        self._measure_again = False  # a click on Probe after a report: refresh=True
        self._stop = threading.Event()
        self.stop_button = widgets.Button(description="Stop", disabled=True,
                                          tooltip="end the probe now, with the sizes it finished")
        target = declared(FindBatchRequest, "target")
        headroom = declared(FindBatchRequest, "headroom")
        self.target = widgets.Dropdown(
            options=(HERE, *target.offered), value=HERE, description=target.name,
            disabled=probe is None or not _accepts(probe, target.name), tooltip=target.help)
        self.details = widgets.HTML()
        self.progress = widgets.IntProgress(value=0, min=0, max=EXPECTED_ATTEMPTS,
                                            description="attempts")
        self.status = widgets.Label(value="ready" if report is None else "")
        self.plot = widgets.Image(format="png")
        self.summary = widgets.HTML()
        self.attempts = widgets.HTML()
        self.headroom = widgets.FloatSlider(
            value=OPTIONS.headroom, min=0.5, max=1.0, step=0.01, description=headroom.name,
            disabled=True, continuous_update=False, readout_format=".2f",
            tooltip=headroom.help_line)
        self.code = widgets.Text(value="", description="code")
        self.probe_button.on_click(self._on_probe_click)
        self.stop_button.on_click(self._on_stop_click)
        self.headroom.observe(self._on_headroom, names="value")
        self.target.observe(self._on_target, names="value")
        self.answer = widgets.HTML(value="")
        super().__init__(css_name="probe", layout=[
            {"parts": ["answer"]},
            {"parts": ["button", "stop", "target", "progress", "status"]},
            {"columns": [{"parts": ["plot"]}, {"parts": ["summary", "headroom", "code"]}]},
            {"tabs": [{"title": "attempts", "parts": ["attempts"]},
                      {"title": "details", "parts": ["details"]}]},
        ], answer=self.answer, button=self.probe_button, stop=self.stop_button,
            target=self.target, progress=self.progress, status=self.status, plot=self.plot,
            summary=self.summary, headroom=self.headroom, code=self.code,
            attempts=self.attempts, details=self.details)
        if report is not None:
            self.render(report)

    # -- rendering: report fields -> widget values ------------------------------------------

    def render(self, report: BatchSizeReport) -> None:
        """Show ``report`` (called from any thread; every update goes through traits)."""
        with self._lock, self.hold_sync():
            self.report = report
            self.answer.value = _answer(report)
            self.plot.value = figure_png(plot_probe(report))
            self.summary.value = _summary_table(report)
            self.attempts.value = attempts_table(report.attempts)
            self.details.value = details_html(report) + snapshot_link(report.step_snapshot)
            self.code.value = f"DataLoader(dataset, batch_size={report.recommended_batch_size})"
            self.headroom.min = min(self.headroom.min, report.headroom)
            self.headroom.value = report.headroom
            self.headroom.disabled = report.max_batch_size == 0
            self.progress.max = self.progress.value = report.n_attempts
            self.progress.bar_style = "success" if report.max_batch_size else "danger"
            self.status.value = report.summary()
            self.probe_button.disabled = self.probe is None
            self.stop_button.disabled = True

    def on_step(self, attempt: Attempt) -> None:
        """Progress from the engine (``find_batch(on_step=...)``): cheap, thread-safe."""
        self._attempts.append(attempt)
        self.progress.max = max(self.progress.max, len(self._attempts) + 1)
        self.progress.value = len(self._attempts)
        self.status.value = _attempt_line(attempt)
        self.attempts.value = attempts_table(self._attempts)

    def _begin(self) -> None:
        self._attempts = []
        self.error = None
        self.progress.value, self.progress.max = 0, EXPECTED_ATTEMPTS
        self.progress.bar_style = "info"
        self.status.value = "probing..."
        self.probe_button.disabled = True
        self.headroom.disabled = True
        self._stop.clear()
        self.stop_button.disabled = False

    def _fail(self, error: BaseException) -> None:
        failed = getattr(error, "report", None)  # NoBatchSizeFits carries every attempt
        if isinstance(failed, BatchSizeReport):
            self.render(failed)
        self.progress.bar_style = "danger"
        self.status.value = f"{type(error).__name__}: {str(error).strip()}"
        self.probe_button.disabled = self.probe is None
        self.stop_button.disabled = True
        self.headroom.disabled = self.report is None or self.report.max_batch_size == 0

    # -- one user action -> one engine call ---------------------------------------------------

    def _probe(self, probe: Probe | None = None) -> BatchSizeReport:
        probe = probe or self.probe
        if probe is None:
            raise ValueError("ProbePanel(probe=...) is needed to probe, e.g. "
                             "ProbePanel(probe=functools.partial(find_batch, model, dataset)).")
        options: dict[str, Any] = {"on_step": self.on_step}
        if self.report is not None:  # probing again keeps the headroom the user chose
            options["headroom"] = self.headroom.value
        if _accepts(probe, "should_stop"):
            options["should_stop"] = self._stop.is_set
        if self.target.value != HERE:
            options["target"] = self.target.value
        if self._measure_again and _accepts(probe, "refresh"):
            options["refresh"] = True
        self._measure_again = False
        self._begin()
        try:
            report = probe(**options)
        except BaseException as error:
            self._fail(error)
            raise
        self.render(report)
        return report

    def run(self) -> BatchSizeReport:
        """Display the panel and probe on this thread, with live progress (used by the magic)."""
        self._ipython_display_()
        try:
            return self._probe()
        finally:  # the saved notebook keeps the final static view (nbviewer, GitHub)
            self.refresh_displays()

    # NOTE [ Why the probe panel has its own thread, not a Runner ]
    # LoaderPanel's Runner (_runner.py) lets the latest request win: a newer one stops the
    # measurement in flight, which suits quick toggles of a setting that measures in a second.
    # A probe holds the user's model (or a copy of it and its optimizer) and takes the memory
    # it measures; stopping one half-way to start another would cost a second probe's time for
    # nothing, since the answer does not depend on what was clicked in between. So a click
    # while a probe runs is ignored, Stop ends it mid-step (should_stop, polled between ops),
    # and start() returns the one thread, which tests and users join.
    def start(self) -> threading.Thread:
        """Probe off the kernel's main thread (what the "Probe" button does)."""
        if self.thread is not None and self.thread.is_alive():
            return self.thread
        self.thread = threading.Thread(target=self._probe_in_background, daemon=True,
                                       name="batchwidgets-probe")
        self.thread.start()
        return self.thread

    def _probe_in_background(self) -> None:
        try:  # the global RNG and the user's model stay the main thread's
            with private_rng(), _off_the_main_thread(self.probe) as probe:
                self._probe(probe)
        except ModelHeldError as error:  # another panel probes this model now
            self._fail(error)
            self.error = error
        except BaseException as error:  # shown in the panel; wait() raises it
            error.__traceback__ = None  # its frames would keep the step's tensors alive
            self.error = error

    def wait(self, timeout: float | None = None) -> BatchSizeReport | None:
        """Wait for the background probe; return its report or raise its error."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.report

    def _on_probe_click(self, _button: Any) -> None:
        self._measure_again = self.report is not None  # the answer shown is not asked for again
        self.start()

    def _on_stop_click(self, _button: Any) -> None:
        self._stop.set()
        self.status.value = "stopping (the model, optimizer and RNGs are put back)..."

    def _on_target(self, change: dict) -> None:
        """A target chosen: one probe, predicted for it (off the main thread)."""
        if change["new"] != change["old"] and self.probe is not None:
            self.start()

    def _on_headroom(self, change: dict) -> None:
        report = self.report
        if report is not None and report.max_batch_size and change["new"] != report.headroom:
            self.render(report.with_headroom(change["new"]))
