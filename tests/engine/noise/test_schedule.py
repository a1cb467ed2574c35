"""The batch-size schedule from the noise scale (issue 16): the rule on closed forms,
accumulate(steps="auto") against a hand-written loop with the same schedule, when not to
accumulate, and the sampling that keeps the tracker under its overhead target."""

import html
import math

import pytest
import torch
from _oracles import critical_report
from torch import nn

import batchwidgets as bw
from batchwidgets.engine.noise._schedule import CALIBRATION, UpdateSampler
from batchwidgets.results import (
    AccumulationReport,
    BatchSizeReport,
    accumulation_advice,
    lr_scale,
    plan_batch,
)


def exact_tracker(b_simple, micro=8, n_micro=4, updates=6, **options):
    """A tracker fed the exact expected norms of |G|^2 = 1 and tr(Sigma) = b_simple:
    E|g_b|^2 = |G|^2 + tr(Sigma)/b (McCandlish et al. 2018, A.1), so B_simple is exact."""
    tracker = bw.NoiseTracker(warmup_updates=2, **options)
    for _ in range(updates):
        tracker.update(small_sq_norms=[1 + b_simple / micro] * n_micro,
                       big_sq_norm=1 + b_simple / (micro * n_micro), micro_batch_size=micro,
                       n_micro=n_micro)
    return tracker


def test_the_schedule_follows_b_simple_on_a_closed_form():
    report = exact_tracker(64.0).report
    assert report.b_simple == pytest.approx(64.0)
    schedule = report.schedule
    # 64 samples = 8 micro-batches of 8; from 32 (4 x 8): eps ~ 1/(1 + 64/B): (1+2)/(1+1)
    assert (schedule.batch_size, schedule.steps, schedule.current_batch_size) == (64, 8, 32)
    assert schedule.lr_factor == pytest.approx(1.5)
    assert schedule.changes
    assert schedule.needs_accumulation
    # B_simple = 90: 90/8 = 11.25 micro-batches, nearest power of two in log space: 8 (not 16)
    assert exact_tracker(90.0).report.schedule.batch_size == 64
    assert exact_tracker(200.0).report.schedule.batch_size == 256


def test_the_schedule_is_bounded_by_the_user_and_says_what_fits():
    bounded = exact_tracker(64.0, max_batch_size=40).report.schedule
    assert (bounded.batch_size, bounded.steps) == (40, 5)
    assert "max_batch_size=40" in bounded.reason
    assert bounded.lr_factor == pytest.approx(lr_scale(64.0, 32, 40))
    probe = BatchSizeReport(max_batch_size=140, first_oom_batch_size=141, attempts=(),
                            device="cpu", budget_bytes=None)
    fits = exact_tracker(64.0, fits=probe).report.schedule  # recommends 126
    assert fits.fits_batch_size == probe.recommended_batch_size
    assert not fits.needs_accumulation
    assert "no accumulation needed" in fits.summary()
    assert exact_tracker(64.0, fits=32).report.schedule.needs_accumulation
    with pytest.raises(ValueError, match="max_batch_size should be"):
        bw.NoiseTracker(max_batch_size=0)
    with pytest.raises(ValueError, match="fits should be"):
        bw.NoiseTracker(fits="big")


def test_without_a_measurement_the_schedule_keeps_the_batch():
    report = bw.NoiseTracker().report
    schedule = report.schedule
    assert (schedule.batch_size, schedule.steps, schedule.lr_factor) == (1, 1, 1.0)
    assert "keep the batch" in schedule.reason
    assert plan_batch(None, None, micro_batch_size=16, steps=4).batch_size == 64


def test_well_above_b_simple_the_reports_say_not_to_accumulate():
    # B = 8 x 16 = 128 against B_simple = 16: 1.125 S_min steps for 9 E_min examples
    report = exact_tracker(16.0, micro=16, n_micro=8).report
    advice = report.accumulation_advice
    assert "does not pay" in advice
    assert "1.12× the fewest steps" in advice
    assert "9× the fewest examples" in advice
    assert advice in report.advice
    assert html.escape(advice) in report._repr_html_()  # escaped, as every value is
    assert report.schedule.steps == 1
    assert report.schedule.batch_size == 16
    # at the critical batch, nothing to say
    assert exact_tracker(32.0, micro=8, n_micro=4).report.accumulation_advice == ""
    assert accumulation_advice(16.0, 1.0, 16, 1) == ""  # no accumulation


