"""NoiseTracker: the online two-batch-size estimate of the gradient noise scale must match the
closed form of linear regression with Gaussian inputs and noise, and say "not measurable"
instead of giving negative or wild values."""

import math

import pytest
import torch
from torch import nn

import batchwidgets as bw
from batchwidgets._warnings import BatchwidgetsWarning
from batchwidgets.results import NoiseTrackerReport

D, SIGMA, MICRO, STEPS = 4, 0.5, 8, 4  # dimensions, label noise, micro-batch, micro-steps


def regression_run(delta, tracker, updates=300, seed=0):
    """Linear regression y = w*.x + SIGMA*eps at weights w* + delta, with lr=0 so they stay.

    Per-example gradient of 0.5*(w.x - y)^2: g = x (x.delta - SIGMA*eps), so G = delta and, for
    x ~ N(0, I), tr(Sigma) = (d+1)|delta|^2 + d*SIGMA^2.
    """
    generator = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=generator, dtype=torch.float64)
    model = nn.Linear(D, 1, bias=False).to(torch.float64)
    with torch.no_grad():
        model.weight.copy_((w_star + delta).unsqueeze(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    losses = []
    with bw.accumulate(optimizer, steps=STEPS, model=model, noise=tracker) as acc:
        for _ in range(updates * STEPS):
            x = torch.randn(MICRO, D, generator=generator, dtype=torch.float64)
            eps = torch.randn(MICRO, generator=generator, dtype=torch.float64)
            y = x @ w_star + SIGMA * eps
            loss = 0.5 * (model(x).squeeze(1) - y).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    return losses, acc


def test_tracker_matches_the_closed_form_of_linear_regression():
    # 300 updates of 4 micro-batches of 8 fresh samples, seed 0, ema=0.99 (~200 updates averaged)
    delta = torch.tensor([1.0, -0.5, 0.5, 0.0], dtype=torch.float64)
    tracker = bw.NoiseTracker(ema=0.99, warmup_updates=5)
    regression_run(delta, tracker)
    report = tracker.report
    grad_norm_sq = float(delta @ delta)
    trace_cov = (D + 1) * grad_norm_sq + D * SIGMA**2
    assert report.measurable, report.reason
    assert report.n_updates == 300
    assert report.micro_batch_size == MICRO
    assert report.effective_batch_size == MICRO * STEPS
    assert report.grad_norm_sq == pytest.approx(grad_norm_sq, rel=0.10)
    assert report.trace_cov == pytest.approx(trace_cov, rel=0.10)
    assert report.b_simple == pytest.approx(trace_cov / grad_norm_sq, rel=0.15)
    assert 0 < report.b_simple_error < 0.5 * report.b_simple
    assert "critical batch size" in report.advice
    assert "Goyal et al. 2017" in report.advice


def test_losses_recorded_equal_the_micro_batch_losses():
    tracker = bw.NoiseTracker()
    losses, acc = regression_run(torch.ones(D, dtype=torch.float64), tracker, updates=10)
    assert tracker.report.losses == pytest.approx(losses)
    assert acc.report.losses == pytest.approx(losses)
    window = losses[-100:]
    assert tracker.report.loss_mean == pytest.approx(sum(window) / len(window))


def test_not_measurable_before_the_warmup_updates():
    tracker = bw.NoiseTracker(warmup_updates=5)
    regression_run(torch.ones(D, dtype=torch.float64), tracker, updates=4)
    report = tracker.report
    assert not report.measurable
    assert report.b_simple is None
    assert report.b_simple_error is None
    assert "4 of 5 warm-up updates" in report.reason
    assert all(b is None for _, b, _, _ in report.history)


def test_a_vanishing_gradient_is_not_measurable_and_never_negative():
    tracker = bw.NoiseTracker(ema=0.9, warmup_updates=5)
    regression_run(torch.zeros(D, dtype=torch.float64), tracker, updates=100)
    report = tracker.report
    assert not report.measurable
    assert report.b_simple is None
    assert "|G|^2" in report.reason
    assert all(b is None or 0 < b < math.inf for _, b, _, _ in report.history)
    assert "not measurable" in report.advice


def test_without_micro_batches_the_noise_scale_is_not_measured():
    tracker = bw.NoiseTracker()
    for loss in (3.0, 2.0, 1.0):
        tracker.observe_loss(torch.tensor(loss))
    report = tracker.report
    assert report.losses == (3.0, 2.0, 1.0)
    assert report.loss_std == pytest.approx(1.0)
    assert not report.measurable
    assert "noise=tracker to accumulate(steps>=2)" in report.reason
    assert report.grad_norm_sq is None


def test_estimator_on_exact_expectations():
    # E|G_B|^2 = |G|^2 + trS/B with |G|^2 = 1, trS = 6: micro (B=8) 1.75, big (B=32) 1.1875
    tracker = bw.NoiseTracker(ema=0.5, warmup_updates=3)
    for _ in range(3):
        tracker.update(small_sq_norms=[1.5, 2.0], big_sq_norm=1.375, micro_batch_size=8,
                       n_micro=2)
    report = tracker.report
    assert report.grad_norm_sq == pytest.approx(1.0)
    assert report.trace_cov == pytest.approx(6.0)
    assert report.b_simple == pytest.approx(6.0)
    assert report.b_simple_error == pytest.approx(0.0, abs=1e-9)


def test_unknown_micro_batch_size_counts_in_micro_batches():
    tracker = bw.NoiseTracker(warmup_updates=1)
    for _ in range(3):
        tracker.update(small_sq_norms=[1.5, 2.0], big_sq_norm=1.375, micro_batch_size=None,
                       n_micro=2)
    report = tracker.report
    assert report.micro_batch_size is None
    assert report.unit == "micro-batches"
    assert "pass model=" in report.advice


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="ema"):
        bw.NoiseTracker(ema=1.0)
    with pytest.raises(ValueError, match="warmup_updates"):
        bw.NoiseTracker(warmup_updates=0)
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="noise"):
        bw.accumulate(torch.optim.SGD(model.parameters(), lr=0.1), noise="yes")


