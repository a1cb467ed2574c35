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
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import batchwidgets as bw
from batchwidgets import results
from batchwidgets._warnings import BatchwidgetsWarning
from batchwidgets.datasets import SlowDataset
from batchwidgets.engine.probe import NoBatchSizeFits
from batchwidgets.integrations._fit import split_report


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def images(n):
    return torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def features(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        return self.linear(x)


def sequences(n, length):
    return torch.randn(n, length, 16), torch.randint(0, 4, (n, length))


def per_token(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def probes() -> dict:
    cross_entropy = nn.functional.cross_entropy
    x, y = images(300)
    try:
        bw.find_batch(cnn(), images, loss_fn=cross_entropy, budget="64KiB", device="cpu")
    except NoBatchSizeFits as error:
        nothing = error.report
    return {
        "find_batch": bw.find_batch(cnn(), images, loss_fn=cross_entropy, budget="8MiB",
                                    device="cpu"),
        "find_batch real steps only": bw.find_batch(cnn(), images, loss_fn=cross_entropy,
                                                    budget="8MiB", device="cpu", trace="real"),
        "find_batch of a Dataset, what_if": bw.find_batch(
            cnn(), TensorDataset(x, y), loss_fn=cross_entropy, budget="8MiB", device="cpu",
            what_if=True),
        "find_batch of one tensor": bw.find_batch(cnn(), x[0], budget="8MiB", device="cpu",
                                                  loss_fn=lambda out: out.square().mean()),
        "find_batch nothing fits": nothing,
        "find_batch frontier": bw.find_batch(Tagger(), sequences, loss_fn=per_token,
                                             budget="4MiB", device="cpu", seq_len=[8, 32]),
        "plan": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="T4"),
        "plan what_if": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="T4",
                                      what_if=True),
        "plan ranks": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="2xT4",
                                    parallel="compare"),
    }


def noise_reports() -> dict:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(200, 16, generator=generator),
                         torch.randint(0, 4, (200,), generator=generator))
    model = mlp()
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))  # a gradient above the noise
    cross_entropy = nn.functional.cross_entropy
    shuffled = DataLoader(data, batch_size=16, shuffle=True)
    with pytest.warns(BatchwidgetsWarning, match="does not shuffle"):
        in_order = bw.measure_noise(model, DataLoader(data, batch_size=16), cross_entropy)
    return {
        "measure_noise whole": bw.measure_noise(model, data, cross_entropy,
                                                batch_sizes=(1, 8, 32)),
        "measure_noise N of M": bw.measure_noise(model, shuffled, cross_entropy,
                                                 max_examples=64),
        "measure_noise unknown size": bw.measure_noise(model, Stream(data), cross_entropy,
                                                       max_examples=50),
        "measure_noise not measurable": bw.measure_noise(mlp(), data, cross_entropy,
                                                         max_examples=16, batch_sizes=(1, 4)),
        "measure_noise unshuffled": in_order,
    }


def training_reports() -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 10, generator=generator)
    data = TensorDataset(x, (x[:, 0] + 0.5 * torch.randn(1024, generator=generator) > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cross_entropy = nn.functional.cross_entropy
    critical = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=cross_entropy,
                                 base_batch_size=8)
    tracker = bw.NoiseTracker(ema=0.95, overhead_target=None, max_batch_size=256)
    loader = DataLoader(data, batch_size=16, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker) as acc:
        for _ in range(4):
            for inputs, targets in loader:
                cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
    made = {"critical_batch": critical, "accumulate auto": acc.report,
            "NoiseTracker": tracker.report, "schedule": tracker.report.schedule}
    tracker.critical = critical
    made |= {"NoiseTracker with critical": tracker.report,
             "schedule from critical": tracker.report.schedule}
    return made, {"tracker": tracker}


def loader_reports() -> tuple[dict, dict]:
    slow = SlowDataset(256, shape=(3, 8, 8), work_ms=0.2)
    tuned = bw.tune_loader(slow, "cpu", batch_size=16, max_workers=1, duration_s=0.1,
                           step=lambda batch: batch[0].sum())
    live = bw.live_loader(slow, batch_size=16)
    for i, _ in enumerate(live):
        if i == 4:
            live.set(num_workers=1)
        if i == 10:
            break
    return ({"tune_loader": tuned, "data_stall": tuned.stall, "live_loader": live.report},
            {"live": live})


@pytest.fixture(scope="module")
def gallery():
    made = probes()
    made["memory_split"] = made["find_batch"].memory_split
    # what fit_trainer and BatchSizeCallback return: their split of the probe's answer
    made["batch_split"] = split_report(made["find_batch"], 96, world_size=1, stacklevel=1)
    made |= noise_reports()
    trained, objects = training_reports()
    made |= trained
    loaders, live = loader_reports()
    return made | loaders, objects | live


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
