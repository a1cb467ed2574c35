"""Advice that agrees with itself (issue 26): no report or panel recommends a setting beside a
warning against it. Each recommender meets each warning it can show: tune_loader's and a panel's
best, the live autotune's settling point, against "pin_memory=True does nothing here" and
"num_workers=N is more than the CPUs"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _sim_loader import SimLoop, cpu_bound, start
from torch.utils.data import DataLoader, TensorDataset

import batchwidgets as bw
from batchwidgets.engine.loader import loader_report, measure_loader, usable_cpus
from batchwidgets.engine.loader._autotune import Autotune
from batchwidgets.engine.loader._checks import setting_warnings

NO_ACCELERATOR = not (hasattr(torch, "accelerator") and torch.accelerator.is_available())
needs_cpu_only = pytest.mark.skipif(not NO_ACCELERATOR, reason="pin_memory helps here")


def warned_against(settings: dict) -> list[str]:
    """The warnings these settings draw by themselves."""
    return setting_warnings(settings["num_workers"], settings["pin_memory"])


def agrees(settings: dict, shown: tuple[str, ...] | list[str]) -> bool:
    """The recommendation ``settings`` is not argued against by any warning ``shown``."""
    return not set(warned_against(settings)) & set(shown)


def data() -> TensorDataset:
    return TensorDataset(torch.randn(256, 8))


def trial(**settings):
    base = measure_loader(data(), batch_size=32, device="cpu", duration_s=0.02, max_batches=4)
    return dataclasses.replace(base, **settings)


@pytest.mark.parametrize("warned", [
    pytest.param({"pin_memory": True}, marks=needs_cpu_only, id="pin_memory without accelerator"),
    pytest.param({"num_workers": usable_cpus() + 1, "prefetch_factor": 2},
                 id="more workers than CPUs"),
])
def test_the_best_of_a_report_is_never_a_setting_it_warns_against(warned):
    slow = trial(samples_per_s=1_000.0, warnings=())
    fast = trial(samples_per_s=9_000.0, **warned)
    fast = dataclasses.replace(fast, warnings=tuple(warned_against(fast.settings)))
    assert fast.warnings  # the case: the faster setting draws a warning to change it
    for trials in ([slow, fast], [fast, slow]):
        report = loader_report(trials)
        assert report.best is slow
        assert agrees(report.best.settings, report.warnings)
    alone = loader_report([fast])  # nothing else ran: the warned one is all there is
    assert alone.best is fast


@needs_cpu_only
def test_a_panel_started_from_pin_memory_recommends_what_its_warning_says():
    loader = DataLoader(data(), batch_size=32, pin_memory=True)
    panel = bw.LoaderPanel(loader, device="cpu", duration_s=0.05, max_workers=1)
    try:
        first = panel.wait(60)
        assert first.current.pin_memory  # measured as given
        assert first.warnings
        panel.autotune.click()
        report = panel.wait(120)
        assert not report.best.pin_memory
        assert agrees(report.best.settings, report.warnings)
        shown = {c: panel.controls[c].value for c in ("num_workers", "pin_memory")}
        assert shown == {"num_workers": report.best.num_workers, "pin_memory": False}
    finally:
        panel.close()


@pytest.mark.parametrize("stalls", [False, True], ids=["no stall", "stalls"])
def test_the_live_autotune_never_settles_on_settings_it_warns_against(stalls):
    first = start(1, 2, pin_memory=True)
    tuner = Autotune(first, max_workers=4, pin_memory=False)
    cost = cpu_bound() if stalls else (lambda settings: 0.01)  # the step alone: no stall
    advice = SimLoop(cost).run(tuner, first)
    assert tuner.done
    assert advice, "it stayed on pin_memory=True"
    settled = advice[-1]
    assert not settled["pin_memory"]  # pin_memory=False: pinning helps nothing here
    assert tuner.advised_against(first)
    assert not tuner.advised_against(settled)
