"""``report.save_snapshot(path)``: the traced step in the pickle format of
``torch.cuda.memory._snapshot()``, read back by PyTorch's own reader (``python -m
torch.cuda._memory_viz``): its totals are the report's, and its plots render."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
import torch
from torch.cuda._memory_viz import _format_size

import batchwidgets as bw


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def make_batch(batch_size: int):
    return torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,))


def memory_viz(*argv: str) -> str:
    result = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def totals(path) -> tuple[str, str]:
    stats = memory_viz("stats", str(path))
    reserved = re.search(r"total_reserved: (.*)", stats).group(1)
    allocated = re.search(r"total_allocated: (.*)", stats).group(1)
    return reserved, allocated


@pytest.fixture(scope="module")
def plan():
    return bw.find_batch(mlp(), make_batch, loss_fn=torch.nn.functional.cross_entropy,
                         target="T4@64MiB", cache=False)


@pytest.fixture(scope="module")
def probe():
    return bw.find_batch(mlp(), make_batch, loss_fn=torch.nn.functional.cross_entropy,
                         budget="4MiB", max_batch_size=512, cache=False)


def test_a_plan_reads_back_with_the_reserved_and_allocated_it_predicts(plan, tmp_path):
    path = tmp_path / "plan.pickle"
    said = plan.save_snapshot(path)
    step = plan.step_snapshot
    assert step.batch_size == plan.max_batch_size
    assert totals(path) == (_format_size(step.reserved_bytes), _format_size(step.allocated_bytes))
    # the caching allocator's model at the answer: within the target, and what the plan needs
    assert step.reserved_bytes <= plan.predict_peak_bytes(plan.max_batch_size) <= plan.limit_bytes
    assert 0 < step.allocated_bytes <= step.reserved_bytes
    assert "caching allocator's model" in said
    data = pickle.loads(path.read_bytes())
    assert data["batchwidgets"]["caching_allocator"] is True
    actions = {event["action"] for event in data["device_traces"][0]}
    assert {"segment_alloc", "alloc", "free_requested", "free_completed"} <= actions


def test_every_event_names_the_module_and_op_that_made_it(plan, tmp_path):
    path = tmp_path / "plan.pickle"
    plan.save_snapshot(path)
    data = pickle.loads(path.read_bytes())
    frames = [event["frames"] for event in data["device_traces"][0] if event["action"] == "alloc"]
    assert all(frames)
    named = {(f[0]["filename"], f[0]["name"]) for f in frames}
    assert any(where.startswith("forward of") and op.startswith("aten.addmm")
               for where, op in named), named
    assert any(where.startswith("backward of") for where, _ in named)
    assert ("before the step", "parameter") in named
    blocks = [b for segment in data["segments"] for b in segment["blocks"]
              if b["state"] == "active_allocated"]
    assert all(b["frames"] for b in blocks)


def test_the_trace_ends_where_the_segments_are_read(plan, tmp_path):
    """PyTorch's viewer reads the segments as the state after the trace's last event."""
    path = tmp_path / "plan.pickle"
    plan.save_snapshot(path)
    data = pickle.loads(path.read_bytes())
    live, segments = {}, {}
    for event in data["device_traces"][0]:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = size
        elif action == "free_completed":
            del live[address]
        elif action == "segment_alloc":
            segments[address] = size
        elif action == "segment_free":
            del segments[address]
    assert segments == {s["address"]: s["total_size"] for s in data["segments"]}
    assert live == {b["address"]: b["size"] for s in data["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated"}


def test_the_viewer_plots_render(plan, tmp_path):
    path = tmp_path / "plan.pickle"
    plan.save_snapshot(path)
    for plot in ("trace_plot", "segment_plot"):
        html = tmp_path / f"{plot}.html"
        memory_viz(plot, str(path), "-o", str(html))
        assert "MemoryViz.js" in html.read_text()
    assert "free" in memory_viz("trace", str(path))


def test_a_cpu_probe_writes_its_tensors_alone_and_says_so(probe, tmp_path):
    path = tmp_path / "probe.pickle"
    said = probe.save_snapshot(path)
    assert "tensor events alone" in said
    data = pickle.loads(path.read_bytes())
    assert data["batchwidgets"]["caching_allocator"] is False
    assert "no caching allocator" in data["batchwidgets"]["said"]
    # each tensor its own segment: reserved is allocated, the tensors live at the step's peak
    total = _format_size(probe.memory_split.total_bytes)
    assert totals(path) == (total, total)
    assert probe.step_snapshot.batch_size == probe.memory_split.batch_size


def test_the_snapshot_stays_out_of_the_repr_and_a_remembered_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(tmp_path))
    first = bw.find_batch(mlp(), make_batch, loss_fn=torch.nn.functional.cross_entropy,
                          budget="2MiB", max_batch_size=64)
    assert first.step_snapshot is not None
    assert "StepSnapshot" not in repr(first)
    again = bw.find_batch(mlp(), make_batch, loss_fn=torch.nn.functional.cross_entropy,
                          budget="2MiB", max_batch_size=64)
    assert again.remembered is not None
    assert again == first
    with pytest.raises(ValueError, match="refresh=True"):
        again.save_snapshot(tmp_path / "none.pickle")


def test_the_probe_panel_links_the_snapshot_for_download(plan):
    import base64
    import html

    from batchwidgets.widgets.probe import ProbePanel

    details = ProbePanel(plan).details.value
    assert "Save snapshot" in details
    assert "https://pytorch.org/memory_viz" in details
    href = html.unescape(re.search(r'download="[^"]+" href="([^"]+)"', details).group(1))
    data = pickle.loads(base64.b64decode(href.split(",", 1)[1]))
    assert sum(s["total_size"] for s in data["segments"]) == plan.step_snapshot.reserved_bytes
