"""find_batch when the device runs out of memory where the meter saw room (issue 44, item 3): the
emulated device raises torch.cuda.OutOfMemoryError in forward or in backward above T while the
budget allows far more; after the miss the search tries at most
min(ceil(log2(miss - lo)) + 2, 2 ceil(log2(miss - T + 1)) + 2) sizes, at most half of them plus
one out of memory, and answers T exactly. The steps hold untouched buffers (the meter counts
them; no page is written) and compute on a few samples, so sizes of millions cost nothing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.results import BatchSizeReport

SAMPLE_BYTES = 64 * 1024  # the meter sees this much a sample
PREDICTED = 3000  # the budget lets the meter predict this many samples
BUDGET = PREDICTED * SAMPLE_BYTES + 2**19


def _oom(batch_size: int) -> torch.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB")


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fails: bool) -> torch.Tensor:
        ctx.fails = fails
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        if ctx.fails:
            raise _oom(-1)
        return grad, None


class EmulatedDevice(nn.Module):
    """Holds SAMPLE_BYTES a sample through backward, as the meter counts; its real steps run out
    of memory above ``largest`` samples, in ``where`` (forward or backward): a device that
    disagrees with the meter by any factor. Fake traces see the buffer only."""

    def __init__(self, largest: int, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(8, 4)
        self.largest, self.where = largest, where
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        real = not isinstance(x, FakeTensor)
        if real:
            self.sizes.append(n)
        fails = real and n > self.largest
        if fails and self.where == "forward":
            raise _oom(n)
        held = torch.empty(n * SAMPLE_BYTES, dtype=torch.uint8).view(torch.float32)
        out = self.head(x[:4]) + (held[:1].zero_() * self.head.bias[:1]).sum()
        return _FailsInBackward.apply(out, fails) if self.where == "backward" else out


def rows(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``batch_size`` rows that costs four (the model computes on four)."""
    x = torch.randn(1, 8).expand(batch_size, 8)
    return x, torch.randint(0, 4, (min(batch_size, 4),))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def bound(lo: int, miss: int, largest: int) -> int:
    return min(math.ceil(math.log2(miss - lo)) + 2,
               2 * math.ceil(math.log2(miss - largest + 1)) + 2)


def after_the_miss(report: BatchSizeReport) -> tuple[int, int, int, int]:
    """(lo, miss, sizes after it, OOMs after it) over the real sizes."""
    real = [a for a in report.attempts if not a.fake]
    i = next(i for i, a in enumerate(real) if not a.fits)
    lo = max((a.batch_size for a in real[:i] if a.fits), default=0)
    after = real[i + 1:]
    return lo, real[i].batch_size, len(after), sum(not a.fits for a in after)


def assert_exact_within_the_bound(report: BatchSizeReport, largest: int) -> None:
    assert report.max_batch_size == largest
    assert report.first_oom_batch_size == largest + 1
    sizes = [a.batch_size for a in report.attempts if not a.fake]
    assert len(set(sizes)) == len(sizes)
    lo, miss, n, ooms = after_the_miss(report)
    assert n <= bound(lo, miss, largest), sizes
    assert ooms <= n // 2 + 1, sizes


MISSES = {"1 sample": PREDICTED - 1, "2%": PREDICTED * 98 // 100, "50%": PREDICTED // 2,
          "99.9%": PREDICTED // 1000}


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("largest", MISSES.values(), ids=MISSES.keys())
def test_a_device_that_disagrees_costs_what_the_meter_got_wrong(largest, where):
    model = EmulatedDevice(largest, where)
    report = bw.find_batch(model, rows, loss_fn=loss_fn, budget=BUDGET,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert_exact_within_the_bound(report, largest)
    assert max(model.sizes) == model.sizes[0] <= PREDICTED + 8  # nothing past the meter's edge


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_real_steps_from_size_2_after_a_far_miss_bisect(where):
    model = EmulatedDevice(PREDICTED // 1000, where)
    report = bw.find_batch(model, rows, loss_fn=loss_fn, budget=BUDGET, trace="real",
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert_exact_within_the_bound(report, PREDICTED // 1000)
    assert [a.batch_size for a in report.attempts[:2]] == [2, 4]


class Step:
    """A bare step(batch_size) whose meter sees ``sample_bytes`` a sample (an untouched buffer)
    and whose device runs out of memory above ``largest``, computing on a few samples."""

    def __init__(self, largest: int, sample_bytes: int = 1) -> None:
        self.largest, self.sample_bytes = largest, sample_bytes
        self.sizes: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.sizes.append(batch_size)
        held = torch.empty(batch_size * self.sample_bytes, dtype=torch.uint8)
        torch.ones(8, 8).sum()
        if batch_size > self.largest:
            raise _oom(batch_size)
        del held


def test_a_step_predicted_at_millions_whose_truth_is_6_costs_a_bisection():
    step = Step(largest=6)
    report = bw.find_batch(step, device="cpu", budget=3_000_000, steps_per_trial=1)
    lo, miss, n, _ = after_the_miss(report)
    assert miss > 2_000_000  # the meter's edge, far off
    assert_exact_within_the_bound(report, 6)
    assert n <= math.ceil(math.log2(miss - lo)) + 2  # 6 here; 41 sizes on d14885a


def test_a_meter_two_samples_high_costs_two_sizes_past_one_that_refits():
    # the device counts 0.1% more than the meter: the meter says 1,603, the device 1,601
    step = Step(largest=1601, sample_bytes=1000)
    report = bw.find_batch(step, device="cpu", budget=1604 * 1000 - 500, steps_per_trial=3)
    real = [a.batch_size for a in report.attempts if not a.fake]
    assert real[:3] == [2, 4, 1603]
    assert_exact_within_the_bound(report, 1601)
    assert len(real) <= 6  # 2, 4, 1603x, 993, 1601, 1602x; 7 sizes on d14885a
    assert report.n_ooms == 2
