"""critical_batch (issue 27): the critical batch measured by its definition, from branched runs
on a noisy linear regression, with the user's model, optimizer and RNGs as they were."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import batchwidgets as bw


def regression(n: int = 4096, dim: int = 16, noise: float = 1.0) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=generator)
    w = torch.randn(dim, 1, generator=generator)
    return TensorDataset(x, x @ w + noise * torch.randn(n, 1, generator=generator))


def model_and_sgd(lr: float, momentum: float = 0.0):
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def test_the_critical_batch_is_measured_and_everything_is_put_back():
    model, optimizer = model_and_sgd(0.1, momentum=0.5)
    data = regression()
    nn.functional.mse_loss(model(data.tensors[0][:8]), data.tensors[1][:8]).backward()
    optimizer.step()  # momentum buffers to put back
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [s["momentum_buffer"].clone() for s in optimizer.state.values()]
    rng = torch.get_rng_state()
    report = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=nn.functional.mse_loss,
                               base_batch_size=4)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(s["momentum_buffer"], b)
               for s, b in zip(optimizer.state.values(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert report.measurable, report.reason
    assert 2 <= report.critical_batch_size <= 256  # inside the ladder 4..128, by its factor 2
    assert 1 <= report.seeds_fitted <= 2  # of the two seeds, those whose steps fell
    assert (report.critical_batch_size_error is None) == (report.seeds_fitted < 2)
    assert report.target_loss < report.start_loss
    assert report.lr_scaling == "linear"  # SGD
    spent = sum(b.examples or 0 for b in report.ladder)
    assert report.examples > spent  # training and the loss evaluations
    assert report.examples_noise == 512
    assert 0 < report.examples_eval <= report.examples - report.examples_noise - spent
    assert report.examples_eval % 256 == 0  # forward passes of the 256-example sample
    assert report.ratio == pytest.approx(report.critical_batch_size / report.b_simple)
    check_the_learning_rates(report, rule=lambda ratio: ratio)
    assert "critical batch" in report.summary()
    assert "branches" in report._repr_html_()
    assert f"loss evaluations {report.examples_eval:,}" in report._repr_html_()


def check_the_learning_rates(report, rule):
    """Each batch starts at the rate that counted at the batch below, scaled by the rule; a
    try that blew up (or was slower than the batch below) runs again at half its rate; a
    first try that reached the target runs at twice the rate while that is faster, where the
    batch below's rate went up too (or at the base); at the base, then at half while faster."""
    for seed in {b.seed for b in report.ladder}:
        rows = [b for b in report.ladder if b.seed == seed]
        sizes = sorted({b.batch_size for b in rows})
        counted, raised = {}, {}
        for size in sizes:
            tries = [b for b in rows if b.batch_size == size]
            reached = [b for b in tries if b.steps_to_target is not None]
            if reached:
                counted[size] = min(reached, key=lambda b: b.steps_to_target).lr
                raised[size] = counted[size] > tries[0].lr
            below = [s for s in sizes if s < size and s in counted]
            if below:
                assert tries[0].lr == pytest.approx(counted[below[-1]] * rule(size / below[-1]))
            for i, (a, b) in enumerate(itertools.pairwise(tries), 1):
                done = [t for t in tries[:i] if t.steps_to_target is not None]
                best = min(done, key=lambda t: t.steps_to_target).lr if done else None
                if b.lr > a.lr:  # up: from the best so far, where climbing pays
                    assert b.lr == pytest.approx(2 * best)
                    assert not below or raised[below[-1]]
                elif best is not None and b.lr == pytest.approx(best / 2) and size == sizes[0]:
                    pass  # down at the base, from the best so far
                else:  # backing off from a try that blew up or was slower
                    assert b.lr == pytest.approx(a.lr / 2)


def test_the_adam_family_scales_the_learning_rate_by_the_square_root():
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    report = bw.critical_batch(model, regression(), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                               noise=False)
    assert report.lr_scaling == "sqrt"
    check_the_learning_rates(report, rule=math.sqrt)
    assert report.b_simple is None