def regression_data(n, seed=0, noise=3.0):
    generator = torch.Generator().manual_seed(seed)
    w_star = torch.randn(6, generator=generator, dtype=torch.float64)
    x = torch.randn(n, 6, generator=generator, dtype=torch.float64)
    return x, x @ w_star + noise * torch.randn(n, generator=generator, dtype=torch.float64)


def regression_model():
    torch.manual_seed(0)
    return nn.Linear(6, 1, bias=False).double()


def loss_of(model, x, y):
    return 0.5 * (model(x).squeeze(1) - y).pow(2).mean()


def test_steps_auto_equals_a_hand_written_loop_with_the_same_schedule():
    # B_simple grows as the loss falls (|G|^2 shrinks): 2 -> 4 -> 8 micro-batches of 4
    micro, n_micro_batches = 4, 1200
    x, y = regression_data(micro * n_micro_batches, noise=2.0)
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 / (1 + 0.01 * u))
    tracker = bw.NoiseTracker(ema=0.95, warmup_updates=5, overhead_target=None,
                              max_batch_size=32)
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker,
                       scheduler=scheduler) as acc:
        for j in range(n_micro_batches):
            loss_of(model, x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro]).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    report = acc.report
    assert report.auto
    assert report.schedule_changes, report
    assert all(c.steps_after > c.steps_before for c in report.schedule_changes)  # a ramp
    assert report.schedule_changes[-1].batch_size <= 32
    assert report.lr_factor == report.schedule_changes[-1].lr_factor
    assert len(report.schedule_changes) >= 2
    # the factor was on each step only: the scheduler's own learning rate is back
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 / (1 + 0.01 *
                                                            scheduler.last_epoch))
    # by hand: the same micro-batches per update and learning-rate factor, as recorded
    changes = {c.update: c for c in report.schedule_changes}
    reference = regression_model()
    hand = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.5)
    hand_scheduler = torch.optim.lr_scheduler.LambdaLR(hand, lambda u: 1 / (1 + 0.01 * u))
    steps, factor, j, updates = 2, 1.0, 0, 0
    while j < n_micro_batches:
        count = min(steps, n_micro_batches - j)
        for _ in range(count):
            (loss_of(reference, x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
             / count).backward()
            j += 1
        base = hand.param_groups[0]["lr"]
        hand.param_groups[0]["lr"] = base * factor
        hand.step()
        hand.param_groups[0]["lr"] = base
        hand.zero_grad()
        hand_scheduler.step()
        updates += 1
        if updates in changes:
            steps, factor = changes[updates].steps_after, changes[updates].lr_factor
    assert updates == report.real_steps
    assert torch.allclose(reference.weight, model.weight, rtol=0, atol=1e-12)
    # the recorded factor is the product of the rule's factors at each change
    product, before = 1.0, 2 * micro
    for change in report.schedule_changes:
        product *= lr_scale(change.b_simple, before, change.batch_size)
        before = change.batch_size
        assert change.lr_factor == pytest.approx(product)
    assert "update" in AccumulationReport._repr_html_(report)


def test_steps_auto_needs_a_tracker_and_restores_the_learning_rate_on_error():
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="steps='auto' follows a noise tracker"):
        bw.accumulate(optimizer, steps="auto")
    with pytest.raises(ValueError, match="not both"):
        bw.accumulate(optimizer, steps="auto", noise=bw.NoiseTracker(), batch_size=64,
                      micro_batch_size=8)
    with pytest.raises(ValueError, match="steps should be an int >= 1 or 'auto'"):
        bw.accumulate(optimizer, steps="often")
    x, y = regression_data(64)

    def train_then_fail():
        with bw.accumulate(optimizer, steps="auto", model=model, noise=bw.NoiseTracker()):
            for j in range(8):
                loss_of(model, x[j * 2:(j + 1) * 2], y[j * 2:(j + 1) * 2]).backward()
                optimizer.step()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train_then_fail()
    assert optimizer.param_groups[0]["lr"] == 0.1


class StepClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class TickingClock(StepClock):
    def __call__(self):
        self.now += 0.0005
        return self.now


