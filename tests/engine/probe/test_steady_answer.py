"""A measured answer holds in the loop's steady state (NOTE [ A size holds when the allocator's
layout repeats ] in engine/probe/_trials.py): on a caching allocator a size can fit two steps and
run out at the third, as the H200's wide CNN fitted 644 in the probe and 641 in a longer run
(benchmarks/results/gpu_truth_h200.md). Replayed on the simulated CUDA device by a layer whose
step holds more each step until the third, as a layout that settles late does."""

from __future__ import annotations

import pytest
import torch
from _oracles import fits_on_a_fresh_device
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine.memory import STEADY_STEPS
from batchwidgets.engine.memory._simulated import simulated_cuda

BUDGET = 64 * 2**20
PER_SAMPLE = 1024  # bytes a sample the layer holds through backward, times its step (to 3)


class _Hold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, held):
        ctx.held = held  # alive until backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SettlesLate(nn.Module):
    """Holds ``PER_SAMPLE * min(step, 3)`` bytes a sample through backward: each of the first
    three steps of a loop needs a larger block than the last left cached. The step count is a
    buffer, so each trial of the probe starts again from the user's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        held = torch.empty(len(x) * PER_SAMPLE * min(int(self.steps), 3), dtype=torch.uint8)
        return _Hold.apply(x, held)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), SettlesLate(), nn.Linear(64, 4))


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def fits(batch_size: int, steps: int) -> bool:
    """The oracle: ``steps`` steps of the loop on a fresh simulated device, as the probe's."""
    return fits_on_a_fresh_device(build, make_batch, batch_size, BUDGET, steps=steps)


@pytest.fixture(scope="module")
def report() -> bw.BatchSizeReport:
    model = build()
    with simulated_cuda():
        return bw.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                             optimizer=torch.optim.Adam(model.parameters()), budget=BUDGET,
                             keep_output=False, trace="real", cache=False)


def test_the_answer_fits_the_steady_state_and_the_next_size_does_not(report):
    largest = report.max_batch_size
    assert fits(largest, steps=STEADY_STEPS)
    assert not fits(largest + 1, steps=STEADY_STEPS)


def test_two_steps_alone_would_have_answered_above_the_steady_boundary(report):
    """What the probe answered before the rule: a size past its answer fits two steps."""
    past = report.first_oom_batch_size
    assert fits(past, steps=2)
    assert not fits(past, steps=STEADY_STEPS)


def test_the_model_trains_after_the_probe_as_before():
    model = build()
    before = [t.clone() for t in model.state_dict().values()]
    with simulated_cuda():
        bw.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                      optimizer=torch.optim.Adam(model.parameters()), budget=BUDGET,
                      keep_output=False, trace="real", cache=False, max_batch_size=64)
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
