"""The CUDA search without a GPU: find_batch on the simulated CUDA device (the caching
allocator's rules, cuBLAS and cuDNN-like workspaces, a real torch.OutOfMemoryError at the cap)
finds the device's boundary in a handful of sizes, predicting through the allocator's model."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _oracles import fits_on_a_fresh_device
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine.memory._allocator import GRID_BYTES
from batchwidgets.engine.memory._simulated import ProbeMeter, simulated_cuda
from batchwidgets.engine.memory._workspaces import Workspaces, target_workspaces

MIB = 2**20


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(ids)).mean(1))


def images(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))


def token_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (batch_size, 32)), torch.randint(0, 10, (batch_size,))


CASES = {
    "MLP": (mlp, images, 48 * MIB),
    "CNN with BatchNorm, cuDNN-like workspaces": (cnn, images, 64 * MIB),
    "transformer encoder": (Encoder, token_batch, 64 * MIB),
}


@pytest.mark.parametrize(("build", "make_batch", "budget"), CASES.values(), ids=CASES.keys())
def test_on_the_simulated_cuda_device_the_boundary_takes_a_handful_of_sizes(build, make_batch,
                                                                            budget):
    torch.manual_seed(0)
    model = build()
    with simulated_cuda():
        report = bw.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                               optimizer=torch.optim.Adam(model.parameters()), budget=budget)
    assert report.n_attempts <= 5
    assert report.n_ooms == 1
    assert "caching allocator" in report.method
    assert all(a.peak_reserved_bytes % (2 * MIB) == 0 for a in report.attempts if a.fits)
    largest = report.max_batch_size
    assert fits_on_a_fresh_device(build, make_batch, largest, budget)
    edge = largest + 1
    while fits_on_a_fresh_device(build, make_batch, edge, budget):  # the true edge, if above
        edge += 1
    assert largest >= 0.99 * (edge - 1)


def test_the_simulated_device_raises_a_real_cuda_out_of_memory_error_at_the_cap():
    meter = ProbeMeter("cpu", 8 * MIB, workspaces=Workspaces(cublas_bytes=0, conv_ratio=0.0))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"), \
            meter.measure(lambda: []):
        torch.empty(16 * MIB, dtype=torch.uint8)


def test_a_model_whose_memory_sits_in_workspaces_is_still_exact():
    """With large convolution workspaces (8x the input) what runs out is mostly workspace, which
    cuDNN sizes by the free memory: the probe still ends on a size that fits, one past it not."""
    torch.manual_seed(0)
    model = cnn()
    with simulated_cuda(Workspaces(conv_ratio=8.0)):
        report = bw.find_batch(model, images, loss_fn=F.cross_entropy,
                               optimizer=torch.optim.Adam(model.parameters()), budget=64 * MIB)
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert report.n_attempts <= 8


def test_the_user_state_is_unchanged_after_a_simulated_cuda_probe():
    torch.manual_seed(0)
    model = cnn()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = images(4)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    with simulated_cuda():
        bw.find_batch(model, images, loss_fn=F.cross_entropy, optimizer=optimizer,
                      budget=64 * MIB)
    after = (model.state_dict(), optimizer.state_dict())
    for key, value in before[0].items():
        assert torch.equal(value, after[0][key])
    for param, state in before[1]["state"].items():
        for key, value in state.items():
            now = after[1]["state"][param][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(now))


@pytest.mark.parametrize(("build", "make_batch", "budget"), CASES.values(), ids=CASES.keys())
def test_a_prediction_for_a_target_made_on_the_cpu_matches_the_simulated_devices_boundary(
        build, make_batch, budget):
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters())
    budget += 80 * MIB  # a target's cuBLAS workspaces: 2 x 32 MiB and cuBLASLt's 1 MiB
    target = f"{budget // MIB}MiB"
    planned = bw.find_batch(model, make_batch, loss_fn=F.cross_entropy, optimizer=optimizer,
                            target=target)
    assert planned.n_attempts == 2  # two small sizes traced, nothing near the edge run
    assert planned.stop_reason.startswith("predicted for")
    assert "predicted, not run" in planned.summary()
    # The device as the target's, run as a loop runs it (the allocator's layout settles by the
    # third step: NOTE [ The allocator's steady state ]), at the target's capacity and a grid
    # step above: a plan's size fits both (NOTE [ What a step needs ] in memory/_allocator.py;
    # the MLP's largest size fits 128 MiB at 7,168, 130 MiB only at 6,826, 132 MiB at 7,509).
    edges = []
    for capacity in (budget, budget + GRID_BYTES):
        with simulated_cuda(target_workspaces(target)):
            edges.append(bw.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                                       optimizer=optimizer, budget=capacity,
                                       steps_per_trial=3).max_batch_size)
    assert planned.max_batch_size <= min(edges)  # never above the real edge
    assert planned.max_batch_size >= 0.97 * min(edges)
    low, high = planned.target_band
    assert low <= planned.max_batch_size <= high


def test_named_targets_subtract_the_cuda_context_and_unknown_names_list_the_known_ones():
    torch.manual_seed(0)
    model = mlp()
    t4 = bw.find_batch(model, images, loss_fn=F.cross_entropy, target="t4")
    a100 = bw.find_batch(model, images, loss_fn=F.cross_entropy, target="A100 80GB")
    assert (t4.target, a100.target) == ("T4", "A100-80GB")
    assert 0 < t4.max_batch_size < a100.max_batch_size
    assert t4.limit_bytes < 15_095 * MIB
    with pytest.raises(ValueError, match="target should be one of T4, L4"):
        bw.find_batch(model, images, loss_fn=F.cross_entropy, target="TPU")


def test_on_cuda_the_what_if_rows_are_calibrated_and_expandable_segments_is_an_upper_bound():
    torch.manual_seed(0)
    model = cnn()
    with simulated_cuda():
        report = bw.find_batch(model, images, loss_fn=F.cross_entropy, budget=64 * MIB)
        sgd = bw.find_batch(model, images, loss_fn=F.cross_entropy, budget=64 * MIB,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rows = {row.name: row for row in report.what_if}
    predicted = rows["SGD without momentum (no optimizer state)"].max_batch_size
    assert abs(predicted - sgd.max_batch_size) <= 0.03 * sgd.max_batch_size
    assert rows["expandable_segments"].max_batch_size > report.max_batch_size
    assert not rows["expandable_segments"].measured


class Deepens(nn.Module):
    """One more layer for each doubling of the batch: no two sizes run the same ops."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(x.shape[0].bit_length()):
            x = self.layer(x)
        return x


def test_a_plan_whose_sizes_run_different_ops_says_so_after_a_few_small_sizes():
    model = Deepens()
    with pytest.raises(RuntimeError, match="could not trace two sizes of the same op sequence") \
            as raised:
        bw.find_batch(model, lambda n: (torch.randn(n, 8), torch.randn(n, 8)),
                      loss_fn=F.mse_loss, target="T4")
    tried = re.search(r"sizes tried: \[([\d, ]+)\]", str(raised.value)).group(1)
    assert max(int(size) for size in tried.split(", ")) <= 64  # not doubled on to the ceiling
