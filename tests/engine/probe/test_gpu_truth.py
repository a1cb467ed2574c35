"""The GPU truth kit (benchmarks/gpu_truth.py): its dry run on the CPU, and the recorded truths
replayed: every plan the CPU makes today for a GPU capped as a recorded run was must lie within
3% (or one sample, where 3% is less) of the real boundary recorded there, and never above it."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _paths import ROOT

import batchwidgets as bw
from batchwidgets.engine.probe import _find_batch

BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_truth  # noqa: E402

TRUTHS = sorted(p for p in (BENCHMARKS / "results").glob("gpu_truth_*.json")
                if "dry_run" not in p.name)
BAND = 0.03

# NOTE [ Known gaps of the plans ]
# Each entry: a recorded truth the plan misses today, and why (what a CUDA kernel allocates
# that the plan's trace does not hold). They fail strictly: a fix that brings one in turns the
# test red until the entry goes.
KNOWN_GAPS = {
    ("encoder", "16GiB"): "the memory-efficient attention backward's fp32 accumulation "
    "workspace (2 x the queries' bytes, seen 395 MiB at 1,580) and LayerNorm's CUDA backward "
    "buffers are not in the plan's trace; they fragment the segments below the peak",
    ("wide CNN", "16GiB"): "cuDNN's algorithm choice at the edge (the boundary moved 641-643 "
    "between runs at 8 GiB): the plan's convolution workspaces are a rule of thumb",
    ("BERT-base classifier", "8GiB"): "at the true 42 the plan's tensors peak at 7.82 GiB "
    "allocated, the GPU's at 7.69 GiB (1.6% more, 41 then needs 8.11 GiB); the op that holds "
    "the difference is not traced yet (at 16 GiB the plan is within 3%)",
    ("Llama 125M bf16, checkpointed", "16GiB"): "the caching allocator's layout under the cap: "
    "at the true 18 the real step reserved 0.47 GiB beyond its allocated peak (its 4.5 GB "
    "float32 logits split by best fit), the plan's replay 0.24 GiB, so the plan fits 19 at "
    "15.96 GiB where the GPU ran out; the tensors agree within 0.5%",
    **dict.fromkeys(
        [("GPT-2 small", "8GiB", "keeps output"), ("GPT-2 small", "16GiB", "keeps output"),
         ("Llama 125M bf16, checkpointed", "8GiB", "keeps output")],
        "the H200 truth of this loop was recorded before issue 38, its output alive through the "
        "whole next iteration (one more logits tensor than the loop find_batch models): the "
        "next GPU run re-records it"),
}


def _truth_cases() -> list:
    cases = []
    for path in TRUTHS:
        data = json.loads(path.read_text())
        gpu = gpu_truth.target_name(data["device"])
        for record in data["records"]:
            if record["section"] != "boundaries" or not record.get("boundary"):
                continue
            if record["model"] not in gpu_truth.BY_NAME:
                continue
            # each loop's truth against the plan of that loop: the default (the output kept,
            # as the loop's variables keep it) and keep_output=False (freed before backward);
            # the classifiers' output is a few bytes, measured in the loop that keeps it
            loop = record.get("loop", "keeps output")
            gap = KNOWN_GAPS.get((record["model"], record["cap"], loop)) or KNOWN_GAPS.get(
                (record["model"], record["cap"]))
            marks = [pytest.mark.xfail(reason=gap, strict=True)] if gap else []
            cases.append(pytest.param(record["model"], gpu, record["cap"], loop,
                                      record["boundary"],
                                      id=f"{path.stem}-{record['model']}-{record['cap']}-{loop}",
                                      marks=marks))
    # a model's loops and caps side by side: each (model, GPU, loop) is traced once, then
    # planned under each cap (see warmed_once)
    order = {key: n for n, key in enumerate(dict.fromkeys(c.values[:2] + c.values[3:4]
                                                          for c in cases))}
    return sorted(cases, key=lambda c: order[c.values[:2] + c.values[3:4]])


# NOTE [ One trace per model and loop ]
# A plan is a function of the step's traces (probe/_find_batch.py: trials -> plan), and
# the traces of one model in one loop for one GPU do not depend on the cap (the trials run on
# fake tensors on the CPU; the cap is the memory the replay plans under). So each (model, GPU,
# loop) is traced once and find_batch plans it under each cap: the same call, the same pipeline
# and report, half the traces of full-size models on the CPU.
@pytest.fixture(scope="module")
def last() -> Iterator[dict]:
    """The last model warmed and its last traces, let go when the module's tests end."""
    held: dict = {}
    yield held
    held.clear()


