"""What every panel shares: its display (the live widget, with a static copy for the places that
cannot run widgets, refreshed in place) and the PNG of its plot.

Usage (a panel is one ``_controls.Panel`` that mixes ``ReportDisplay`` in before it)::

    class LoaderPanel(ReportDisplay, Panel):
        def render(self, report):
            self._report = report
            self.chart.value = figure_png(plot_loader(report))
"""

from __future__ import annotations

import html
import io
from typing import Any

import ipywidgets as widgets
from IPython.display import display
from matplotlib.figure import Figure

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOT_DPI = 80  # every panel's plot: sharp enough on a laptop, small enough for a saved notebook


def figure_png(figure: Figure) -> bytes:
    """``figure`` as PNG bytes at the panels' one resolution (for ``widgets.Image.value``)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PLOT_DPI)
    return buffer.getvalue()


def panel_bundle(panel: widgets.DOMWidget, text: str, static_html: str) -> dict[str, Any]:
    """A panel's display data: the live widget where widgets run, and its static report (HTML
    with an inline PNG) for nbviewer, GitHub and saved notebooks, which cannot run them."""
    return {"text/plain": text, "text/html": static_html,
            WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": panel.model_id}}


class ReportDisplay:
    """The display of a panel whose state is its last ``report`` (a property or attribute with
    ``_repr_html_()`` and ``summary()``, None before the first) and whose ``status`` widget says
    what it does meanwhile.

    Every display of the panel keeps a handle (``display_id``): ``refresh_displays()`` rewrites
    their static copy with the current report, so a notebook saved afterwards (nbviewer,
    GitHub, a kernel-less reopen) shows the last numbers, not the ones at display time.
    """

    def _static(self) -> tuple[str, str]:
        """(HTML, text) shown where widgets cannot run."""
        report = self.report
        if report is None:
            return (f"<p>batchwidgets: {html.escape(self.status.value)}</p>",
                    f"{type(self).__name__}({self.status.value})")
        return report._repr_html_(), report.summary()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        static_html, text = self._static()
        return panel_bundle(self, text, static_html)

    def _ipython_display_(self) -> None:  # ipywidgets 7 displays through this, 8 through mimebundle
        handle = display(self._repr_mimebundle_(), raw=True, display_id=True)
        if handle is not None:  # None outside IPython
            self.__dict__.setdefault("_display_handles", []).append(handle)

    def refresh_displays(self, *, live: bool = True) -> None:
        """Rewrite the static copy of every display of this panel with the current report
        (``live=False``: the static copy alone, for a panel whose widgets are closing)."""
        for handle in self.__dict__.get("_display_handles", ()):
            bundle = self._repr_mimebundle_()
            if not live:
                bundle.pop(WIDGET_VIEW)
            handle.update(bundle, raw=True)

    def close(self) -> None:
        """Close the panel and every widget in it (layouts and styles too); each of its
        outputs keeps the static report."""
        self.refresh_displays(live=False)
        self.__dict__["_display_handles"] = []
        layout = getattr(self, "layout", None)  # DOMWidget's, opened with the widget
        if isinstance(layout, widgets.Widget):
            layout.close()
        super().close()