def test_a_critical_batch_past_the_ladder_is_a_bound_not_a_number():
    # label noise 3 at batches of 1 to 4: noise-dominated, the steps halve as the batch doubles
    model, optimizer = model_and_sgd(0.01)
    report = bw.critical_batch(model, regression(noise=3.0), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, batch_sizes=[1, 2, 4], seeds=1,
                               noise=False)
    assert not report.measurable
    assert report.critical_batch_size is None
    assert "above it" in report.reason
    assert (report.bound, report.bound_batch_size) == ("above", 8.0)
    assert "not measurable" in report.summary()
    # no label noise at batches of 64 to 256: the steps hardly fall
    model, optimizer = model_and_sgd(0.1)
    report = bw.critical_batch(model, regression(noise=0.0), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, batch_sizes=[64, 128, 256],
                               seeds=1, noise=False)
    assert (report.bound, report.bound_batch_size) == ("below", 32.0)
    assert "below it" in report.reason


def test_a_target_no_branch_reaches_is_not_measurable_and_says_why():
    model, optimizer = model_and_sgd(0.1)
    report = bw.critical_batch(model, regression(noise=1.0), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, target_loss=0.01,
                               base_batch_size=4, seeds=1, max_steps=40, noise=False)
    assert report.critical_batch_size is None
    assert all(b.steps is None for b in report.ladder)
    assert "fewer than two batch sizes reached the target" in report.reason


@pytest.mark.parametrize("criterion", ["steps", "loss"])
def test_a_target_above_the_start_is_not_measurable_and_says_why(criterion):
    # It once crashed with "math domain error": every branch reached it at once.
    model, optimizer = model_and_sgd(0.1)
    weights = model.weight.detach().clone()
    report = bw.critical_batch(model, regression(256), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, target_loss=1e6,
                               base_batch_size=4, seeds=1, noise=False, criterion=criterion)
    assert report.critical_batch_size is None
    assert report.reason.startswith("target_loss=1e+06 is not below the loss at the current")
    assert torch.equal(model.weight, weights)


@pytest.mark.parametrize(("options", "message"), [
    ({"data": TensorDataset(torch.randn(12, 16), torch.randn(12, 1))}, "data should hold"),
    ({"lr_scaling": "cubic"}, "lr_scaling should be"),
    ({"seeds": 0}, "seeds should be an int >= 1"),
    ({"optimizer": None}, "optimizer should be"),
    ({"criterion": "examples"}, "criterion should be 'steps'"),
    ({"loss_tolerance": 1.5}, "loss_tolerance should be"),
    ({"fits_batch_size": 0}, "fits_batch_size should be"),
    ({"target_loss": float("nan")}, "target_loss should be a finite number"),
    ({"batch_sizes": [4, 8, 0]}, "batch_sizes should be"),
    ({"max_steps": 2.5}, "max_steps should be"),
    ({"scheduler": 0.1}, "scheduler should be the optimizer's learning-rate scheduler"),
    # as find_batch says it: the model's own error blamed a meta device on the forward
    ({"device": "meta"}, "device should be a device this process can train on"),
    ({"device": "cuda:7"}, "device should be a device this process can train on"),
])
def test_bad_input_is_a_one_line_error_naming_the_argument(options, message):
    model, optimizer = model_and_sgd(0.1)
    arguments = {"data": regression(256), "optimizer": optimizer, **options}
    data = arguments.pop("data")
    with pytest.raises((TypeError, ValueError), match=message) as caught:
        bw.critical_batch(model, data, loss_fn=nn.functional.mse_loss, base_batch_size=4,
                          **arguments)
    assert "\n" not in str(caught.value)


def test_a_frozen_model_is_refused():
    model, optimizer = model_and_sgd(0.1)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="model should have trainable parameters"):
        bw.critical_batch(model, regression(256), optimizer=optimizer,
                          loss_fn=nn.functional.mse_loss)