@pytest.fixture
def warmed_once(monkeypatch, last):
    """``gpu_truth.warmed(spec)`` made once for a model's cases in a row, and find_batch's
    traces of it made once for each loop (NOTE [ One trace per model and loop ])."""
    trials = _find_batch.trials

    def once(setup):
        key = (id(setup.model), setup.target[0], setup.keep_output)
        if last.get("traced", (None,))[0] != key:
            last["traced"] = (key, *trials(setup))
        _, traced_setup, traced = last["traced"]
        assert traced_setup.model is setup.model
        assert traced_setup.optimizer is setup.optimizer
        return dataclasses.replace(traced_setup, request=setup.request,
                                   target=setup.target), traced

    monkeypatch.setattr(_find_batch, "trials", once)

    def warmed(name: str) -> tuple:
        if last.get("warmed", (None,))[0] != name:
            last.clear()  # the last model and its traces go before the next is built
            last["warmed"] = (name, *gpu_truth.warmed(gpu_truth.BY_NAME[name]))
        return last["warmed"][1:]

    return warmed


@pytest.mark.slow
@pytest.mark.parametrize(("name", "gpu", "cap", "loop", "truth"), _truth_cases())
def test_a_plan_lies_within_3_percent_below_the_recorded_gpu_boundary(name, gpu, cap, loop,
                                                                       truth, warmed_once):
    spec = gpu_truth.BY_NAME[name]
    model, optimizer = warmed_once(name)
    report = bw.find_batch(model, lambda n: spec.batch(n, False, "cpu"), loss_fn=spec.loss_fn,
                           optimizer=optimizer, target=f"{gpu}@{cap}",
                           keep_output=loop == "keeps output", cache=False)
    planned = report.max_batch_size
    assert planned <= truth, f"plan {planned} above the real boundary {truth}"
    assert planned >= truth - max(1, BAND * truth), f"plan {planned} too far below {truth}"


def test_the_truths_are_recorded_with_their_device_and_every_record_names_model_and_section():
    assert TRUTHS, "no benchmarks/results/gpu_truth_*.json: the first GPU run is still to come"
    for path in TRUTHS:
        data = json.loads(path.read_text())
        assert data["device"]
        assert not data["dry_run"]
        assert all(r["model"] and r["section"] in (*gpu_truth.SECTIONS, *gpu_truth.EXTRA,
                                                   "errors") for r in data["records"])


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    """One dry run of every section, the planned snapshot's too: the folder it wrote."""
    out = tmp_path_factory.mktemp("gpu_truth")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_truth.py"), "--dry-run",
                           "--only", ",".join((*gpu_truth.SECTIONS, "snapshots")),
                           "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT,
                          env={**os.environ, "BATCHWIDGETS_CACHE_DIR": str(out / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_dry_run_writes_every_section_on_the_cpu(dry_run):
    data = json.loads((dry_run / "gpu_truth_dry_run.json").read_text())
    sections = {r["section"] for r in data["records"]}
    assert sections >= set(gpu_truth.SECTIONS), sections
    errors = [r for r in data["records"] if "error" in r or r["section"] == "errors"]
    assert not errors, errors
    bounds = [r for r in data["records"] if r["section"] == "boundaries"]
    assert all(r.get("boundary") for r in bounds), [r for r in bounds if not r.get("boundary")]
    plans = {(r["model"], r["cap"], r["loop"]): r["max_batch_size"] for r in data["records"]
             if r["section"] == "plans"}
    # the budget meter stands in for the GPU: the CPU's plan of each loop is the meter's own
    # boundary for that loop
    for r in bounds:
        assert plans[(r["model"], r["cap"], r["loop"])] == r["boundary"], r
    assert (dry_run / "gpu_truth_dry_run.md").read_text().startswith("# GPU truth")
    # a one-rank DDP and FSDP2 job whose device runs out mid-backward trains afterwards exactly
    # as one that never met find_batch, and the answer is the device's edge
    forced = [r for r in data["records"] if r["model"] == gpu_truth.FORCED]
    assert sorted(r["form"] for r in forced) == ["DDP", "FSDP2"]
    assert all(r["trains_as_if_never_probed"] for r in forced), forced
    assert all(r["max_batch_size"] == r["device_edge"] for r in forced), forced


def test_a_capped_gpu_target_takes_that_gpus_rules_and_the_cap():
    x = torch.zeros(4)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters())
    capped = bw.find_batch(model, x, optimizer=optimizer, target="T4@2GiB")
    assert capped.target == "T4@2GiB"
    assert capped.limit_bytes == 2 * 2**30
    with pytest.raises(ValueError, match="target should cap a named GPU"):
        bw.find_batch(model, x, optimizer=optimizer, target="T4@40GiB")


def test_the_dry_run_writes_the_planned_snapshot_beside_its_record(dry_run):
    data = json.loads((dry_run / "gpu_truth_dry_run.json").read_text())
    (record,) = [r for r in data["records"] if r["section"] == "snapshots"]
    assert record["model"] == "wide CNN"
    assert record["batch_size"] > 0
    with open(dry_run / "gpu_truth_dry_run_planned_step.pickle", "rb") as file:
        snapshot = pickle.load(file)
    assert sum(s["total_size"] for s in snapshot["segments"]) == record[
        "planned_reserved_at_peak"]
