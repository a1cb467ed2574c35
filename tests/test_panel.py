"""widgets._panel: the display every panel shares (live widget plus static copy, refreshed in
place through a real IPython shell), the one PNG resolution and the CSS class names."""

from __future__ import annotations

import struct

import ipywidgets as widgets
import pytest
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output
from matplotlib.figure import Figure

from batchwidgets.widgets import WIDGET_VIEW
from batchwidgets.widgets._panel import (
    PLOT_DPI,
    ReportDisplay,
    figure_png,
    name_parts,
)


class Report:
    def __init__(self, n: int) -> None:
        self.n = n

    def summary(self) -> str:
        return f"report {self.n}"

    def _repr_html_(self) -> str:
        return f"<table><tr><td>{self.n}</td></tr></table>"


class Panel(ReportDisplay, widgets.VBox):
    def __init__(self) -> None:
        self.report: Report | None = None
        self.status = widgets.Label(value="measuring <this>")
        super().__init__(children=[self.status])


@pytest.fixture(scope="module")
def ip():
    start_ipython()  # the shared test shell; returns it only on the first call
    return get_ipython()


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_figure_png_draws_at_the_panels_one_resolution():
    figure = Figure(figsize=(2, 1))
    figure.subplots().plot([0, 1])
    assert PLOT_DPI == 80
    assert png_size(figure_png(figure)) == (160, 80)


def test_name_parts_gives_the_panel_and_each_part_a_css_class():
    status, chart = widgets.Label(), widgets.Image()
    panel = widgets.VBox([status, chart])
    name_parts(panel, "loader", {"status": status, "num_workers": chart})
    assert "batchwidgets-loader" in panel._dom_classes
    assert "batchwidgets-loader-status" in status._dom_classes
    assert "batchwidgets-loader-num-workers" in chart._dom_classes


def test_the_bundle_has_the_live_widget_and_an_escaped_static_copy():
    panel = Panel()
    bundle = panel._repr_mimebundle_()
    assert bundle[WIDGET_VIEW]["model_id"] == panel.model_id
    assert bundle["text/html"] == "<p>batchwidgets: measuring &lt;this&gt;</p>"
    assert bundle["text/plain"] == "Panel(measuring <this>)"
    panel.report = Report(3)
    bundle = panel._repr_mimebundle_()
    assert (bundle["text/html"], bundle["text/plain"]) == (Report(3)._repr_html_(), "report 3")


def test_refresh_displays_rewrites_the_static_copy_of_every_display_in_place(ip):
    panel = Panel()
    with capture_output() as shown:
        ip.display_formatter.format(panel)  # what the kernel does with a cell's last value
        panel._ipython_display_()
        panel.report = Report(5)
        panel.refresh_displays()
    first, second, *updates = shown.outputs
    assert "measuring" in first.data["text/html"]
    assert "measuring" in second.data["text/html"]
    assert [u.data["text/html"] for u in updates] == [Report(5)._repr_html_()] * 2
    assert all(u.update for u in updates)
    ids = [o.transient["display_id"] for o in shown.outputs]
    assert ids[:2] == ids[2:]  # each display updated in place, once
    assert ids[0] != ids[1]


def live_widgets() -> int:
    from ipywidgets.widgets import widget

    return len(widget._instances)


def test_closing_any_panel_leaves_no_widget_behind(ip):
    import torch
    from torch.utils.data import TensorDataset

    import batchwidgets as bw
    from batchwidgets.results import Attempt, BatchSizeReport

    report = BatchSizeReport(max_batch_size=8, first_oom_batch_size=16,
                             attempts=(Attempt(2, True, 2**20, 0.01),
                                       Attempt(8, True, 2**21, 0.02),
                                       Attempt(16, False, None, None)),
                             device="cpu", budget_bytes=2**22)
    data = TensorDataset(torch.arange(64.0).reshape(32, 2), torch.arange(32))
    makers = {"ProbePanel": lambda: bw.ProbePanel(report),
              "NoisePanel": lambda: bw.NoisePanel(bw.NoiseTracker()),
              "LoaderPanel": lambda: bw.LoaderPanel(data, device="cpu", duration_s=0.05)}
    for name, make in makers.items():
        before = live_widgets()
        panel = make()
        assert live_widgets() > before + 3, name  # a real panel: many widgets
        with capture_output():
            panel._ipython_display_()
        panel.close()
        assert live_widgets() == before, name
