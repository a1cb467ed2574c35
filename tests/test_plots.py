"""plot_probe: a Figure (never pyplot) with memory and throughput against the batch size."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

import batchwidgets as bw
from batchwidgets import plots
from batchwidgets.plots import MIB, plot_accumulate, plot_noise, plot_noise_tracker, plot_probe
from batchwidgets.results import (
    AccumulationReport,
    Attempt,
    BatchSizeReport,
    LiveLoaderReport,
    LoaderSegment,
    LoaderSwitch,
    MemoryModel,
    NoiseReport,
    NoiseTrackerReport,
)

matplotlib.use("Agg")

REPORT = BatchSizeReport(
    max_batch_size=41, first_oom_batch_size=42,
    attempts=(Attempt(32, True, 52 * MIB, 0.200), Attempt(2, True, 6 * MIB, 0.020),
              Attempt(41, True, 65 * MIB, 0.250), Attempt(42, False, 67 * MIB, None)),
    device="cpu", budget_bytes=64 * MIB, limit_bytes=64 * MIB,
    memory_model=MemoryModel(fixed_bytes=3 * MIB, per_sample_bytes=1.5 * MIB))
NOTHING_FITS = BatchSizeReport(
    max_batch_size=0, first_oom_batch_size=1, attempts=(Attempt(1, False, None, None),),
    device="cuda:0", budget_bytes=None, limit_bytes=None, stop_reason="nothing fits")


def test_plot_probe_draws_memory_and_throughput_against_batch_size():
    figure = plot_probe(REPORT)
    assert isinstance(figure, Figure)
    memory_ax, speed_ax = figure.axes
    assert (memory_ax.get_xlabel(), memory_ax.get_ylabel()) == ("batch size", "peak memory (MiB)")
    assert (speed_ax.get_xlabel(), speed_ax.get_ylabel()) == ("batch size", "samples/s")
    lines = {line.get_label(): line for line in memory_ax.lines}
    assert list(lines["ran"].get_xdata()) == [2, 32, 41]  # sorted by batch size
    assert list(lines["ran"].get_ydata()) == [6, 52, 65]
    assert list(lines["out of memory"].get_xdata()) == [42]
    assert list(lines["fitted model"].get_ydata()) == [3, 3 + 1.5 * 42]
    assert list(lines["budget"].get_ydata()) == [64, 64]
    assert list(lines["recommended 36"].get_xdata()) == [36, 36]
    assert list(speed_ax.lines[0].get_ydata()) == pytest.approx([100, 160, 164])


def test_plot_probe_shares_a_given_axes():
    figure = Figure()
    ax = figure.add_subplot()
    assert plot_probe(REPORT, ax=ax) is figure
    assert len(figure.axes) == 2  # throughput on a twin axis


def test_plot_probe_draws_a_report_where_nothing_fits():
    memory_ax, speed_ax = plot_probe(NOTHING_FITS).axes
    labels = [line.get_label() for line in memory_ax.lines]
    assert "fitted model" not in labels
    assert "budget" not in labels
    assert not speed_ax.lines  # no size timed: said, not an empty curve
    assert [text.get_text() for text in speed_ax.texts] == ["no size timed"]


def test_plot_dispatches_on_the_report_type():
    assert isinstance(plots.plot(REPORT), Figure)
    with pytest.raises(TypeError, match="report should be one of"):
        plots.plot(object())


def test_plot_accumulate_draws_each_micro_batch_loss_and_marks_the_updates():
    report = AccumulationReport(steps=4, micro_steps=8, real_steps=2,
                                losses=(3.0, 2.5, 2.0, 1.5, 1.0, 0.9, 0.8, 0.7),
                                grad_norms=(1.0,) * 8)
    figure = plot_accumulate(report)
    loss_ax, norm_ax = figure.axes
    assert list(loss_ax.lines[0].get_ydata()) == list(report.losses)
    assert [line.get_xdata()[0] for line in loss_ax.lines[1:]] == [4.5, 8.5]
    assert loss_ax.get_ylabel() == "loss"
    assert list(norm_ax.lines[0].get_ydata()) == [1.0] * 8


def test_plot_noise_draws_the_variance_against_batch_size_with_the_one_over_b_line():
    report = NoiseReport(trace_cov=4.0, grad_norm_sq=0.5, loss_mean=1.0, loss_variance=0.2,
                         n_examples=1000, n_available=1000, sampled=False,
                         batch_sizes=(1, 10, 100), replacement=True)
    ax = plot_noise(report).axes[0]
    measured, one_over_b, _g2 = ax.lines
    assert list(measured.get_xdata()) == [1, 10, 100]
    assert list(measured.get_ydata()) == pytest.approx([4.0, 0.4, 0.04])
    assert list(one_over_b.get_ydata()) == pytest.approx([4.0, 0.4, 0.04])
    assert ax.get_xscale() == "log"
    assert "8" in ax.get_title()  # B_simple = 4 / 0.5


def test_plot_noise_tracker_draws_losses_and_the_measurable_noise_scale():
    report = NoiseTrackerReport(
        history=((1, None, 0.1, 1.0), (2, 12.0, 0.1, 1.2), (3, 11.0, 0.1, 1.1)),
        losses=(2.0, 1.9, 1.8), b_simple=11.0, b_simple_error=1.0, grad_norm_sq=0.1,
        trace_cov=1.1, measurable=True, reason="", n_updates=3, micro_batch_size=8,
        effective_batch_size=32)
    loss_ax, noise_ax = plot_noise_tracker(report).axes
    assert list(loss_ax.lines[0].get_ydata()) == [2.0, 1.9, 1.8]
    assert list(noise_ax.lines[0].get_xdata()) == [2, 3]  # the unmeasurable first one left out
    assert noise_ax.get_ylabel() == "B_simple (samples)"


def test_plot_live_loader_draws_the_loops_samples_per_s_per_setting():
    none = {"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
            "persistent_workers": False}
    two = {**none, "num_workers": 2, "prefetch_factor": 2}
    report = LiveLoaderReport(
        segments=(LoaderSegment(none, 5, 160, 0.5, 0.4, 0, 0),
                  LoaderSegment(two, 11, 352, 0.8, 0.2, 0, 5)),
        switches=(LoaderSwitch(none, two, 0, 5, 0.0, 0.02),), settings=two, epoch=1)
    figure = plots.plot(report)
    ax = figure.axes[0]
    assert [bar.get_width() for bar in ax.patches] == pytest.approx([320.0, 440.0])
    assert [label.get_text() for label in ax.get_yticklabels()] == [
        "no workers (from 0:0)", "2 workers, prefetch 2 (from 0:5)"]
    assert ax.patches[1].get_linewidth() == 1.5  # the setting in force
    assert ax.get_title() == "the running loop, 1 switch"
    assert "80% waiting, 5 batches" in [text.get_text().strip() for text in ax.texts]


def test_a_loop_switched_at_every_batch_draws_its_last_settings_and_a_short_html():
    # 400 segments drew a figure 170 inches high: a 2 MB PNG in the report's HTML
    none = {"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
            "persistent_workers": False}
    pinned = {**none, "pin_memory": True}
    settings = [none if i % 2 == 0 else pinned for i in range(400)]
    report = LiveLoaderReport(
        segments=tuple(LoaderSegment(setting, 1, 32, 0.1, 0.2, 0, i)
                       for i, setting in enumerate(settings)),
        switches=tuple(LoaderSwitch(settings[i], settings[i + 1], 0, i + 1, 0.0, 0.01)
                       for i in range(399)), settings=settings[-1], epoch=1)
    ax = plots.plot(report).axes[0]
    assert len(ax.patches) == plots.LIVE_BARS
    assert ax.get_yticklabels()[-1].get_text().endswith("(from 0:399)")  # the last run
    assert "the last 24 of 400 settings run" in ax.get_title()
    html = report._repr_html_()
    assert len(html) < 300_000
    assert "rows more" in html
    assert len(report.segments) == 400  # the fields keep every one
    assert len(report.switches) == 399


def test_the_probe_draws_one_step_over_its_ops_stacked_by_kind_with_its_peak_and_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    report = bw.find_batch(model, lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
                           loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.AdamW(model.parameters()), budget="8MiB")
    timeline, split = report.memory_timeline, report.memory_split
    assert timeline.batch_size == split.batch_size == report.max_batch_size
    # three accountings of one peak agree: the timeline's, the split's and the attempt's
    ran = [a.peak_memory_bytes for a in report.attempts
           if a.batch_size == timeline.batch_size and a.fits and not a.fake]
    assert timeline.peak_bytes == split.total_bytes == ran[-1]
    assert [name for name, _, _ in timeline.phases] == ["forward", "backward", "optimizer step"]
    assert timeline.phases[0][1] == 0
    assert timeline.phases[-1][2] == timeline.n_ops - 1  # one step, not the trial's two
    assert max(timeline.by_kind["optimizer"]) == split.optimizer_bytes > 0
    assert timeline.by_kind["activation"][timeline.ops.index(timeline.peak_op)] \
        == split.activations_bytes
    figure = bw.plot_probe(report)
    titles = [ax.get_title() for ax in figure.axes]
    assert f"one step at batch size {timeline.batch_size}, over its ops" in titles
    (timeline_ax,) = [ax for ax in figure.axes if ax.get_title().startswith("one step")]
    labels = timeline_ax.get_legend_handles_labels()[1]
    assert {"parameters", "optimizer state", "gradients", "activations (saved)", "temporaries",
            "budget"} <= set(labels)
