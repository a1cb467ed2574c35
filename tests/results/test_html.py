"""Every report renders without widgets: an HTML table and an inline PNG through the display
protocol, as nbviewer, GitHub and ``jupyter nbconvert`` show it."""

from __future__ import annotations

import base64
import dataclasses
import re

import pytest
from IPython.core.formatters import DisplayFormatter

from batchwidgets import plots, results
from batchwidgets.results import (
    AccumulationReport,
    Attempt,
    BatchSizeReport,
    BatchSplitReport,
    Branch,
    CriticalBatchReport,
    DataStallReport,
    LayerNoise,
    LiveLoaderReport,
    LoaderReport,
    LoaderSegment,
    LoaderSwitch,
    LoaderTrial,
    MemoryModel,
    NoiseReport,
    NoiseTrackerReport,
)

MIB = 2**20
EXAMPLES = {  # one or more per report type; test_every_report_type_has_an_example keeps it whole
    BatchSizeReport: [
        BatchSizeReport(
            max_batch_size=41, first_oom_batch_size=42,
            attempts=(Attempt(2, True, 6 * MIB, 0.02), Attempt(41, True, 65 * MIB, 0.25),
                      Attempt(42, False, 67 * MIB, None)),
            device="<cpu>", budget_bytes=64 * MIB, limit_bytes=64 * MIB,
            memory_model=MemoryModel(fixed_bytes=3 * MIB, per_sample_bytes=1.5 * MIB)),
        BatchSizeReport(max_batch_size=0, first_oom_batch_size=1,
                        attempts=(Attempt(1, False, None, None),), device="cuda:0",
                        budget_bytes=None, stop_reason="nothing fits"),
    ],
    AccumulationReport: [
        AccumulationReport(steps=4, micro_steps=10, real_steps=3, remainder="applied",
                           remainder_micro_steps=2, micro_batch_size=32,
                           losses=(2.3, 2.1, 1.9), grad_norms=(1.0, 0.9, 0.8)),
    ],
    CriticalBatchReport: [
        CriticalBatchReport(
            critical_batch_size=70.0, critical_batch_size_error=25.0, target_loss=2.26,
            start_loss=7.31, examples=34536, base_batch_size=4, s_min=3.0, e_min=210.0,
            lr_scaling="linear", b_simple=20.5, seeds_fitted=2,
            ladder=(Branch(4, 0.1, 12, 48, False, 0), Branch(8, 0.2, None, None, True, 0),
                    Branch(8, 0.1, 7, 56, False, 0))),
        CriticalBatchReport(
            critical_batch_size=None, critical_batch_size_error=None, target_loss=2.48,
            start_loss=7.31, examples=27000, base_batch_size=4, s_min=None, e_min=None,
            lr_scaling="sqrt", reason="the critical batch is above <128>", ladder=()),
    ],
    NoiseReport: [
        NoiseReport(trace_cov=2.0, grad_norm_sq=0.5, loss_mean=1.0, loss_variance=0.25,
                    n_examples=10, n_available=100, sampled=True, batch_sizes=(1, 4, 16),
                    layers=(LayerNoise("0.weight", 1.5, 0.4), LayerNoise("0.bias", 0.5, 0.1))),
    ],
    NoiseTrackerReport: [
        NoiseTrackerReport(history=((1, None, 1.1, 5.5), (2, 6.2, 1.0, 6.2)), losses=(2.0, 1.8),
                           b_simple=6.2, b_simple_error=0.4, grad_norm_sq=1.0, trace_cov=6.2,
                           measurable=True, reason="", n_updates=2, micro_batch_size=8,
                           effective_batch_size=32, grad_norm_sq_error=0.05,
                           trace_cov_error=0.3, n_micro=4),
        NoiseTrackerReport(history=(), losses=(1.0,), b_simple=None, b_simple_error=None,
                           grad_norm_sq=None, trace_cov=None, measurable=False,
                           reason="<not measured>", n_updates=0, micro_batch_size=None,
                           effective_batch_size=None),
    ],
    LoaderReport: [
        LoaderReport(
            trials=(LoaderTrial(0, False, None, False, 32, 900.0, 28.1, 1.1e7, 0.004, 50, 1600,
                                1.78, "cpu"),
                    LoaderTrial(2, True, 4, True, 32, 2400.0, 75.0, 2.9e7, 0.31, 120, 3840,
                                1.6, "cuda:0", warnings=("<more workers than CPUs>",)),
                    LoaderTrial(4, False, 2, False, 32, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, "cpu",
                                error="<ValueError: bad sample 7>")),
            best_index=1, current_index=1, device="cuda:0", grid_size=24, search_time_s=6.2,
            warnings=("<pin_memory without an accelerator>",),
            stall=DataStallReport(0.4, 0.05, 0.03, 0.02, 20, "cuda:0")),
    ],
    DataStallReport: [DataStallReport(0.25, 0.04, 0.03, 0.01, 20, "<cpu>")],
    LiveLoaderReport: [
        LiveLoaderReport(
            segments=(LoaderSegment({"num_workers": 0, "pin_memory": False,
                                     "prefetch_factor": None, "persistent_workers": False},
                                    n_batches=6, n_samples=192, wall_s=0.6, wait_s=0.45,
                                    epoch=0, batch=0),
                      LoaderSegment({"num_workers": 2, "pin_memory": False,
                                     "prefetch_factor": 2, "persistent_workers": False},
                                    n_batches=10, n_samples=320, wall_s=0.3, wait_s=0.03,
                                    epoch=0, batch=6)),
            switches=(LoaderSwitch({"num_workers": 0}, {"num_workers": 2}, epoch=0, batch=6,
                                   shutdown_s=0.0, cost_s=0.04, note="<note>"),),
            settings={"num_workers": 2, "pin_memory": False, "prefetch_factor": 2,
                      "persistent_workers": False}, epoch=1),
        LiveLoaderReport(segments=(), switches=(), settings={"num_workers": 0}, epoch=0),
    ],
}
EXAMPLES[BatchSplitReport] = [
    BatchSplitReport(global_batch_size=128, world_size=2, per_device_batch_size=32,
                     accumulation_steps=2, max_per_device=36,
                     probe=EXAMPLES[BatchSizeReport][0]),
]
ALL_EXAMPLES = [report for reports in EXAMPLES.values() for report in reports]


def test_every_report_type_has_an_example():
    report_types = {value for name, value in vars(results).items()
                    if name.endswith("Report") and dataclasses.is_dataclass(value)}
    assert report_types == set(EXAMPLES)


@pytest.mark.parametrize("report", ALL_EXAMPLES)
def test_static_rendering_is_a_table_and_an_inline_png(report):
    data, _ = DisplayFormatter().format(report)
    assert set(data) >= {"text/plain", "text/html"}
    page = data["text/html"]
    assert "<table" in page
    assert "<script" not in page
    png = re.search(r'<img alt="batchwidgets plot" src="data:image/png;base64,([^"]+)"/>', page)
    if type(report) in plots._PLOTTERS:  # a report type without a plot yet shows its table
        assert base64.b64decode(png.group(1)).startswith(b"\x89PNG")


def test_static_rendering_escapes_every_value():
    page = EXAMPLES[BatchSizeReport][0]._repr_html_()
    assert "<cpu>" not in page
    assert "&lt;cpu&gt;" in page