def test_report_renders_escaped_html():
    report = bw.NoiseTracker().report
    assert isinstance(report, NoiseTrackerReport)
    assert "<table" in report._repr_html_()


def scaled_clipped_run(scale, clip):
    """Eight updates of 4 micro-batches; returns the tracker's history."""
    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    model = nn.Linear(D, 1).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
              if scale else None)
    tracker = bw.NoiseTracker(warmup_updates=1)
    with bw.accumulate(optimizer, steps=STEPS, model=model, scaler=scaler, noise=tracker) as acc:
        for _ in range(8 * STEPS):
            x = torch.randn(MICRO, D, generator=generator, dtype=torch.float64)
            loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                if acc.is_sync_step:
                    scaler.unscale_(optimizer)
            if clip:
                acc.clip_grad_norm_(1e-3)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
    return tracker.report.history


def test_grad_scaler_and_clipping_do_not_change_the_estimates():
    plain = scaled_clipped_run(scale=False, clip=False)
    assert len(plain) == 8
    for other in (scaled_clipped_run(scale=True, clip=False),
                  scaled_clipped_run(scale=False, clip=True),
                  scaled_clipped_run(scale=True, clip=True)):
        assert [h[0] for h in other] == [h[0] for h in plain]
        assert [v for h in other for v in h[2:]] == pytest.approx(
            [v for h in plain for v in h[2:]], rel=1e-6)


def test_listeners_hear_every_loss_and_update_and_a_broken_one_is_dropped_with_a_warning():
    tracker = bw.NoiseTracker(warmup_updates=1)
    heard = []
    tracker.add_listener(lambda t: heard.append(t.report.n_updates))

    def broken(_tracker):
        raise RuntimeError("display gone")

    tracker.add_listener(broken)
    with pytest.warns(BatchwidgetsWarning, match="display gone"):
        tracker.observe_loss(1.0)
    tracker.update(small_sq_norms=[1.75, 1.8], big_sq_norm=1.2, micro_batch_size=8, n_micro=2)
    tracker.observe_loss(0.5)
    assert heard == [0, 1, 1]
    tracker.remove_listener(broken)  # already gone: no error
