"""ProbePanel driven as a user would: widget ``.value``s and ``.click()``, no browser."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import pytest
import torch
from torch import nn

import batchwidgets as bw
from batchwidgets.results import Attempt, BatchSizeReport, MemoryModel
from batchwidgets.widgets import WIDGET_VIEW, ProbePanel

MIB = 2**20
REPORT = BatchSizeReport(
    max_batch_size=41, first_oom_batch_size=42,
    attempts=(Attempt(2, True, 6_549_264, 0.020), Attempt(4, True, 9_588_512, 0.030),
              Attempt(32, True, 52_137_984, 0.200), Attempt(41, True, 65_814_600, 0.250),
              Attempt(42, False, 67_334_224, None, error="CPU out of memory (budget)")),
    device="cpu", budget_bytes=64 * MIB, limit_bytes=64 * MIB, baseline_bytes=1_200_000,
    memory_model=MemoryModel(fixed_bytes=3_500_000, per_sample_bytes=1_520_000))
NOTHING_FITS = BatchSizeReport(
    max_batch_size=0, first_oom_batch_size=1, attempts=(Attempt(1, False, 70 * MIB, None),),
    device="cpu", budget_bytes=64 * MIB, limit_bytes=64 * MIB, stop_reason="nothing fits")
WAIT_S = 30


class ScriptedProbe:
    """Stands in for ``find_batch``: replays a report's attempts through ``on_step``, can pause
    after the n-th one (to look at the panel mid-probe), and can raise at the end."""

    def __init__(self, report: BatchSizeReport, pause_after: int | None = None,
                 error: BaseException | None = None) -> None:
        self.report, self.pause_after, self.error = report, pause_after, error
        self.calls: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.paused, self.resume = threading.Event(), threading.Event()

    def __call__(self, *, on_step, headroom=None) -> BatchSizeReport:
        self.calls.append({"headroom": headroom})
        self.threads.append(threading.current_thread())
        for n, attempt in enumerate(self.report.attempts, 1):
            on_step(attempt)
            if n == self.pause_after:
                self.paused.set()
                self.resume.wait(WAIT_S)
        if self.error is not None:
            raise self.error
        return self.report if headroom is None else self.report.with_headroom(headroom)


def test_render_maps_the_report_to_widget_values():
    panel = ProbePanel(REPORT)
    assert panel.report is REPORT
    assert REPORT.recommended_batch_size == 36
    assert panel.code.value == "DataLoader(dataset, batch_size=36)"
    assert panel.headroom.value == 0.9
    assert not panel.headroom.disabled
    assert bytes(panel.plot.value).startswith(b"\x89PNG")
    assert "<td>recommended_batch_size</td><td>36</td>" in panel.summary.value
    assert "<td>max_batch_size</td><td>41</td>" in panel.summary.value
    assert "MiB left at the recommended size" in panel.summary.value
    assert panel.attempts.value.count("<tr>") == 1 + len(REPORT.attempts)
    assert panel.progress.value == panel.progress.max
    assert panel.status.value == REPORT.summary()
    assert panel.probe_button.disabled  # no probe to run


def test_headroom_slider_recomputes_the_recommendation_without_probing():
    probe = ScriptedProbe(REPORT)
    panel = ProbePanel(REPORT, probe=probe)
    panel.headroom.value = 0.5
    assert panel.report == REPORT.with_headroom(0.5)
    assert panel.code.value == "DataLoader(dataset, batch_size=20)"
    assert "<td>recommended_batch_size</td><td>20</td>" in panel.summary.value
    assert probe.calls == []


def test_probe_button_probes_off_the_main_thread_with_live_progress():
    probe = ScriptedProbe(REPORT, pause_after=2)
    panel = ProbePanel(probe=probe)
    panel.probe_button.click()
    assert probe.paused.wait(WAIT_S)
    assert panel.progress.value == 2
    assert panel.status.value == "batch size 4: fits, peak 9.1 MiB"
    assert panel.attempts.value.count("<tr>") == 1 + 2
    assert panel.probe_button.disabled
    assert panel.report is None
    probe.resume.set()
    assert panel.wait(WAIT_S) is REPORT
    assert probe.threads[0] is not threading.main_thread()
    assert panel.code.value == "DataLoader(dataset, batch_size=36)"
    assert not panel.probe_button.disabled


def test_run_probes_on_this_thread_and_shows_each_attempt_as_it_comes(capsys):
    probe = ScriptedProbe(REPORT)
    panel = ProbePanel(probe=probe)
    seen = []
    panel.status.observe(lambda change: seen.append(change["new"]), names="value")
    assert panel.run() is REPORT  # what %find_batch does: display, probe here, render
    assert probe.threads == [threading.main_thread()]
    assert seen[:2] == ["probing...", "batch size 2: fits, peak 6.2 MiB"]
    assert "batch size 42: out of memory, peak 64.2 MiB" in seen
    assert seen[-1] == REPORT.summary()
    capsys.readouterr()  # outside IPython, display() prints the bundle


def test_probing_again_keeps_the_headroom_the_user_chose():
    probe = ScriptedProbe(REPORT)
    panel = ProbePanel(REPORT, probe=probe)
    panel.headroom.value = 0.6
    panel.probe_button.click()
    panel.wait(WAIT_S)
    assert probe.calls == [{"headroom": 0.6}]
    assert panel.report == REPORT.with_headroom(0.6)


def test_a_failing_probe_shows_its_error_and_wait_raises_it():
    panel = ProbePanel(probe=ScriptedProbe(REPORT, error=ValueError("shapes do not match")))
    panel.probe_button.click()
    with pytest.raises(ValueError, match="shapes do not match"):
        panel.wait(WAIT_S)
    assert panel.status.value == "ValueError: shapes do not match"
    assert panel.progress.bar_style == "danger"
    assert not panel.probe_button.disabled


def test_when_nothing_fits_the_panel_shows_every_attempt():
    error = bw.NoBatchSizeFits(NOTHING_FITS)
    panel = ProbePanel(probe=ScriptedProbe(NOTHING_FITS, error=error))
    panel.probe_button.click()
    with pytest.raises(bw.NoBatchSizeFits):
        panel.wait(WAIT_S)
    assert panel.report is NOTHING_FITS
    assert panel.status.value.startswith("NoBatchSizeFits: No batch size fits")
    assert panel.headroom.disabled
    assert bytes(panel.plot.value).startswith(b"\x89PNG")


def test_the_panel_displays_live_with_the_static_report_as_fallback():
    panel = ProbePanel(REPORT)
    bundle = panel._repr_mimebundle_()
    assert bundle[WIDGET_VIEW]["model_id"] == panel.model_id
    assert bundle["text/html"] == REPORT._repr_html_()
    assert bundle["text/plain"] == REPORT.summary()
    assert "probing" not in ProbePanel(probe=ScriptedProbe(REPORT))._repr_mimebundle_()[
        "text/html"]


def test_the_button_runs_the_real_find_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
    options = {"loss_fn": nn.functional.cross_entropy, "budget": "256KiB",
               "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    panel = ProbePanel(probe=functools.partial(bw.find_batch, model, make_batch, **options))
    panel.probe_button.click()
    report = panel.wait(WAIT_S * 4)
    assert panel.progress.value == report.n_attempts
    assert panel.code.value == f"DataLoader(dataset, batch_size={report.recommended_batch_size})"
    direct = bw.find_batch(model, make_batch, **options)
    without_times = [dataclasses.replace(a, step_time_s=None) for a in report.attempts]
    assert without_times == [dataclasses.replace(a, step_time_s=None) for a in direct.attempts]


def tiny_probe_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def vectors(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def test_the_stop_button_ends_the_probe_with_what_it_found():
    model = tiny_probe_model()
    panel: ProbePanel

    def probe(on_step, **options):
        def step(attempt: Attempt) -> None:
            on_step(attempt)
            panel.stop_button.click()  # the user clicks Stop after the first size
        return bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                             budget="256KiB", on_step=step, **options)

    panel = ProbePanel(probe=probe)
    report = panel.run()
    assert report.stop_reason == "stopped"
    assert report.n_attempts == 1
    assert panel.stop_button.disabled


def test_choosing_a_target_runs_one_predicted_probe_and_the_details_show_the_rows():
    model = tiny_probe_model()
    panel = ProbePanel(probe=functools.partial(bw.find_batch, model, vectors,
                                               loss_fn=nn.functional.cross_entropy,
                                               budget="256KiB"))
    report = panel.run()
    assert "what if" in panel.details.value  # the predicted rows of every report
    assert "memory at the peak" in panel.details.value
    panel.target.value = "T4"
    predicted = panel.wait(WAIT_S)
    assert predicted.target == "T4"
    assert "predicted, not run" in panel.status.value
    assert predicted.max_batch_size > report.max_batch_size
    # the target is named wherever the panel says where: the answer, the summary, the plot
    assert "on T4, predicted (not run; band" in panel.answer.value
    assert "<caption>find_batch on T4</caption>" in panel.summary.value
    assert "<td>target</td><td>T4 (predicted, not run)</td>" in panel.summary.value
    assert "<td>device</td>" not in panel.summary.value
    panel.close()


def test_a_probe_that_takes_no_target_keeps_the_selector_off():
    panel = ProbePanel(probe=lambda on_step, headroom=0.9: REPORT)
    assert panel.target.disabled


class SlowBlocks(nn.Module):
    """Forty blocks, each about 10 ms: one forward takes 0.4 s. ``stop_at`` (an Event and a
    block count) is set from inside the first real step, as a user's click mid-step."""

    def __init__(self, stop_after: int, clicked: threading.Event) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(40))
        self.head = nn.Linear(16, 4)
        self.stop_after, self.clicked = stop_after, clicked
        self.real_calls = 0  # blocks run on real tensors (the fake trace first runs on fakes)
        self.calls_after_click = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if type(x) is torch.Tensor:
                self.real_calls += 1
                if self.clicked.is_set():
                    self.calls_after_click += 1
                elif self.real_calls == self.stop_after:
                    self.clicked.set()
                time.sleep(0.01)
            x = torch.relu(block(x))
        return self.head(x)


def test_stop_ends_the_probe_in_the_middle_of_a_step_and_puts_everything_back():
    clicked = threading.Event()
    model = SlowBlocks(stop_after=5, clicked=clicked)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()  # real optimizer state to restore
    model.real_calls = model.calls_after_click = 0  # count from the probe's first real step
    clicked.clear()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [v["exp_avg"].clone() for v in optimizer.state.values()]
    rng = torch.get_rng_state()
    report = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget="64MiB", should_stop=clicked.is_set)
    assert report.stop_reason == "stopped"
    assert clicked.is_set()
    # stopped before the forward it was clicked in reached its end (35 more blocks)
    assert model.calls_after_click < len(model.blocks) - model.stop_after
    assert all(a.fake for a in report.attempts)  # the real size it stopped in is not an attempt
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v["exp_avg"], m) for v, m in zip(optimizer.state.values(), moments))
    assert torch.equal(torch.get_rng_state(), rng)