def test_the_sampler_measures_one_update_in_k_from_the_measured_cost():
    clock = StepClock()
    sampler = UpdateSampler(0.02, clock=clock)
    sampler.start()
    measured = []
    for _ in range(CALIBRATION + 40):
        if sampler.measuring:  # the tracker's share: 10 ms on a 100 ms update (10%)
            started = clock()
            clock.now += 0.010
            sampler.charge(started)
        clock.now += 0.100
        measured.append(sampler.end_update())
    assert sampler.every == math.ceil(0.10 / 0.02)  # 5
    assert all(measured[:CALIBRATION - 1])  # the calibration measures every update
    tail = measured[CALIBRATION + 10:]
    assert sum(tail) == len(tail) // 5
    assert sampler.overhead == pytest.approx(0.02)
    assert UpdateSampler(None, clock=clock).every == 1


def test_sampling_skips_updates_but_keeps_every_loss_and_says_so():
    updates = CALIBRATION + 60
    x, y = regression_data(2 * 4 * updates)
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = bw.NoiseTracker(warmup_updates=2, overhead_target=0.02)
    clock = TickingClock()
    tracker.sampler = UpdateSampler(0.02, clock=clock)  # the tracker's cost, as a fake clock

    with bw.accumulate(optimizer, steps=4, model=model, noise=tracker):
        for j in range(4 * updates):
            loss_of(model, x[j * 2:(j + 1) * 2], y[j * 2:(j + 1) * 2]).backward()
            clock.now += 0.01  # every micro-step takes 10 ms
            optimizer.step()
            optimizer.zero_grad()
    report = tracker.report
    assert report.n_losses_seen == 4 * updates
    assert report.n_updates_seen == updates
    # each timed piece of the tracker's work reads the clock twice: 1 ms of "cost" each
    every = report.sample_every
    assert every > 1
    expected = CALIBRATION + (updates - CALIBRATION) // every
    assert expected - 1 <= report.n_updates <= expected + 1
    assert f"1 update in {every} to stay under 2%" in report.sampling
    assert "updates measured" in report._repr_html_()
    with pytest.raises(ValueError, match="overhead_target should be"):
        bw.NoiseTracker(overhead_target=2)


def test_the_noise_scale_plot_marks_the_schedule():
    from batchwidgets.plots import plot_noise_panel

    figure = plot_noise_panel(exact_tracker(64.0).report)
    labels = [t.get_text() for t in figure.axes[2].get_legend().get_texts()]
    assert "schedule from here 64" in labels
    assert "current batch 32" in labels


def test_a_measured_critical_batch_takes_b_simples_place_and_is_named():
    tracker = exact_tracker(64.0, critical=critical_report(250.0, 20.0))
    schedule = tracker.report.schedule
    assert schedule.source == "critical_batch"
    assert (schedule.batch_size, schedule.steps) == (256, 32)  # 250 / 8 -> 32 micro-batches
    assert schedule.lr_factor == pytest.approx(lr_scale(250.0, 32, 256))
    assert "measured critical batch ≈ 250 ± 20 samples" in schedule.summary()
    assert "the measured critical batch" in str(schedule.rows())
    report = tracker.report
    assert "Measured (critical_batch)" in report.advice
    assert "250 ± 20" in str(report.rows())
    # not measurable: B_simple again, and said
    tracker.critical = critical_report(None)
    assert tracker.report.schedule.source == "b_simple"
    assert tracker.report.schedule.batch_size == 64
    assert "B_simple ≈ 64" in tracker.report.schedule.summary()
    # before B_simple is measurable, the measured batch alone sets the schedule
    early = bw.NoiseTracker(critical=critical_report(100.0))
    early.update(small_sq_norms=[2.0, 2.0], big_sq_norm=1.5, micro_batch_size=8, n_micro=2)
    assert not early.report.measurable
    assert early.report.schedule.source == "critical_batch"
    assert early.report.schedule.batch_size == 128
    # sizes in micro-batches (micro-batch unknown): the measured samples cannot be used
    unknown = plan_batch(64.0, None, micro_batch_size=None, steps=2, critical_batch_size=250.0)
    assert unknown.source == "b_simple"
    assert "micro-batch size is unknown" in unknown.reason
    with pytest.raises(TypeError, match="critical should be a CriticalBatchReport"):
        bw.NoiseTracker(critical=250)


