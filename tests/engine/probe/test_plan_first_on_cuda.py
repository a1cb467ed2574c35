"""On CUDA the probe's first guess is the plan for that very GPU (NOTE [ On CUDA, the plan for
this device first ] in engine/probe/_probe.py): the fake trace, kernel rules and allocator replay
of ``target=``, with the present GPU's workspaces, capped where the real steps are; then real
steps verify it. Without a GPU: on the simulated CUDA device, whose plan is its own rules, and
with the H200's recorded disagreement (a plan of 642 for a boundary of 641) replayed as an
emulated device that runs out one sample below the plan."""

from __future__ import annotations

import pytest
import torch
from _emulated_device import Device, make_batch
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine.memory import GPU_TARGETS
from batchwidgets.engine.memory._simulated import simulated_cuda
from batchwidgets.engine.memory._workspaces import gpu_workspaces, target_workspaces

BUDGET = "64MiB"  # activations in blocks over 10 MiB at the edge: memory grows with the batch


def net(device: Device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), device, nn.ReLU(),
                         nn.Linear(64, 4))


def probe(edge: int, where: str = "backward") -> bw.BatchSizeReport:
    model = net(Device(edge, where))
    with simulated_cuda():
        return bw.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                             optimizer=torch.optim.Adam(model.parameters()), budget=BUDGET,
                             cache=False)


def real(report: bw.BatchSizeReport) -> list:
    return [a for a in report.attempts if not a.fake]


@pytest.fixture(scope="module")
def planned() -> bw.BatchSizeReport:
    return probe(edge=10**9)  # a device that agrees with its plan


def test_the_real_steps_begin_at_the_plan_and_verify_it_in_two_sizes(planned):
    sizes = real(planned)
    assert [(a.batch_size, a.fits) for a in sizes] == [
        (planned.max_batch_size, True), (planned.max_batch_size + 1, False)]
    fake = [a.batch_size for a in planned.attempts if a.fake]
    assert fake[:2] == [2, 4]
    assert fake[-1] == planned.max_batch_size
    assert f"real steps began at {planned.max_batch_size}" in planned.method


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_boundary_one_sample_below_the_plan_costs_at_most_5_sizes_and_2_ooms(planned, where):
    """The H200's wide CNN: planned 642, its boundary 641 (gpu_truth_h200.md), where a first
    guess fitted on real sizes 2 and 4 said 671 and the search took 13 sizes, 7 of them OOMs."""
    edge = planned.max_batch_size - 1
    report = probe(edge, where)
    assert report.max_batch_size == edge
    assert report.first_oom_batch_size == edge + 1
    sizes = real(report)
    assert sizes[0].batch_size == planned.max_batch_size  # the plan, first
    assert len(sizes) <= 5, [a.batch_size for a in sizes]
    assert sum(not a.fits for a in sizes) <= 2, [a.batch_size for a in sizes]


def test_a_gpus_workspaces_are_the_named_targets_of_its_kind():
    """The present GPU's rules are built as a named target's are: an H200 (capability 9.0, 132
    SMs of 2,048 threads) as target='H200', an A100 (8.0, 108) as 'A100-80GB'."""
    assert "H200" in GPU_TARGETS
    assert gpu_workspaces(True, 132, 2048) == target_workspaces("H200")
    assert gpu_workspaces(False, 108, 2048) == target_workspaces("A100-80GB")
    assert gpu_workspaces(False, 40, 1024) == target_workspaces("T4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_first_real_size_is_the_plan_for_that_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    report = bw.find_batch(model, lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))),
                           loss_fn=F.cross_entropy, budget="2GiB", cache=False)
    assert "Planned first for this GPU" in report.method
    sizes = real(report)
    assert len(sizes) <= 5, report.method
    assert sum(not a.fits for a in sizes) <= 2, report.method
