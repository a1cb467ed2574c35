"""Small inconsistencies a new user met (issue 46): a live loader's report is read as the other
reports are (a property), the demo's per-sample line gives its table's peak again, a peak names
its module by path and class, a plot panel with one point says its value, and what-if rows that
leave the answer as it is fold into one "no gain" line."""

from __future__ import annotations

import re
import warnings

import pytest

import batchwidgets as bw
from batchwidgets.datasets import SlowDataset
from batchwidgets.results import Attempt, BatchSizeReport, WhatIf


def test_a_live_loaders_report_is_a_property_and_the_old_call_still_answers():
    live = bw.live_loader(SlowDataset(32, shape=(2,), work_ms=0.0), batch_size=8)
    for _ in live:
        pass
    report = live.report
    assert isinstance(report, bw.LiveLoaderReport)  # not a bound method
    assert report.n_batches == 4
    with pytest.warns(DeprecationWarning, match=r"live\.report is the report itself"):
        called = live.report()
    assert called == report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert live.report.n_samples == 32  # the property warns of nothing


def memory_model_row(report: BatchSizeReport) -> tuple[float, float]:
    """The row's "F MiB + S MiB per sample", as numbers in MiB."""
    said = dict(report.rows())["memory model"]
    scale = {"B": 2**-20, "KiB": 2**-10, "MiB": 1.0, "GiB": 2**10}
    (f, fu), (s, su) = re.findall(r"(-?[\d.]+) (B|KiB|MiB|GiB)", said)
    return float(f) * scale[fu], float(s) * scale[su]


def test_the_demos_per_sample_line_gives_its_tables_peak_and_names_the_peaks_module():
    from batchwidgets.demo import run_demo

    report = run_demo(device="cpu", budget="32MiB")
    fixed, per_sample = memory_model_row(report)
    top = max((a for a in report.attempts if a.fits and not a.fake),
              key=lambda a: a.batch_size)
    table = round(top.peak_memory_bytes / 2**20, 1)  # as the demo's table prints it
    assert abs(fixed + per_sample * top.batch_size - table) <= 0.06, (
        dict(report.rows())["memory model"], top.batch_size, table)
    # the demo's CNN is an nn.Sequential: its modules' paths are indices, said with the class
    assert re.fullmatch(r"\d+ \(\w+\) (forward|backward), at aten\.\S+", report.peak_location), (
        report.peak_location)
    assert "backward of" not in report.memory_split.where


def one_timed(**fields) -> BatchSizeReport:
    return BatchSizeReport(
        max_batch_size=96, first_oom_batch_size=97, device="cuda:0", budget_bytes=None,
        attempts=(Attempt(96, True, 2**20, 0.25), Attempt(97, False, None, None)), **fields)


def test_a_throughput_of_one_timed_size_is_said_not_plotted():
    pytest.importorskip("matplotlib")
    figure = bw.plot_probe(one_timed())
    speed = figure.axes[1]
    assert not speed.lines  # no lone marker
    said = " ".join(text.get_text() for text in speed.texts)
    assert "384 samples/s at batch size 96" in said


def test_what_if_rows_that_buy_nothing_fold_into_one_line_and_stay_in_the_field():
    rows = (WhatIf("bf16", 140, True, "autocast"),
            *(WhatIf(f"checkpoint transformer.h.{i}.attn (GPT2Attention)", 96, False, "recompute")
              for i in range(3)))
    report = one_timed(what_if=rows)
    assert report.what_if == rows  # the field keeps every row
    folded = ("no gain: checkpoint transformer.h.0.attn (GPT2Attention), checkpoint "
              "transformer.h.1.attn (GPT2Attention), checkpoint transformer.h.2.attn "
              "(GPT2Attention)")
    assert folded in str(report)
    assert "bf16 -> 140 (measured)" in str(report)
    page = report._repr_html_()
    assert page.count("checkpoint transformer.h.") == 3  # once each, in the one folded row
    assert f"<td>{folded}</td>" in page