def test_steps_auto_ramps_to_a_critical_batch_measured_at_a_checkpoint():
    """A ramp from measurements: critical_batch at a checkpoint, set on the tracker, and
    accumulate(steps="auto") goes to it (and says it followed the measured number)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=generator)
    y = x @ torch.randn(16, 1, generator=generator) + torch.randn(4096, 1, generator=generator)
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    mse = nn.functional.mse_loss
    report = bw.critical_batch(model, torch.utils.data.TensorDataset(x, y), optimizer=optimizer,
                               loss_fn=mse, base_batch_size=4, noise=False)
    assert report.measurable, report.reason
    tracker = bw.NoiseTracker(warmup_updates=2, overhead_target=None, critical=report)
    micro = 4
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker) as acc:
        for j in range(400):
            mse(model(x[j * micro:(j + 1) * micro]), y[j * micro:(j + 1) * micro]).backward()
            optimizer.step()
            optimizer.zero_grad()
    change = acc.report.schedule_changes[0]
    assert change.source == "critical_batch"
    assert change.critical_batch_size == report.critical_batch_size
    expected = plan_batch(None, None, micro_batch_size=micro, steps=2, min_steps=2,
                          critical_batch_size=report.critical_batch_size)
    assert change.batch_size == expected.batch_size
    assert "measured critical batch" in str(acc.report.rows())
    # the factor no faster than the rate critical_batch found fastest (stable) at that batch
    assert change.lr_factor <= report.lr_scale_at(change.batch_size) + 1e-12
    assert change.lr_factor == pytest.approx(min(
        lr_scale(report.critical_batch_size, 2 * micro, change.batch_size),
        report.lr_scale_at(change.batch_size)))


def test_lr_scale_at_is_the_fastest_rate_of_the_rung_below_the_lowest_over_seeds():
    import dataclasses

    from batchwidgets.results import Branch

    ladder = (Branch(8, 0.1, 40, 320, False, 0, steps_to_target=39.5),
              Branch(8, 0.2, 30, 240, False, 0, steps_to_target=29.5),  # fastest at 8, seed 0
              Branch(8, 0.2, 33, 264, False, 1, steps_to_target=32.0),
              Branch(16, 0.4, None, None, True, 0),  # blew up: not a rate that reached
              Branch(16, 0.2, 14, 224, False, 0, steps_to_target=13.2),
              Branch(16, 0.4, 12, 192, False, 1, steps_to_target=11.9))
    report = dataclasses.replace(critical_report(12.0), ladder=ladder, optimizer_lr=0.1)
    assert report.lr_scale_at(8) == pytest.approx(2.0)
    assert report.lr_scale_at(12) == pytest.approx(2.0)  # the rung below
    assert report.lr_scale_at(64) == pytest.approx(2.0)  # 16: 0.2 (seed 0) and 0.4: the lower
    assert report.lr_scale_at(4) == pytest.approx(2.0)  # below the ladder: its first rung
    assert dataclasses.replace(report, optimizer_lr=None).lr_scale_at(8) is None


def test_a_critical_batch_past_the_ladder_bounds_b_simple():
    """Not measurable, but on one side of the ladder: "below 4" keeps a large B_simple from
    growing the batch, "above 512" lifts a small one."""
    import dataclasses

    below = dataclasses.replace(critical_report(None), bound="below", bound_batch_size=4.0)
    schedule = exact_tracker(64.0, critical=below).report.schedule
    assert schedule.source == "critical_batch_bound"
    assert schedule.batch_size == 8  # the micro-batch: B_simple 64 held to at most 4
    assert "critical batch below 4 samples" in schedule.reason
    above = dataclasses.replace(critical_report(None), bound="above", bound_batch_size=512.0)
    schedule = exact_tracker(64.0, critical=above).report.schedule
    assert (schedule.source, schedule.batch_size) == ("critical_batch_bound", 512)
    # within the bound, B_simple as it is
    lifted = exact_tracker(1024.0, critical=above).report.schedule
    assert lifted.batch_size == 1024
    assert "within it" in lifted.reason
    assert above.schedule_options() == {"critical_bound": ("above", 512.0)}
