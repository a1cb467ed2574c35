"""Plans for N ranks from one process (``find_batch(..., target="NxCPU", parallel=...)``, issue
25) against the per-rank boundary that real gloo jobs find under the same per-rank budget: DDP,
FSDP2 and ZeRO-1 (ZeroRedundancyOptimizer), each within 2%. The jobs are
benchmarks/distributed_plans.py's harness: one 2-process job runs four cases in turn and one
4-process job two, each started once for all the checks."""

from __future__ import annotations

import importlib
import sys

import pytest
from _paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
# (model, strategy, ranks): the MLP under every strategy on 2 ranks and two on 4 (ZeRO-1's
# shards are whole parameters, uneven by rank), and the transformer encoder under FSDP2
CASES = [("mlp", "ddp", 2), ("mlp", "fsdp", 2), ("mlp", "zero1", 2), ("encoder", "fsdp", 2),
         ("mlp", "zero1", 4), ("mlp", "fsdp", 4)]


@pytest.fixture(scope="module")
def harness():
    """benchmarks/distributed_plans.py, importable by name in the ranks it spawns (a spawned
    process takes its parent's sys.path) while this module's tests run."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("distributed_plans")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def real(harness) -> dict:
    """Each case's real boundary, from one job per world size."""
    found = {}
    for world_size in sorted({ranks for *_, ranks in CASES}):
        cases = [harness.Case(model, strategy, harness.WORKLOADS[model].budget)
                 for model, strategy, ranks in CASES if ranks == world_size]
        for boundary in harness.real_boundaries(cases, world_size, timeout_s=240)[0]:
            found[boundary.case.model, boundary.case.strategy, world_size] = boundary
    return found


@pytest.mark.slow
def test_every_rank_of_a_real_job_finds_one_boundary_in_the_hundreds(real):
    # real_boundaries raises if the ranks disagree; a boundary in the hundreds makes 2% a few
    # samples, and the strategies' differences (10-20% here) far more than that
    for case, boundary in real.items():
        assert boundary.error is None, (case, boundary.error)
        assert boundary.held >= 200, (case, boundary.held)


@pytest.mark.slow
def test_find_batch_in_a_job_counts_what_each_rank_holds_and_restores_it(real):
    # The plans are checked against what the ranks really hold (``held``: NOTE [ What the probe
    # inside a job does not see ] in the harness): find_batch in the job should find it itself,
    # DDP's gradient buckets and ZeroRedundancyOptimizer's shard of the state counted, and put
    # that state back as it found it.
    for case, boundary in real.items():
        assert boundary.probed == boundary.held, (case, [r["unseen_bytes"] for r in boundary.ranks])
        assert [rank["restored"] for rank in boundary.ranks] == [True] * case[2], case


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "ranks"), CASES,
                         ids=[f"{m}-{s}-{n}" for m, s, n in CASES])
def test_one_process_plan_is_within_2_percent_of_the_real_jobs_per_rank_boundary(
        harness, real, model, strategy, ranks):
    boundary = real[model, strategy, ranks]
    plan = harness.plan_report(boundary.case, ranks).max_batch_size
    assert abs(plan - boundary.held) <= 0.02 * boundary.held, (
        f"plan {plan} against {boundary.held} per rank (find_batch in the job: "
        f"{boundary.probed})")
