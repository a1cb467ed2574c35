"""NoisePanel driven by a real training loop (no browser), and plot_noise_panel's three plots."""

from __future__ import annotations

import base64
import re

import matplotlib
import pytest
import torch
from _oracles import critical_report
from matplotlib.figure import Figure
from torch import nn

import batchwidgets as bw
from batchwidgets import plots
from batchwidgets.plots import plot_noise_panel
from batchwidgets.results import NoiseReport, NoiseTrackerReport
from batchwidgets.widgets import WIDGET_VIEW
from batchwidgets.widgets.noise import NoisePanel

matplotlib.use("Agg")
MICRO, STEPS, UPDATES = 8, 4, 12


class FakeClock:
    """Seconds that move only when the test says so (each training step takes ``step_s``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def train(tracker, clock=None, step_s=0.1, updates=UPDATES):
    """A small classifier trained with accumulate(noise=tracker): STEPS micro-batches per update;
    ``clock`` moves ``step_s`` per micro-step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    with bw.accumulate(optimizer, steps=STEPS, model=model, noise=tracker):
        for _ in range(updates * STEPS):
            x = torch.randn(MICRO, 6, generator=generator)
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long() + (x[:, 1] > 0))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if clock is not None:
                clock.now += step_s


def images(panel):
    """Every PNG the panel's image shows from now on."""
    shown = []
    panel.plot.observe(lambda change: shown.append(bytes(change["new"])), names="value")
    return shown


def test_the_panel_redraws_in_place_while_the_loop_runs():
    # flush_every=1: the tracker reads each update from the device (and tells the panel) as it
    # comes, rather than 16 at a time
    tracker = bw.NoiseTracker(overhead_target=None, warmup_updates=3, flush_every=1)
    panel = NoisePanel(tracker, min_interval_s=0, clock=FakeClock())
    first = bytes(panel.plot.value)
    assert first.startswith(b"\x89PNG")
    shown = images(panel)
    train(tracker, updates=4)
    # every notification redraws at min_interval_s=0 (with a clock standing still while it
    # draws): a loss per micro-batch, and an estimate per update
    assert len(shown) == 4 * STEPS + 4
    assert len(set(shown)) > 4  # the picture changed as the numbers came in
    assert first not in shown
    assert panel.report == tracker.report
    assert panel.report.n_updates == 4
    assert list(panel.images) == ["plot"]  # one image, redrawn in place
    assert panel.images["plot"].endswith(base64.b64encode(bytes(panel.plot.value)).decode())


def test_redraws_are_throttled_by_min_interval_s():
    clock = FakeClock()
    # flush_every=1: the tracker reads each update from the device (and tells the panel) as it
    # comes, rather than 16 at a time
    tracker = bw.NoiseTracker(overhead_target=None, warmup_updates=3, flush_every=1)
    panel = NoisePanel(tracker, min_interval_s=0.5, clock=clock)
    shown = images(panel)
    train(tracker, clock=clock, step_s=0.1)
    # accumulate notifies once per update, every 4 micro-steps = 0.4 s of the fake clock; a
    # redraw needs 0.5 s since the last, so every second update redraws: 12 updates -> 6
    assert len(shown) == UPDATES // 2
    assert panel.report.n_updates == UPDATES - 1  # the last update is not drawn yet
    panel.refresh()
    assert len(shown) == UPDATES // 2 + 1
    assert panel.report == tracker.report


def test_slow_redraws_space_themselves_out():
    class SlowDrawing(FakeClock):
        """Every reading is 0.5 s later than the one before: a redraw takes 0.5 s."""

        def __call__(self) -> float:
            self.now += 0.5
            return self.now

    clock = SlowDrawing()
    tracker = bw.NoiseTracker()
    panel = NoisePanel(tracker, min_interval_s=0.0, clock=clock)
    shown = images(panel)
    for _ in range(20):
        tracker.observe_loss(1.0)  # each check of the clock moves it 0.5 s
    # a redraw reads the clock twice, 0.5 s apart, so the next one waits 4 x 0.5 = 2 s after
    # it; the listener's own readings come every 0.5 s: every 4th notification redraws
    assert len(shown) == 20 // 4


