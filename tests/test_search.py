"""The search: exact boundaries with few sizes tried, for a pure out-of-memory threshold (gallop and
bisect) and for steps whose memory can be measured (predict, then verify), linear or not."""

from __future__ import annotations

import math

import pytest
import torch

import batchwidgets as bw
from batchwidgets.engine.probe._search import next_batch_size
from batchwidgets.results import Attempt, BatchSizeReport

MANY_BOUNDARIES = [*range(1, 301), 511, 512, 513, 1000, 4097, 65_535, 100_000, 1_234_567]


class ThresholdStep:
    """A training step that runs out of memory above ``largest`` samples and measures nothing."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.calls.append(batch_size)
        if batch_size > self.largest:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB.")


class AllocatingStep:
    """A step holding real tensors, so the CPU budget sees its memory: ``fixed_bytes`` plus
    ``per_sample_bytes`` a sample, rounded up to ``block_bytes`` (an allocator's rounding), plus
    ``jump_bytes`` above ``jump_after`` samples (a workspace that switches on), and a transient
    ``plateau_bytes`` buffer freed before the activations appear (an optimizer-like temporary that
    hides the per-sample growth at small sizes)."""

    def __init__(self, per_sample_bytes: int, fixed_bytes: int = 0, block_bytes: int = 1,
                 jump_bytes: int = 0, jump_after: int = 0, plateau_bytes: int = 0,
                 input_bytes: int = 0) -> None:
        self.per_sample_bytes, self.fixed_bytes, self.block_bytes = (per_sample_bytes, fixed_bytes,
                                                                     block_bytes)
        self.jump_bytes, self.jump_after = jump_bytes, jump_after
        self.plateau_bytes, self.input_bytes = plateau_bytes, input_bytes

    def _activation_bytes(self, batch_size: int) -> int:
        rounded = -(-batch_size * self.per_sample_bytes // self.block_bytes) * self.block_bytes
        return rounded + (self.jump_bytes if batch_size > self.jump_after else 0)

    def peak_bytes(self, batch_size: int) -> int:
        """What the step holds at its peak: the oracle for the boundary."""
        held = self.fixed_bytes + self.input_bytes * batch_size
        return held + max(self.plateau_bytes, self._activation_bytes(batch_size))

    def largest_that_fits(self, budget_bytes: int) -> int:
        lo, hi = 0, 1  # exponential then binary search on the oracle
        while self.peak_bytes(hi) <= budget_bytes:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak_bytes(mid) <= budget_bytes else (lo, mid)
        return lo

    def __call__(self, batch_size: int) -> None:
        fixed = torch.empty(self.fixed_bytes, dtype=torch.uint8)
        batch = torch.empty(self.input_bytes * batch_size, dtype=torch.uint8)
        temporary = torch.empty(self.plateau_bytes, dtype=torch.uint8)
        del temporary
        activations = torch.empty(self._activation_bytes(batch_size), dtype=torch.uint8)
        del fixed, batch, activations


def sizes_tried(report: BatchSizeReport) -> list[int]:
    return [a.batch_size for a in report.attempts]


def assert_reports_only_sizes_it_ran(report: BatchSizeReport) -> None:
    ran = {a.batch_size for a in report.attempts if a.fits}
    failed = {a.batch_size for a in report.attempts if not a.fits}
    assert report.max_batch_size == max(ran)
    assert report.first_oom_batch_size == (min(failed) if failed else None)
    assert report.recommended_batch_size <= report.max_batch_size
    assert len(ran | failed) == report.n_attempts  # no size tried twice


def policy_search(largest: int, multiple_of: int = 1) -> list[Attempt]:
    """The search policy alone, against a pure threshold: the attempts find_batch would make
    (it starts at 2, see NOTE [ Why the probe starts at 2 ])."""
    attempts: list[Attempt] = []
    while (size := next_batch_size(attempts, start=max(multiple_of, 2), multiple_of=multiple_of,
                                   ceiling=2**24, limit_bytes=None)) is not None:
        attempts.append(Attempt(size, size <= largest, 0, 0.01 if size <= largest else None))
    return attempts


@pytest.mark.parametrize(("largest", "expected"), [
    (1, [2, 1]),  # 2 does not fit: halve down to 1
    (5, [2, 4, 8, 6, 5]),
    (100, [2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]),
    (1000, [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 768, 896, 960, 992, 1008, 1000, 1004,
            1002, 1001]),
])
def test_with_nothing_to_measure_find_batch_gallops_then_bisects(largest, expected):
    step = ThresholdStep(largest)
    report = bw.find_batch(step, device="cpu")
    assert sizes_tried(report) == expected
    assert (report.max_batch_size, report.first_oom_batch_size) == (largest, largest + 1)
    assert report.stop_reason == "boundary"
    assert_reports_only_sizes_it_ran(report)


def test_a_step_that_leaves_nothing_behind_runs_once_per_size_and_an_oom_ends_its_trial():
    step = ThresholdStep(2)
    bw.find_batch(step, device="cpu", steps_per_trial=3)
    assert step.calls == [2, 4, 3]


class StatefulStep(ThresholdStep):
    """A bare step whose optimizer makes its state on the first call (as Adam does): that state
    is held from then on, so only the first call at the first size leaves memory behind."""

    def __init__(self, largest: int) -> None:
        super().__init__(largest)
        self.state: list[torch.Tensor] = []

    def __call__(self, batch_size: int) -> None:
        super().__call__(batch_size)
        if not self.state:
            self.state.append(torch.zeros(1024))


def test_a_step_that_leaves_state_behind_runs_again_at_that_size_only():
    step = StatefulStep(2)
    bw.find_batch(step, device="cpu", steps_per_trial=3)
    assert step.calls == [2, 2, 4, 3]


def test_search_policy_finds_the_exact_boundary_in_at_most_two_log2_sizes():
    wrong = {}
    for largest in MANY_BOUNDARIES:
        attempts = policy_search(largest)
        sizes = [a.batch_size for a in attempts]
        ran = [a.batch_size for a in attempts if a.fits]
        failed = [a.batch_size for a in attempts if not a.fits]
        if ((max(ran), min(failed)) != (largest, largest + 1) or len(set(sizes)) != len(sizes)
                or len(attempts) > 2 * math.log2(largest) + 2):
            wrong[largest] = sizes
    assert wrong == {}


@pytest.mark.parametrize("largest", [7, 300])
def test_find_batch_tries_what_the_search_policy_says(largest):
    report = bw.find_batch(ThresholdStep(largest), device="cpu", steps_per_trial=1)
    assert sizes_tried(report) == [a.batch_size for a in policy_search(largest)]


@pytest.mark.parametrize(("largest", "multiple_of", "expected_max"), [
    (100, 8, 96), (7, 8, None), (64, 8, 64), (1000, 24, 984), (5, 2, 4)])
def test_every_size_tried_is_a_multiple_of_multiple_of(largest, multiple_of, expected_max):
    step = ThresholdStep(largest)
    if expected_max is None:
        with pytest.raises(bw.NoBatchSizeFits) as info:
            bw.find_batch(step, device="cpu", multiple_of=multiple_of, steps_per_trial=1)
        assert sizes_tried(info.value.report) == [multiple_of]
        return
    report = bw.find_batch(step, device="cpu", multiple_of=multiple_of, steps_per_trial=1)
    assert all(size % multiple_of == 0 for size in sizes_tried(report))
    assert (report.max_batch_size, report.first_oom_batch_size) == (expected_max,
                                                                    expected_max + multiple_of)
    assert report.recommended_batch_size % multiple_of == 0


@pytest.mark.parametrize(("max_batch_size", "multiple_of", "expected"), [
    (100, 1, 100), (100, 8, 96), (64, 1, 64), (1, 1, 1)])
def test_find_batch_never_tries_more_than_max_batch_size(max_batch_size, multiple_of, expected):
    report = bw.find_batch(ThresholdStep(10**6), device="cpu", max_batch_size=max_batch_size,
                           multiple_of=multiple_of, steps_per_trial=1)
    assert max(sizes_tried(report)) == expected
    assert (report.max_batch_size, report.first_oom_batch_size) == (expected, None)
    assert report.stop_reason == "max_batch_size"


def test_max_batch_size_above_the_boundary_still_stops_at_the_boundary():
    report = bw.find_batch(ThresholdStep(37), device="cpu", max_batch_size=50, steps_per_trial=1)
    assert (report.max_batch_size, report.first_oom_batch_size) == (37, 38)
    assert report.stop_reason == "boundary"
    assert max(sizes_tried(report)) <= 50


def test_without_any_oom_the_search_stops_at_its_ceiling():
    report = bw.find_batch(ThresholdStep(2**30), device="cpu", steps_per_trial=1)
    assert sizes_tried(report) == [2**k for k in range(1, 25)]
    assert report.max_batch_size == 2**24
    assert report.stop_reason.startswith("ceiling")


@pytest.mark.parametrize(("start", "largest", "expected"), [
    (16, 37, [16, 32, 64, 48, 40, 36, 38, 37]),
    (16, 5, [16, 8, 4, 6, 5]),  # too large a start: halve until something runs
])
def test_start_sets_the_first_size_tried(start, largest, expected):
    report = bw.find_batch(ThresholdStep(largest), device="cpu", start=start, steps_per_trial=1)
    assert sizes_tried(report) == expected
    assert report.max_batch_size == largest


# Memory the CPU budget can measure: (step, budget in bytes). Boundaries between ~100 and ~5000.
LINEAR_STEPS = {
    "per-sample only": (AllocatingStep(per_sample_bytes=1000), 2**20),
    "fixed plus per-sample": (AllocatingStep(per_sample_bytes=1000, fixed_bytes=100_000), 2**20),
    "large samples": (AllocatingStep(per_sample_bytes=3 * 2**12, fixed_bytes=50_000), 4 * 2**20),
    "input plus activations": (AllocatingStep(per_sample_bytes=700, input_bytes=96,
                                              fixed_bytes=20_000), 2**20),
}


@pytest.mark.parametrize(("step", "budget"), LINEAR_STEPS.values(), ids=LINEAR_STEPS.keys())
def test_with_linear_memory_find_batch_predicts_the_exact_boundary_in_a_handful(step, budget):
    report = bw.find_batch(step, device="cpu", budget=budget)
    expected = step.largest_that_fits(budget)
    assert (report.max_batch_size, report.first_oom_batch_size) == (expected, expected + 1)
    # 1, 2, 16, 128, 1024 (memory measured, jumps of at most 8x), the prediction, one past it
    assert report.n_attempts <= 7
    assert report.memory_model.per_sample_bytes == step.per_sample_bytes + step.input_bytes
    assert report.memory_model.fixed_bytes == step.fixed_bytes
    assert_reports_only_sizes_it_ran(report)


def test_a_plateau_at_small_sizes_does_not_send_the_search_far_past_the_boundary():
    # At small sizes the peak is the transient buffer plus the input: three small sizes agree on
    # the input's slope (136 bytes a sample) though the step really grows by 1036 a sample.
    step = AllocatingStep(per_sample_bytes=900, input_bytes=136, plateau_bytes=40_000)
    budget = 2**20
    report = bw.find_batch(step, device="cpu", budget=budget)
    expected = step.largest_that_fits(budget)
    assert (report.max_batch_size, report.first_oom_batch_size) == (expected, expected + 1)
    assert report.n_attempts <= 9
    assert report.n_ooms <= 2
    assert max(sizes_tried(report)) <= 8 * expected


NONLINEAR_STEPS = {
    "rounded to 4 KiB blocks": (AllocatingStep(per_sample_bytes=333, fixed_bytes=12_345,
                                               block_bytes=4096), 3 * 2**20),
    "rounded to 64 KiB blocks": (AllocatingStep(per_sample_bytes=1000, block_bytes=2**16), 2**20),
    "workspace switching on": (AllocatingStep(per_sample_bytes=3000, fixed_bytes=10**6,
                                              jump_bytes=500_000, jump_after=700), 4 * 2**20),
    "workspace below the boundary": (AllocatingStep(per_sample_bytes=3000, fixed_bytes=10**6,
                                                    jump_bytes=200_000, jump_after=100),
                                     4 * 2**20),
}


@pytest.mark.parametrize(("step", "budget"), NONLINEAR_STEPS.values(), ids=NONLINEAR_STEPS.keys())
def test_with_nonlinear_memory_find_batch_still_finds_the_exact_boundary(step, budget):
    report = bw.find_batch(step, device="cpu", budget=budget, steps_per_trial=1)
    expected = step.largest_that_fits(budget)
    assert (report.max_batch_size, report.first_oom_batch_size) == (expected, expected + 1)
    assert report.n_attempts <= 2 * math.log2(expected) + 2  # no worse than bisection
    assert_reports_only_sizes_it_ran(report)


def test_with_measured_memory_multiple_of_and_max_batch_size_hold():
    step = AllocatingStep(per_sample_bytes=1000, fixed_bytes=100_000)
    report = bw.find_batch(step, device="cpu", budget=2**20, multiple_of=8, steps_per_trial=1)
    assert all(size % 8 == 0 for size in sizes_tried(report))
    assert report.max_batch_size == step.largest_that_fits(2**20) // 8 * 8
    assert report.first_oom_batch_size == report.max_batch_size + 8
    capped = bw.find_batch(step, device="cpu", budget=2**20, max_batch_size=200,
                           steps_per_trial=1)
    assert max(sizes_tried(capped)) == capped.max_batch_size == 200
    assert capped.stop_reason == "max_batch_size"
