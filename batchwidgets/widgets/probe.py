"""ProbePanel: ``find_batch`` as a live panel (progress, plots, summary, headroom, code to copy).

Only widgets that ipywidgets 7.7 (Colab) and 8 both have, and no custom front-end code.

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
import io
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ipywidgets as widgets
from IPython.display import display

from .. import _html
from ..engine import _background, _memory
from ..engine.probe import find_batch
from ..plots import plot_probe
from ..results import Attempt, BatchSizeReport, attempts_table
from ..results.probe import details_html

# probe(on_step=..., headroom=...) -> report, e.g. functools.partial(find_batch, model, data)
Probe = Callable[..., BatchSizeReport]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
EXPECTED_ATTEMPTS = 12  # length of the progress bar; the probe usually needs fewer, and it grows
PLOT_DPI = 80


def panel_bundle(panel: widgets.DOMWidget, text: str, static_html: str) -> dict[str, Any]:
    """A panel's display data: the live widget where widgets run, and its static report (HTML
    with an inline PNG) for nbviewer, GitHub and saved notebooks, which cannot run them."""
    return {"text/plain": text, "text/html": static_html,
            WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": panel.model_id}}


class ShowsReport:
    """Display of a panel whose state is its last ``report`` (ProbePanel, LoaderPanel): the
    live widget, with the report's HTML (or the status line before there is one) for the
    places that cannot run widgets."""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        report = self.report
        if report is None:
            static = f"<p>batchwidgets: {html.escape(self.status.value)}</p>"
            text = f"{type(self).__name__}({self.status.value})"
        else:
            static, text = report._repr_html_(), report.summary()
        return panel_bundle(self, text, static)

    def _ipython_display_(self) -> None:  # ipywidgets 7 displays through this, 8 through mimebundle
        display(self._repr_mimebundle_(), raw=True)


def _png(report: BatchSizeReport) -> bytes:
    buffer = io.BytesIO()
    plot_probe(report).savefig(buffer, format="png", dpi=PLOT_DPI)
    return buffer.getvalue()


def _attempt_line(attempt: Attempt) -> str:
    outcome = "fits" if attempt.fits else "out of memory"
    return (f"batch size {attempt.batch_size}: {outcome}, peak "
            f"{_html.format_bytes(attempt.peak_memory_bytes)}")


def close_tree(widget: widgets.Widget) -> None:
    """Close a widget, its children, and their layout and style widgets (``close()`` alone
    leaves all of those open in the kernel)."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
        if isinstance(part, widgets.Widget):
            part.close()
    widget.close()


@contextlib.contextmanager
def _off_the_main_thread(probe: Probe) -> Iterator[Probe]:
    """The probe to run on a background thread: on a copy of the model and its optimizer where
    it fits, else with the model held (NOTE [ Probing in the background ], engine/_background)."""
    is_model_probe = (isinstance(probe, functools.partial) and probe.func is find_batch
                      and probe.args and hasattr(probe.args[0], "parameters"))
    if not is_model_probe:  # a bare step: only the RNG can be kept apart
        yield probe
        return
    model = probe.args[0]
    options = dict(probe.keywords)
    optimizer = options.get("optimizer")
    first = next(model.parameters(), None)
    device = _memory.usable_device(options.get("device") or (
        first.device if first is not None else "cpu"))
    room = None if device.type == "cuda" else _memory.available_memory_bytes()
    if room is not None and 2 * _background.state_bytes(model, optimizer) <= room:
        names = ("optimizer", "scheduler", "scaler")
        model, *extras = _background.copied(model, *(options.get(name) for name in names))
        options.update({n: e for n, e in zip(names, extras) if e is not None})
        yield functools.partial(find_batch, model, *probe.args[1:], **options)
        return
    with _background.held(model, optimizer, "a ProbePanel"):
        yield probe


TARGETS = ("this device", "T4", "L4", "A10G", "V100-16GB", "V100-32GB", "A100-40GB",
           "A100-80GB", "H100-80GB", "H200")


def _accepts(probe: Probe, name: str) -> bool:
    """Whether ``probe`` takes the keyword ``name`` (find_batch does; a user's callable may not)."""
    try:
        parameters = inspect.signature(probe).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _summary_table(report: BatchSizeReport) -> str:
    return _html.table([
        ("max_batch_size", report.max_batch_size),
        ("first_oom_batch_size", report.first_oom_batch_size),
        ("recommended_batch_size", report.recommended_batch_size),
        ("headroom", f"{report.headroom:g}: {_html.format_bytes(report.headroom_bytes)} "
                     f"left at the recommended size"),
        ("limit", _html.format_bytes(report.limit_bytes)),
        ("device", report.device),
    ], caption="find_batch")