def test_batches_above_what_fits_accumulate_to_the_same_steps():
    """A ladder past ``fits_batch_size`` accumulates micro-batches: the gradient of the whole
    batch, so every branch takes the steps it takes in one batch (PyTorch as the oracle)."""
    data = regression(2048)
    reports = []
    for fits in (None, 8):
        model, optimizer = model_and_sgd(0.05)
        reports.append(bw.critical_batch(model, data, optimizer=optimizer,
                                         loss_fn=nn.functional.mse_loss, base_batch_size=4,
                                         seeds=1, noise=False, fits_batch_size=fits))
    whole, parts = reports
    assert [b.steps for b in whole.ladder] == [b.steps for b in parts.ladder]
    assert [b.micro_batches for b in parts.ladder] == [
        -(-b.batch_size // 8) for b in parts.ladder]
    assert all(b.micro_batches == 1 for b in whole.ladder)
    assert parts.critical_batch_size == pytest.approx(whole.critical_batch_size, rel=1e-6)
    assert parts.fits_batch_size == 8
    assert "accumulate" in str(parts.rows())
    assert "(16 × 8)" in parts._repr_html_()


def test_the_loss_criterion_is_a_second_number_on_equal_examples():
    model, optimizer = model_and_sgd(0.05)
    report = bw.critical_batch(model, regression(), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                               noise=False, criterion="loss", base_steps=32)
    assert report.criterion == "loss"
    budget = 32 * 4
    assert {b.examples for b in report.loss_ladder} == {budget}
    assert {b.batch_size for b in report.loss_ladder} == {4, 8, 16, 32, 64, 128}
    losses = {b.batch_size: b.loss for b in report.loss_ladder}
    within = [b for b in sorted(losses) if losses[b] <= losses[4] * 1.01]
    assert report.loss_criterion_batch_size in within
    # the largest batch from the base up: every batch below it is within the tolerance too
    assert all(b in within for b in sorted(losses) if b <= report.loss_criterion_batch_size)
    bigger = [b for b in sorted(losses) if b > report.loss_criterion_batch_size]
    assert not bigger or losses[bigger[0]] > losses[4] * 1.01
    assert "Merrill" in str(report.rows())
    assert "equal examples" in report._repr_html_()
    training = sum(b.examples for b in report.ladder + report.loss_ladder if b.examples)
    assert report.examples > training


def padded_text(n: int = 1024) -> list:
    """Variable-length sequences of 2 to 6 vectors, each labelled by its mean projection."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=generator)
    items = []
    for i in range(n):
        x = torch.randn(2 + i % 5, 8, generator=generator)
        items.append((x, (x @ w).mean() + 0.5 * torch.randn((), generator=generator)))
    return items


def pad(batch):
    """A padding collate_fn giving dict batches, as a DataLoader over text does."""
    longest = max(len(x) for x, _ in batch)
    x = torch.zeros(len(batch), longest, 8)
    mask = torch.zeros(len(batch), longest)
    for row, (tokens, _) in enumerate(batch):
        x[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
    return {"x": x, "mask": mask, "labels": torch.stack([y for _, y in batch])}


class Pooled(nn.Module):
    """The masked mean of a projection: padding changes nothing; returns its loss."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x, mask, labels):
        pooled = (self.linear(x).squeeze(-1) * mask).sum(1) / mask.sum(1)
        return {"loss": nn.functional.mse_loss(pooled, labels)}


def test_a_dataloaders_collate_fn_builds_the_branches_batches():
    """Dict batches through the user's collate_fn (variable-length items padded), as a
    DataLoader over text gives them; past what fits, micro-batches padded each to its own
    longest item take the steps of the whole batch."""
    reports = []
    for fits in (None, 8):
        torch.manual_seed(0)
        model = Pooled()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(padded_text(), batch_size=4, shuffle=True,
                                             collate_fn=pad)
        reports.append(bw.critical_batch(model, loader, optimizer=optimizer, seeds=1,
                                         noise=False, fits_batch_size=fits))
    whole, parts = reports
    assert whole.base_batch_size == 4
    assert whole.start_loss > whole.target_loss
    assert any(b.steps for b in whole.ladder)
    assert [b.steps for b in whole.ladder] == [b.steps for b in parts.ladder]
    assert max(b.micro_batches for b in parts.ladder) > 1


@pytest.mark.parametrize("noise", [True, False])
def test_variable_length_items_without_a_collate_fn_are_said_for_critical_batch(noise):
    # with noise=True the advice came from the measure_noise call inside, naming it
    model = Pooled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError, match=r"pass critical_batch\(\.\.\., DataLoader\(dataset"):
        bw.critical_batch(model, padded_text(64), optimizer=optimizer, seeds=1, noise=noise,
                          base_batch_size=4)


def test_inside_an_accumulate_block_it_is_not_the_blocks_micro_steps():
    """Measured at a checkpoint mid-loop, inside ``accumulate``: the same answer as outside, and
    the block's count, pending gradient and tracker untouched."""
    data = regression(2048)
    outside_model, outside_optimizer = model_and_sgd(0.05)
    expected = bw.critical_batch(outside_model, data, optimizer=outside_optimizer,
                                 loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1)
    model, optimizer = model_and_sgd(0.05)
    tracker = bw.NoiseTracker(overhead_target=None)
    x, y = data.tensors
    with bw.accumulate(optimizer, steps=4, model=model, noise=tracker) as acc:
        nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
        optimizer.step()  # one micro-step pending
        optimizer.zero_grad()
        grads = [p.grad.clone() for p in model.parameters()]
        weights = [p.detach().clone() for p in model.parameters()]
        losses = len(tracker.report.losses)
        # the weights moved by no update yet: the same start as outside
        assert all(torch.equal(w, p) for w, p in zip(weights, outside_model.parameters()))
        report = bw.critical_batch(model, data, optimizer=optimizer,
                                   loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        assert len(tracker.report.losses) == losses
    assert report == expected
    assert acc.report.micro_steps == 1
    assert acc.report.real_steps == 1  # the remainder, applied at the end


class Wandering(nn.Module):
    """A regression whose every loss evaluation is shifted by one random offset: progress of a
    few tenths hides in its noise (a plateau seen through a noisy evaluation)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, x):
        return self.linear(x) + 0.3 * torch.randn(())


def test_a_target_within_the_noise_runs_the_base_longer_then_says_so():
    torch.manual_seed(2)
    model = Wandering()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = regression(noise=1.0)
    x, y = data.tensors
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1)], 1), y).solution
    with torch.no_grad():  # at the optimum: the base batch cannot really descend
        model.linear.weight.copy_(solution[:16].T)
        model.linear.bias.copy_(solution[16])
    report = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=nn.functional.mse_loss,
                               base_batch_size=4, base_steps=16, seeds=1, noise=False)
    assert not report.measurable
    assert "is within the noise of the start" in report.reason
    assert "after 64 steps" in report.reason  # 16, 32, then 64 = LONGER x base_steps
    assert report.ladder == ()


def test_the_loss_is_evaluated_without_dropout_and_the_modes_are_put_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    seen = []
    model[2].register_forward_hook(lambda module, *_: seen.append(module.training))
    bw.critical_batch(model, regression(1024), optimizer=optimizer,
                      loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1, noise=False)
    assert True in seen  # trained with dropout
    assert False in seen  # evaluated without
    assert model.training
    assert model[2].training


def test_evaluations_start_late_without_changing_a_step(monkeypatch):
    """A rung starts evaluating at a quarter of the steps the batch below took (a doubled batch
    at most halves them); a branch already at the target there runs again, evaluated from step
    1. Fewer evaluations, the same branches as evaluating every run from its first step."""
    from batchwidgets.engine.noise import _critical

    def measure():
        model, optimizer = model_and_sgd(0.01)
        return bw.critical_batch(model, regression(), optimizer=optimizer,
                                 loss_fn=nn.functional.mse_loss, base_batch_size=4, noise=False)

    late = measure()
    monkeypatch.setattr(_critical, "FASTEST", math.inf)  # every run evaluated from step 1
    early = measure()
    assert late.ladder == early.ladder
    assert late.critical_batch_size == early.critical_batch_size
    assert late.examples < 0.9 * early.examples, (late.examples, early.examples)


def test_the_base_rate_is_also_searched_downward():
    """At the base nothing below says a rate is too fast: after twice its rate fails, half of
    it runs, and counts where it reaches the target sooner (a rate near the edge oscillates)."""
    model, optimizer = model_and_sgd(0.5)
    report = bw.critical_batch(model, regression(), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                               noise=False)
    base = [b for b in report.ladder if b.batch_size == 4]
    first, up, down = base[:3]
    assert (up.lr, down.lr) == (2 * first.lr, first.lr / 2)
    assert up.diverged
    assert down.steps_to_target < first.steps_to_target
    assert report.lr_scale_at(4) == pytest.approx(down.lr / 0.5)  # the rate that counted
    check_the_learning_rates(report, rule=lambda ratio: ratio)


def test_the_users_schedule_runs_in_the_branches_at_each_branchs_rates():
    """A scheduler steps with the branches, at each branch's scale of every rate it computes
    from: a LambdaLR of constant 1 (it sets the rate from base_lrs at every step) changes no
    branch; a warm-up and a one-cycle schedule run, and every state is put back."""
    def measure(make_scheduler=None):
        model, optimizer = model_and_sgd(0.02)
        scheduler = make_scheduler(optimizer) if make_scheduler else None
        if scheduler is not None:
            optimizer.step()
            scheduler.step()  # one step into the schedule, as a checkpoint mid-training is
        saved = (scheduler.state_dict() if scheduler else None,
                 [dict(g, params=None) for g in optimizer.param_groups])
        report = bw.critical_batch(model, regression(1024), optimizer=optimizer,
                                   loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                                   scheduler=scheduler, noise=False)
        assert (scheduler.state_dict() if scheduler else None) == saved[0]
        assert [dict(g, params=None) for g in optimizer.param_groups] == saved[1]
        return report

    plain = measure()
    constant = measure(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0))
    assert constant.ladder == plain.ladder
    assert len({b.lr for b in plain.ladder}) > 2  # the rates searched did differ
    warmup = measure(lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda step: min(1.0, (step + 1) / 100)))
    assert warmup.ladder != plain.ladder
    one_cycle = measure(lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=10_000))
    assert any(b.steps_to_target is not None for b in one_cycle.ladder)


def test_a_scheduler_stepped_on_a_metric_is_refused_in_one_line():
    model, optimizer = model_and_sgd(0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(TypeError, match=r"^scheduler should be stepped once per optimizer step"
                       ) as caught:
        bw.critical_batch(model, regression(256), optimizer=optimizer,
                          loss_fn=nn.functional.mse_loss, scheduler=plateau)
    assert "\n" not in str(caught.value)


class NanAbove(nn.Module):
    """A linear model whose loss is NaN on batches larger than ``limit`` (an overflow that
    only large batches reach)."""

    def __init__(self, limit: int):
        super().__init__()
        self.linear, self.limit = nn.Linear(16, 1), limit

    def forward(self, x):
        out = self.linear(x)
        return out * math.nan if len(x) > self.limit and self.training else out


def test_a_nan_at_a_branch_is_a_diverged_row_never_a_number():
    torch.manual_seed(0)
    model = NanAbove(limit=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    report = bw.critical_batch(model, regression(1024), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                               noise=False)
    above = [b for b in report.ladder if b.batch_size > 16]
    assert above
    assert all(b.diverged and b.steps is None and b.loss is None for b in above)
    assert report.measurable or report.bound  # a number or a bound, from 4, 8 and 16 alone
    assert max(b.batch_size for b in report.ladder if b.steps is not None) == 16
    model = NanAbove(limit=4)  # only the base batch trains: nothing to fit
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    report = bw.critical_batch(model, regression(1024), optimizer=optimizer,
                               loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=1,
                               noise=False)
    assert not report.measurable
    assert "fewer than two batch sizes reached the target" in report.reason


class NoisyInTraining(nn.Module):
    """A linear model whose outputs carry noise in train mode only (as dropout adds)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, x):
        out = self.linear(x)
        return out + 3 * torch.randn_like(out) if self.training else out


def test_a_training_loss_above_the_evaluated_one_is_not_taken_for_a_blow_up():
    """Train-mode noise puts every training batch's loss far above the evaluated (eval mode)
    start: the look between evaluations is against the first batch's loss, so the branches are
    not evaluated at every step (a few per doubling of the steps, as without the noise)."""
    torch.manual_seed(0)
    data = regression(2048)
    x, y = data.tensors
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1)], 1), y).solution
    model = NoisyInTraining()
    with torch.no_grad():  # part of the way to the optimum: a descent left, the noise above it
        model.linear.weight.copy_(0.7 * solution[:16].T)
        model.linear.bias.copy_(0.7 * solution[16])
        evaluated = nn.functional.mse_loss(model.eval()(x), y).item()
        trained = nn.functional.mse_loss(model.train()(x), y).item()
    assert trained > 2 * evaluated  # every training batch would look like a blow-up
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
    report = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=nn.functional.mse_loss,
                               base_batch_size=4, seeds=1, noise=False)
    assert report.target_loss < report.start_loss
    steps = sum(b.steps or 0 for b in report.ladder)
    assert report.examples_eval < 0.7 * steps * 256  # at every step: about 0.9