def test_status_and_advice_show_the_report():
    # flush_every=1: the tracker reads each update from the device (and tells the panel) as it
    # comes, rather than 16 at a time
    tracker = bw.NoiseTracker(overhead_target=None, warmup_updates=3, flush_every=1)
    panel = NoisePanel(tracker)
    assert "B_simple: the gradient noise scale is not measured" in panel.status.value
    assert "no losses yet" in panel.status.value
    train(tracker)
    panel.refresh()
    report = tracker.report
    assert report.measurable, report.reason
    assert panel.status.value.startswith("<b>batchwidgets: noise</b> · B_simple ")
    assert f"after {UPDATES} updates" in panel.status.value
    assert f"{UPDATES * STEPS} batches" in panel.status.value
    assert "critical batch size B_simple ≈" in panel.advice.value
    assert "at the current batch B = 32" in panel.advice.value


def test_static_view_is_the_report_table_and_the_current_picture():
    # flush_every=1: the tracker reads each update from the device (and tells the panel) as it
    # comes, rather than 16 at a time
    tracker = bw.NoiseTracker(overhead_target=None, warmup_updates=3, flush_every=1)
    panel = NoisePanel(tracker)
    train(tracker, updates=4)
    panel.refresh()
    bundle = panel._repr_mimebundle_()
    assert bundle[WIDGET_VIEW]["model_id"] == panel.model_id
    assert bundle["text/plain"] == f"NoisePanel({tracker.report.summary()})"
    page = bundle["text/html"]
    assert page.startswith(f"<div>{panel.choice.value}{tracker.report.summary_table()}<img")
    png = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(png) == bytes(panel.plot.value)


def test_close_and_detach_stop_following_the_tracker():
    tracker = bw.NoiseTracker()
    panel = NoisePanel(tracker, min_interval_s=0, clock=FakeClock())
    other = NoisePanel(tracker, min_interval_s=0, clock=FakeClock())
    shown, other_shown = images(panel), images(other)
    tracker.observe_loss(1.0)
    assert (len(shown), len(other_shown)) == (1, 1)
    panel.close()
    other.detach()
    tracker.observe_loss(2.0)
    assert (len(shown), len(other_shown)) == (1, 1)
    assert tracker.report.losses == (1.0, 2.0)  # the tracker goes on
    assert other.report.losses == (1.0,)  # a detached panel keeps its last picture
    other.close()


def test_a_new_tracker_when_none_is_given_and_bad_arguments():
    panel = NoisePanel(min_interval_s=0, clock=FakeClock())
    assert isinstance(panel.tracker, bw.NoiseTracker)
    panel.tracker.observe_loss(3.0)
    assert panel.report.losses == (3.0,)
    panel.close()
    with pytest.raises(TypeError, match=r"tracker should be a batchwidgets\.NoiseTracker"):
        NoisePanel("tracker")
    with pytest.raises(TypeError, match="report should be a NoiseReport"):
        NoisePanel(report=bw.NoiseTracker().report)
    with pytest.raises(ValueError, match="min_interval_s should be a number >= 0"):
        NoisePanel(min_interval_s=-1)


def test_bw_noise_panel_is_this_panel():
    assert bw.NoisePanel is NoisePanel


# ---- plot_noise_panel ------------------------------------------------------------------------

TRACKED = NoiseTrackerReport(
    history=((1, None, 0.1, 1.0), (2, 12.0, 0.1, 1.2), (3, 11.0, 0.1, 1.1)),
    losses=(2.0, 1.0, 3.0, 2.0, 1.0), b_simple=11.0, b_simple_error=1.0, grad_norm_sq=0.1,
    trace_cov=1.1, measurable=True, reason="", n_updates=3, micro_batch_size=8,
    effective_batch_size=32, n_micro=4, history_errors=(None, 2.0, 1.0), n_losses=25)
