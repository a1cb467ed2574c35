"""Issue 41: every report tells one story. Over every report type (made by the engine, on the CPU),
its static HTML, its panel and every report the tutorials make, each number printed in a summary,
advice line, row or table is checked against the field it comes from, each rule named against
the factor it gives, and each "traced/measured/predicted" against the attempts (tests/_story.py
says how). The checker is shown to catch each kind of disagreement it looks for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _story import panel_texts, problems, reports_in, told_in
from test_reports_print_short import MANY, check_short, large, nested, public_types
from torch import nn

import batchwidgets as bw
from batchwidgets import results
from batchwidgets.datasets import SlowDataset

# the gallery, every report type made by the engine: tests/results/conftest.py


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def features(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


REPORT_TYPES = sorted(
    name for name in results.__all__
    if isinstance(getattr(results, name), type)
    and issubclass(getattr(results, name), results._text.TextForm))


@pytest.mark.slow
def test_the_gallery_has_every_report_type(gallery):
    made, _ = gallery
    assert sorted({type(report).__name__ for report in made.values()}) == REPORT_TYPES


def test_every_report_tells_one_story(gallery):
    made, _ = gallery
    told = {name: problems(report) for name, report in made.items()}
    assert not any(told.values()), said(told)


def test_every_panel_tells_its_reports_story(gallery):
    made, objects = gallery
    told = {}
    for name in ("find_batch", "find_batch of a Dataset, what_if", "plan", "plan ranks"):
        panel = bw.ProbePanel(made[name])
        told[f"ProbePanel {name}"] = problems(made[name], panel_texts(panel))
        panel.close()
    noise = bw.NoisePanel(objects["tracker"], report=made["measure_noise whole"])
    noise.refresh()
    told["NoisePanel"] = problems(noise.report, panel_texts(noise))
    noise.close()
    loader = bw.LoaderPanel(SlowDataset(64, shape=(3, 8, 8), work_ms=0.0), start=False)
    loader.render(made["tune_loader"])
    told["LoaderPanel"] = problems(made["tune_loader"], panel_texts(loader))
    loader.close()
    live = bw.LoaderPanel(objects["live"])
    told["LoaderPanel of a live loader"] = problems(live.refresh(), panel_texts(live))
    live.close()
    assert not any(told.values()), said(told)


def said(told: dict) -> str:
    return "\n".join(f"{name}: {problem}" for name, found in told.items() for problem in found)


# ---- every report prints short (issue 46; the helpers: test_reports_print_short.py) -------

@pytest.fixture(scope="module")
def made(gallery) -> dict[str, object]:
    """The gallery's reports (tests/results/conftest.py), each made by the engine, with the parts
    a short run leaves empty filled in."""
    reports, _ = gallery
    probe = reports["find_batch"]
    assert probe.what_if  # the per-op model's rows
    made: dict[str, object] = {
        **reports,
        "find_batch": dataclasses.replace(probe, remembered=results.Remembered(
            "2026-11-28T18:00:00+00:00", "a-host", "/home/user/.cache/batchwidgets/x.json")),
    }
    accumulated = reports["accumulate auto"]
    changed = accumulated.schedule_changes or (results.ScheduleChange(
        update=3, steps_before=2, steps_after=4, batch_size=64, b_simple=70.0,
        b_simple_error=5.0, lr_factor=1.5),)  # when the short loop changed nothing
    made["accumulate auto"] = dataclasses.replace(accumulated, schedule_changes=changed)
    per_device = probe.recommended_batch_size
    split = bw.split_batch(4 * per_device, per_device)
    made["split"] = results.BatchSplitReport(4 * per_device, 1, split[0], split[1],
                                             per_device, made["find_batch"])
    return made


def test_every_public_result_type_prints_short_whatever_it_holds(made):
    walked: dict[type, list] = {}
    for report in made.values():
        for obj in nested(large(report)).values():
            walked.setdefault(type(obj), []).append(obj)
    missing = public_types() - set(walked)
    assert not missing, f"no instance made of {sorted(t.__name__ for t in missing)}"
    wrong = [problem for objects in walked.values() for obj in objects
             for problem in check_short(obj)]
    assert not wrong, "\n".join(wrong)


def test_the_data_stays_whole_in_the_fields_and_asdict(made):
    report = large(made["find_batch"])
    assert len(report.attempts) > MANY
    assert len(dataclasses.asdict(report)["attempts"]) == len(report.attempts)
    timeline = report.memory_timeline
    assert len(timeline.ops) > MANY
    text = repr(timeline)
    assert text.startswith("MemoryTimeline(batch_size=")
    assert f"length {len(timeline.ops)}" in text  # elided, with its length, as pandas says it
    assert ", ..., " in text
    assert repr(timeline.ops[0]) in text
    assert repr(timeline.ops[-1]) in text  # first few, ..., last few


# ---- the checker catches what it looks for ----------------------------------------------------

def lying(report, **methods):
    """``report`` as an instance of a subclass whose ``methods`` say something else."""
    cls = type(f"Lying{type(report).__name__}", (type(report),), {
        name: property(function) if name in ("advice", "traced") else function
        for name, function in methods.items()})
    return cls(**{f.name: getattr(report, f.name) for f in dataclasses.fields(report)})


def whole_noise(b_simple=81.4):
    return results.NoiseReport(trace_cov=b_simple / 2, grad_norm_sq=0.5, loss_mean=1.0,
                               loss_variance=0.25, n_examples=1000, n_available=1000,
                               sampled=False, batch_sizes=(8, 32, 256), b_simple_error=0.0)


def test_the_check_catches_a_rule_named_with_another_rules_factor():
    honest = whole_noise()
    assert problems(honest) == []
    swapped = honest.advice.replace("×5.57 by the noise-scale rule", "×10.1 by the noise-scale "
                                    "rule")
    found = problems(lying(honest, advice=lambda self: swapped))
    assert any("the noise-scale rule from B = 8 to 81 gives 5.57" in p for p in found), found


def test_the_check_catches_a_number_that_is_no_field():
    honest = whole_noise()
    wrong = honest.summary().replace("81.4", "67.3")
    found = problems(lying(honest, summary=lambda self: wrong))
    assert any("'67.3' is no field of the report" in p for p in found), found


def test_the_check_catches_a_trade_off_and_a_comparison_that_do_not_add_up():
    honest = whole_noise()
    bad = honest.advice.replace("11.2× the fewest steps", "9× the fewest steps")
    assert any("S/S_min at B = 8" in p for p in problems(lying(honest, advice=lambda s: bad)))
    other = dataclasses.replace(whole_noise(90.0), b_simple_error=3.0)
    said = honest.compare(other).replace("differ by more than", "agree within")
    found = problems(lying(honest, summary=lambda self: said))
    assert any("not 'agree within their errors'" in p for p in found), found


def test_the_check_catches_traced_words_against_the_attempts(gallery):
    made, _ = gallery
    honest = made["find_batch"]
    assert [a for a in honest.attempts if a.fake]
    found = problems(lying(honest, traced=lambda self: "real steps"))
    assert any("fake traces are at sizes" in p for p in found), found
    said = honest.summary().replace("tries after", "predicted, not run; tries after")
    found = problems(lying(honest, summary=lambda self: said))
    assert any("says 'predicted, not run' with target=None" in p for p in found), found
    planned = dataclasses.replace(honest, target="T4", target_band=(1, 2), trace="fake")
    assert "a plan traced on fake tensors has real attempts" in problems(planned)


# ---- every tutorial ------------------------------------------------------------------------
# Each tutorial's reports are checked where nbval runs it: after every cell, in its own kernel
# (notebooks/conftest.py asks the kernel for told_in(globals()), tests/_story.py). Here: that the
# check finds a tutorial's reports, and what it says of one that lies.

def test_the_tutorial_check_finds_reports_in_a_namespace_and_what_they_get_wrong():
    honest = bw.find_batch(mlp(), features, loss_fn=nn.functional.cross_entropy, budget="8MiB")
    panel = type("ProbePanel", (), {"report": honest})()
    namespace = {"report": honest, "reports": [honest], "panel": panel, "_hidden": honest}
    assert reports_in(namespace) == [honest]  # each report once, however it is reached
    assert told_in(namespace) == {}
    again = bw.find_batch(mlp(), features, loss_fn=nn.functional.cross_entropy, budget="8MiB")
    assert again.remembered is not None  # its when and where are words of the report's own
    assert told_in({"again": again}) == {}
    liar = lying(honest, summary=lambda self: "max_batch_size=9999, all measured")
    told = told_in({"report": liar})
    assert list(told) == ["report: LyingBatchSizeReport"]
    assert any("9999" in problem for problem in told["report: LyingBatchSizeReport"])
