"""widgets._panel and widgets._controls: the display every panel shares (live widget plus static
copy, refreshed in place through a real IPython shell), the one PNG resolution, and one anywidget
per panel whose controls are facades driven by the front end's messages as by code."""

from __future__ import annotations

import struct

import pytest
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output
from matplotlib.figure import Figure

from batchwidgets.widgets import WIDGET_VIEW, _controls
from batchwidgets.widgets._panel import PLOT_DPI, ReportDisplay, figure_png


class Report:
    def __init__(self, n: int) -> None:
        self.n = n

    def summary(self) -> str:
        return f"report {self.n}"

    def _repr_html_(self) -> str:
        return f"<table><tr><td>{self.n}</td></tr></table>"


class Panel(ReportDisplay, _controls.Panel):
    def __init__(self) -> None:
        self.report: Report | None = None
        self.status = _controls.Label(value="measuring <this>")
        super().__init__(css_name="test", layout=[{"parts": ["status"]}], status=self.status)


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


def from_the_browser(panel: _controls.Panel, **content) -> None:
    """What the kernel does with the comm message a click or a choice in the front end sends."""
    panel._handle_msg({"content": {"data": {"method": "custom", "content": content}},
                       "buffers": []})


def test_a_panel_is_one_anywidget_whose_esm_and_css_ship_in_the_package():
    import anywidget

    panel = Panel()
    assert isinstance(panel, anywidget.AnyWidget)
    assert "export default" in panel._esm
    assert "function render" in panel._esm
    assert ".batchwidgets-panel" in panel._css
    assert "http" not in panel._esm  # works offline: nothing fetched from a URL or a CDN
    assert panel.layout_spec == [{"parts": ["status"]}]
    assert panel.parts["status"] == {"kind": "label", "description": "", "disabled": False,
                                     "tooltip": "", "value": "measuring <this>"}


def test_controls_mirror_into_the_synced_state_and_the_front_end_sets_them_as_code_does():
    clicks, changes = [], []
    button = _controls.Button(description="Go")
    button.on_click(clicks.append)
    choice = _controls.Dropdown(options=[("default", None), ("2", 2), ("4", 4)], value=None,
                                description="prefetch_factor")
    choice.observe(lambda change: changes.append(change["new"]), names="value")
    slider = _controls.FloatSlider(value=0.9, min=0.5, max=1.0, step=0.01)
    plot = _controls.Image(format="png")
    panel = _controls.Panel(css_name="t", layout=[{"parts": ["go", "choice", "slider", "plot"]}],
                            go=button, choice=choice, slider=slider, plot=plot)
    assert panel.parts["choice"]["labels"] == ["default", "2", "4"]
    assert panel.images["plot"] == ""  # nothing drawn yet: no image at all, not a broken one
    from_the_browser(panel, event="set", name="choice", value=2)  # the position chosen
    assert (choice.value, changes) == (4, [4])
    assert panel.parts["choice"]["index"] == 2
    choice.value = 2  # code: the front end follows
    assert panel.parts["choice"]["index"] == 1
    from_the_browser(panel, event="set", name="slider", value=7.0)  # clamped, as ipywidgets does
    assert slider.value == 1.0
    assert panel.parts["slider"]["value"] == 1.0
    from_the_browser(panel, event="click", name="go")
    assert clicks == [button]
    button.disabled = True
    from_the_browser(panel, event="click", name="go")  # a disabled control ignores the browser
    from_the_browser(panel, event="set", name="nothing", value=1)  # unknown: ignored
    assert clicks == [button]
    plot.value = b"\x89PNG..."
    assert panel.images["plot"].startswith("data:image/png;base64,")
    with pytest.raises(Exception, match="not one of the options"):
        choice.value = 3


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
        assert live_widgets() <= before + 2, name  # one widget (and its layout), no children
        with capture_output():
            panel._ipython_display_()
        panel.close()
        assert live_widgets() == before, name