MEASURED = NoiseReport(trace_cov=4.0, grad_norm_sq=0.5, loss_mean=1.0, loss_variance=0.2,
                       n_examples=1000, n_available=1000, sampled=False, batch_sizes=(1, 10, 100),
                       replacement=True)


def lines(ax):
    return {line.get_label(): line for line in ax.lines}


def test_plot_noise_panel_draws_losses_with_their_rolling_mean_and_band():
    loss_ax, _, _ = plot_noise_panel(TRACKED).axes
    drawn = lines(loss_ax)
    assert list(drawn["per batch"].get_xdata()) == [21, 22, 23, 24, 25]  # the last 5 of 25
    assert list(drawn["per batch"].get_ydata()) == [2.0, 1.0, 3.0, 2.0, 1.0]
    assert TRACKED.loss_window == 2
    assert list(drawn["rolling mean (2 batches)"].get_ydata()) == [2.0, 1.5, 2.0, 2.5, 1.5]
    band = loss_ax.collections[0].get_paths()[0].vertices[:, 1]
    # the widest window is (1, 3): mean 2, standard deviation sqrt(2)
    assert (min(band), max(band)) == pytest.approx((2 - 2**0.5, 2 + 2**0.5))


def test_plot_noise_panel_draws_the_variance_with_the_one_over_b_lines():
    _, variance_ax, _ = plot_noise_panel(TRACKED, MEASURED).axes
    drawn = lines(variance_ax)
    assert list(drawn["measure_noise"].get_xdata()) == [1, 10, 100]
    assert list(drawn["measure_noise"].get_ydata()) == pytest.approx([4.0, 0.4, 0.04])
    assert list(drawn["measure_noise tr(Σ)/B"].get_ydata()) == pytest.approx([4.0, 0.4, 0.04])
    assert list(drawn["measured at B = 8, 32"].get_xdata()) == [8, 32]
    assert list(drawn["measured at B = 8, 32"].get_ydata()) == pytest.approx([1.1 / 8, 1.1 / 32])
    tracker_line = drawn["tracker tr(Σ)/B"]
    assert list(tracker_line.get_xdata()) == [1, 100]  # through measure_noise's sizes
    assert list(tracker_line.get_ydata()) == pytest.approx([1.1, 0.011])
    assert list(drawn["|G|² (crosses at B_simple)"].get_ydata()) == [0.1, 0.1]
    assert variance_ax.get_xscale() == variance_ax.get_yscale() == "log"
    assert variance_ax.get_xlabel() == "batch size B (samples)"


def test_plot_noise_panel_draws_b_simple_over_the_updates_with_its_error_band():
    _, _, noise_ax = plot_noise_panel(TRACKED).axes
    drawn = lines(noise_ax)
    assert list(drawn["B_simple"].get_xdata()) == [2, 3]  # the unmeasurable first one left out
    assert list(drawn["B_simple"].get_ydata()) == [12.0, 11.0]
    band = noise_ax.collections[0].get_paths()[0].vertices[:, 1]
    assert (min(band), max(band)) == pytest.approx((10.0, 14.0))  # 12 ± 2, 11 ± 1
    assert list(drawn["current batch 32"].get_ydata()) == [32, 32]
    assert noise_ax.get_ylabel() == "B_simple (samples)"


def test_plot_noise_panel_before_anything_is_measured_says_so():
    figure = plot_noise_panel(bw.NoiseTracker().report)
    _, variance_ax, noise_ax = figure.axes
    assert variance_ax.texts[0].get_text() == "no variance measured yet"
    assert "not measured without micro-batches" in noise_ax.texts[0].get_text().replace("\n", " ")


