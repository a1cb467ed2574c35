"""Every report and result object prints short, in every way it can be shown (issue 46): str,
repr, IPython's text/plain and summary() are each at most 1,500 characters whatever the object
holds, the repr is the dataclass's own form with long parts elided (as numpy and pandas elide),
and the data stays whole in the fields and in dataclasses.asdict. The walk covers every
dataclass the results package and the public API export, each made by the engine that makes it
(find_batch, a plan, fit_trainer, Lightning's BatchSizeCallback, critical_batch, measure_noise,
NoiseTracker, accumulate, tune_loader, the live loader), then filled with large contents."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from IPython.core.formatters import PlainTextFormatter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchwidgets as bw
from batchwidgets import results
from batchwidgets.datasets import SlowDataset

LIMIT = 1500
MANY = 2000


def public_types() -> set[type]:
    names = {*results.__all__, *bw.__all__}
    found = set()
    for name in names:
        value = getattr(results, name, None) or (
            getattr(bw, name) if name[0].isupper() else None)
        if isinstance(value, type) and dataclasses.is_dataclass(value):
            found.add(value)
    return found


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def features(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def large(report):
    """``report`` with every sequence, mapping and text field made long (its own items
    repeated), nested results included: what a long run, a big model or a remembered probe
    holds, and more."""
    changes = {}
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        if isinstance(value, str) and value:
            changes[f.name] = (value + " ") * 40
        elif isinstance(value, tuple) and value:
            item = value[-1]
            grown = large(item) if dataclasses.is_dataclass(item) else item
            changes[f.name] = value + (grown,) * MANY
        elif isinstance(value, dict) and value:
            key, item = next(iter(value.items()))
            changes[f.name] = {**value, **{
                (f"{key}.{i}" if isinstance(key, str) else key + i + 1 if isinstance(key, int)
                 else (key, i)): item for i in range(MANY)}}
        elif dataclasses.is_dataclass(value):
            changes[f.name] = large(value)
    try:
        return dataclasses.replace(report, **changes)
    except (TypeError, ValueError):  # a field whose type the grown value breaks: left as is
        return report


def nested(obj, seen=None):
    """``obj`` and every result inside it."""
    seen = seen if seen is not None else {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if id(obj) in seen:
            return seen
        seen[id(obj)] = obj
        for f in dataclasses.fields(obj):
            nested(getattr(obj, f.name), seen)
    elif isinstance(obj, (tuple, list)):
        for item in obj[:3]:
            nested(item, seen)
    elif isinstance(obj, dict):
        for item in list(obj.values())[:3]:
            nested(item, seen)
    return seen


@pytest.fixture(scope="module")
def made() -> dict[str, object]:
    cross_entropy = nn.functional.cross_entropy
    probe = bw.find_batch(mlp(), features, loss_fn=cross_entropy, budget="2MiB", device="cpu",
                          cache=False)
    assert probe.what_if  # the per-op model's rows
    reports: dict[str, object] = {
        "find_batch": dataclasses.replace(probe, remembered=results.Remembered(
            "2026-11-28T18:00:00+00:00", "a-host", "/home/user/.cache/batchwidgets/x.json")),
        "plan ranks": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="2xT4",
                                    parallel="compare", cache=False),
    }
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    data = TensorDataset(x, (x[:, 0] > 0).long() * 3)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reports["measure_noise"] = bw.measure_noise(model, data, cross_entropy,
                                                batch_sizes=(1, 8, 32))
    reports["critical_batch"] = bw.critical_batch(model, data, optimizer=optimizer,
                                                  loss_fn=cross_entropy, base_batch_size=8)
    tracker = bw.NoiseTracker(ema=0.95, overhead_target=None, max_batch_size=256)
    loader = DataLoader(data, batch_size=16, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker) as acc:
        for _ in range(3):
            for inputs, targets in loader:
                cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
    changed = acc.report.schedule_changes or (results.ScheduleChange(
        update=3, steps_before=2, steps_after=4, batch_size=64, b_simple=70.0,
        b_simple_error=5.0, lr_factor=1.5),)  # when the short loop changed nothing
    reports["accumulate"] = dataclasses.replace(acc.report, schedule_changes=changed)
    reports["schedule"] = tracker.report.schedule
    reports["NoiseTracker"] = dataclasses.replace(tracker.report,
                                                  critical=reports["critical_batch"])
    slow = SlowDataset(64, shape=(3, 8, 8), work_ms=0.0)
    reports["tune_loader"] = bw.tune_loader(slow, "cpu", batch_size=16, max_workers=0,
                                            duration_s=0.05, step=lambda batch: batch[0].sum())
    live = bw.live_loader(slow, batch_size=8)
    for i, _ in enumerate(live):
        if i == 2:
            live.set(num_workers=1)
        if i == 6:
            break
    reports["live_loader"] = live.report
    per_device = reports["find_batch"].recommended_batch_size
    split = bw.split_batch(4 * per_device, per_device)
    reports["split"] = results.BatchSplitReport(4 * per_device, 1, split[0], split[1],
                                                per_device, reports["find_batch"])
    return reports


def check_short(obj) -> list[str]:
    said = {"str": str(obj), "repr": repr(obj), "text/plain": PlainTextFormatter()(obj)}
    if callable(getattr(obj, "summary", None)):
        said["summary()"] = obj.summary()
    wrong = [f"{type(obj).__name__} {how}: {len(text):,} characters"
             for how, text in said.items() if len(text) > LIMIT]
    if not said["repr"].startswith(f"{type(obj).__name__}("):
        wrong.append(f"{type(obj).__name__} repr is not the dataclass's form: "
                     f"{said['repr'][:80]}")
    return wrong


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


def test_fit_trainer_and_the_lightning_callback_reports_print_short(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    import _tiny_lm

    from batchwidgets.integrations.lightning import BatchSizeCallback

    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(tmp_path / "cache"))
    trainer = _tiny_lm.hf_trainer(str(tmp_path / "hf"))
    fitted = bw.fit_trainer(trainer, budget=_tiny_lm.BUDGET)
    again = bw.fit_trainer(_tiny_lm.hf_trainer(str(tmp_path / "hf2")), budget=_tiny_lm.BUDGET)
    assert again.remembered is not None  # 21,584 characters on d14885a
    callback = BatchSizeCallback(global_batch_size=64, budget=_tiny_lm.BUDGET)
    _tiny_lm.lightning_fit(callback, _tiny_lm.lightning_module(), max_steps=1)
    for report in (fitted, again, callback.report):
        assert type(report) is results.BatchSplitReport
        assert not check_short(report), check_short(report)
        assert "per_device_batch_size=" in str(report)
        assert str(report) == PlainTextFormatter()(report)