class ProbePanel(ShowsReport, widgets.VBox):
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
                                           tooltip="run find_batch again (off the main thread)")
        self._stop = threading.Event()
        self.stop_button = widgets.Button(description="Stop", disabled=True,
                                          tooltip="end the probe with what it found so far")
        self.target = widgets.Dropdown(
            options=TARGETS, value="this device", description="target",
            disabled=probe is None or not _accepts(probe, "target"),
            tooltip="predict for a GPU that is not here (traced on the CPU, not run)")
        self.details = widgets.HTML()
        self.progress = widgets.IntProgress(value=0, min=0, max=EXPECTED_ATTEMPTS,
                                            description="attempts")
        self.status = widgets.Label(value="ready" if report is None else "")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.summary = widgets.HTML()
        self.attempts = widgets.HTML()
        self.headroom = widgets.FloatSlider(
            value=0.9, min=0.5, max=1.0, step=0.01, description="headroom", disabled=True,
            continuous_update=False, readout_format=".2f")
        self.code = widgets.Text(value="", description="code",
                                 layout=widgets.Layout(width="28em"))
        self.probe_button.on_click(self._on_probe_click)
        self.stop_button.on_click(self._on_stop_click)
        self.headroom.observe(self._on_headroom, names="value")
        self.target.observe(self._on_target, names="value")
        super().__init__(children=[
            widgets.HBox([self.probe_button, self.stop_button, self.progress, self.status]),
            self.plot,
            widgets.HBox([self.summary, widgets.VBox([self.headroom, self.code, self.target])]),
            self.details,
            self.attempts,
        ])
        # CSS classes name the parts for stylesheets and browser tests (tests/browser)
        self.add_class("batchwidgets-probe")
        for widget, part in [(self.probe_button, "button"), (self.progress, "progress"),
                             (self.status, "status"), (self.plot, "plot"),
                             (self.summary, "summary"), (self.headroom, "headroom"),
                             (self.code, "code"), (self.attempts, "attempts"),
                             (self.stop_button, "stop"), (self.target, "target"),
                             (self.details, "details")]:
            widget.add_class(f"batchwidgets-probe-{part}")
        if report is not None:
            self.render(report)

    # -- rendering: report fields -> widget values ------------------------------------------

    def render(self, report: BatchSizeReport) -> None:
        """Show ``report`` (called from any thread; every update goes through traits)."""
        with self._lock:
            self.report = report
            self.plot.value = _png(report)
            self.summary.value = _summary_table(report)
            self.attempts.value = attempts_table(report.attempts)
            self.details.value = details_html(report)
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
        if self.target.value != "this device":
            options["target"] = self.target.value
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
        handle = self._handle = display(self._repr_mimebundle_(), raw=True, display_id=True)
        try:
            return self._probe()
        finally:  # the saved notebook keeps the final static view (nbviewer, GitHub)
            if handle is not None:  # None outside IPython
                handle.update(self._repr_mimebundle_(), raw=True)

    def close(self) -> None:
        """Close the panel and every widget in it; its output keeps the static report."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            bundle = self._repr_mimebundle_()
            bundle.pop(WIDGET_VIEW)
            handle.update(bundle, raw=True)
        for child in self.children:
            close_tree(child)
        for part in (self.layout,):
            part.close()
        super().close()

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
            with _background.private_rng(), _off_the_main_thread(self.probe) as probe:
                self._probe(probe)
        except _background.ModelHeldError as error:  # another panel probes this model now
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

    def _on_probe_click(self, _button: widgets.Button) -> None:
        self.start()

    def _on_stop_click(self, _button: widgets.Button) -> None:
        self._stop.set()
        self.status.value = "stopping after this size..."

    def _on_target(self, change: dict) -> None:
        """A target chosen: one probe, predicted for it (off the main thread)."""
        if change["new"] != change["old"] and self.probe is not None:
            self.start()

    def _on_headroom(self, change: dict) -> None:
        report = self.report
        if report is not None and report.max_batch_size and change["new"] != report.headroom:
            self.render(report.with_headroom(change["new"]))