def test_the_static_report_shows_the_panels_picture():
    assert len(plots.plot(TRACKED).axes) == 3  # what _repr_html_ draws
    ax = Figure().add_subplot()
    assert len(plots.plot(TRACKED, ax=ax).axes) == 2  # one given axes: the compact two-in-one
    assert '<img alt="batchwidgets plot"' in TRACKED._repr_html_()


# ---- %%accumulate --noise in a real kernel --------------------------------------------------

KERNEL_CELLS = [
    """import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X = torch.randn(512, 6); Y = (X[:, 0] > 0).long() + (X[:, 1] > 0)
%load_ext batchwidgets""",
    """%%accumulate 4 --noise
for i in range(0, 512, 8):
    nn.functional.cross_entropy(model(X[i:i + 8]), Y[i:i + 8]).backward()
    opt.step()
    opt.zero_grad()""",
    "noise_tracker.report.n_updates",
]


@pytest.mark.slow
def test_in_a_kernel_the_noise_panel_shows_live_and_keeps_the_final_static_picture():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in KERNEL_CELLS])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    _, cell, count = (cell.outputs for cell in notebook.cells)
    assert [o.output_type for o in cell] == ["display_data", "execute_result"]
    panel, report = cell
    assert WIDGET_VIEW in panel.data
    # refresh() after the cell replaced the static copy shown before the loop ran
    assert "<td>updates measured</td><td>16</td>" in panel.data["text/html"]
    assert "batchwidgets: accumulate" in report.data["text/html"]
    assert count[0].data["text/plain"] == "16"


def test_the_panel_says_when_accumulating_does_not_pay_and_shows_the_schedule():
    # exact norms: |G|^2 = 1, tr(Sigma) = 16, so B_simple = 16 against a batch of 8 x 16 = 128
    tracker = bw.NoiseTracker(warmup_updates=2, overhead_target=None)
    panel = NoisePanel(tracker, min_interval_s=0.0)
    for _ in range(3):
        tracker.update(small_sq_norms=[2.0] * 8, big_sq_norm=1 + 16 / 128, micro_batch_size=16,
                       n_micro=8)
    tracker.observe_step_time(0.2, 0.05)
    panel.refresh()
    assert "Accumulating to this batch does not pay" in panel.advice.value
    assert "9× the fewest examples" in panel.advice.value
    assert "Schedule: batch size 16 samples" in panel.advice.value
    assert "waiting for data 25% of each step" in panel.status.value
    panel.close()


def test_the_batch_section_shows_both_numbers_and_follows_a_measured_one():
    tracker = bw.NoiseTracker(overhead_target=None, warmup_updates=3, flush_every=1)
    panel = NoisePanel(tracker, min_interval_s=0, clock=FakeClock())
    assert "What batch should I train at?" in panel.choice.value
    assert "not measured: %critical_batch" in panel.choice.value
    train(tracker, updates=8)
    assert "B_simple ≈" in panel.choice.value  # the schedule follows B_simple meanwhile
    # a measurement set on the tracker (as %critical_batch --noise does) redraws the panel
    tracker.critical = critical_report(300.0, 25.0, examples=12_345)
    choice = panel.choice.value
    assert "300 ± 25 samples, to loss 0.5 from 1 (12345 examples spent)" in choice
    assert "the measured critical batch ≈ 300 ± 25 samples" in choice  # what the schedule used
    assert panel.report.schedule.source == "critical_batch"
    assert "which to trust" in choice
    assert choice in panel._repr_mimebundle_()["text/html"]  # in the saved notebook too
    tracker.critical = critical_report(None, reason="the steps hardly fall")
    assert "not measurable: the steps hardly fall" in panel.choice.value
    # given to the panel: set on the tracker
    other = NoisePanel(critical=critical_report(64.0))
    assert other.tracker.critical.critical_batch_size == 64.0
    with pytest.raises(TypeError, match="critical should be a CriticalBatchReport"):
        NoisePanel(critical=64)
