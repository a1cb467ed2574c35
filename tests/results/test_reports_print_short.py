"""Every report and result object prints short, in every way it can be shown (issue 46): str,
repr, IPython's text/plain and summary() are each at most 1,500 characters whatever the object
holds, the repr is the dataclass's own form with long parts elided (as numpy and pandas elide),
and the data stays whole in the fields and in dataclasses.asdict. The walk covers every
dataclass the results package and the public API export, each made by the engine that makes it
(find_batch, a plan, fit_trainer, Lightning's BatchSizeCallback, critical_batch, measure_noise,
NoiseTracker, accumulate, tune_loader, the live loader), then filled with large contents.
The walk over the gallery (tests/results/conftest.py) is in test_report_consistency.py, the
gallery's other reader: under ``--dist loadfile`` one file is one worker, so the gallery is
built once; fit_trainer's and the callback's reports are here."""

from __future__ import annotations

import dataclasses

import pytest
from IPython.core.formatters import PlainTextFormatter

import batchwidgets as bw
from batchwidgets import results

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
