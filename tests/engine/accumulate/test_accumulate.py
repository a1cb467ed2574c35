"""accumulate(): k micro-batches must give the update of one k-times larger batch (PyTorch is
the oracle), with schedulers, GradScaler, clipping, remainders and DDP handled."""

import gc
import html
import math
import os
import re

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import batchwidgets as bw
from batchwidgets._warnings import BatchwidgetsWarning

loss_fn = nn.functional.cross_entropy
X = torch.randn(96, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
Y = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(2))


def make_model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def train_big(make_optimizer, batch=16, updates=4, clip=None, scheduler=False):
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5) if scheduler else None
    for u in range(updates):
        loss_fn(model(X[u * batch:(u + 1) * batch]), Y[u * batch:(u + 1) * batch]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if sched:
            sched.step()
    return model, optimizer, sched


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zero_grad_first", [False, True])
def test_accumulated_updates_equal_the_big_batch_updates(name, zero_grad_first):
    big, _, _ = train_big(OPTIMIZERS[name])
    model = make_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    with bw.accumulate(optimizer, steps=4):
        for j in range(16):
            if zero_grad_first:
                optimizer.zero_grad()
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            optimizer.step()
            if not zero_grad_first:
                optimizer.zero_grad()
    assert max_difference(big, model) < 1e-10


def test_micro_steps_without_accumulate_would_differ():
    big, _, _ = train_big(OPTIMIZERS["sgd-momentum"])
    model = make_model()
    optimizer = OPTIMIZERS["sgd-momentum"](model.parameters())
    for j in range(16):
        loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert max_difference(big, model) > 1e-3  # so the test above can fail


def test_scheduler_steps_once_per_real_step():
    big, _, big_sched = train_big(OPTIMIZERS["adam"], scheduler=True)
    model = make_model()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    with bw.accumulate(optimizer, steps=4, scheduler=sched) as acc:
        for j in range(16):
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
            sched.step()
    assert sched.get_last_lr() == big_sched.get_last_lr() == [1e-2 / 16]
    assert max_difference(big, model) < 1e-10
    assert acc.report.real_steps == 4


def test_clip_grad_norm_acts_on_the_accumulated_gradient():
    big, _, _ = train_big(OPTIMIZERS["sgd-momentum"], clip=0.05)
    model = make_model()
    optimizer = OPTIMIZERS["sgd-momentum"](model.parameters())
    norms = []
    with bw.accumulate(optimizer, steps=4) as acc:
        for j in range(16):
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            norms.append(acc.clip_grad_norm_(0.05))
            optimizer.step()
            optimizer.zero_grad()
    assert max_difference(big, model) < 1e-10
    assert [n is None for n in norms] == [True, True, True, False] * 4


@pytest.mark.parametrize("remainder", ["apply", "drop"])
def test_left_over_micro_steps_are_applied_or_dropped(remainder):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=4, remainder=remainder) as acc:
        for j in range(6):
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = make_model()
    reference = torch.optim.SGD(expected.parameters(), lr=0.1)
    loss_fn(expected(X[:16]), Y[:16]).backward()
    reference.step()
    reference.zero_grad()
    if remainder == "apply":  # the 2 left over micro-batches: one step averaged over 8 samples
        loss_fn(expected(X[16:24]), Y[16:24]).backward()
        reference.step()
    assert max_difference(expected, model) < 1e-10
    report = acc.report
    assert (report.remainder, report.remainder_micro_steps) == (
        "applied" if remainder == "apply" else "dropped", 2)
    assert report.real_steps == (2 if remainder == "apply" else 1)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_grad_scaler_steps_once_per_real_step_and_skips_on_inf():
    model = make_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    weights_after = []
    with bw.accumulate(optimizer, steps=2, scaler=scaler) as acc:
        for j in range(6):
            loss = loss_fn(model(X[j * 4:(j + 1) * 4].float()), Y[j * 4:(j + 1) * 4])
            if j == 2:  # an inf in the first micro-batch of the second update
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            weights_after.append(model[0].weight.detach().clone())
    # updates at j=1 (growth x2 -> 2048), j=3 skipped (inf: backoff x0.5 -> 1024), j=5 (2048)
    assert scaler.get_scale() == 2048.0
    assert acc.report.skipped_steps == 1
    assert acc.report.real_steps == 3
    assert torch.equal(weights_after[1], weights_after[3])  # the skipped update changed nothing
    assert not torch.equal(weights_after[3], weights_after[5])
    assert acc.report.losses[0] == pytest.approx(
        loss_fn(make_model(torch.float32)(X[:4].float()), Y[:4]).item(), rel=1e-6)


def test_report_records_each_micro_batch_loss_and_gradient_norm():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay put
    expected_losses, expected_norms = [], []
    with bw.accumulate(optimizer, steps=3, model=model) as acc:
        for j in range(6):
            xb, yb = X[j * 4:(j + 1) * 4], Y[j * 4:(j + 1) * 4]
            grads = torch.autograd.grad(loss_fn(model(xb), yb), list(model.parameters()))
            expected_norms.append(math.sqrt(sum(g.pow(2).sum().item() for g in grads)))
            loss = loss_fn(model(xb), yb)
            expected_losses.append(loss.item())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    report = acc.report
    assert report.grad_norms == ()  # off by default: they cost a reduction per parameter
    assert report.losses == pytest.approx(expected_losses)
    assert report.micro_batch_size == 4
    assert report.effective_batch_size == 12
    assert report.micro_steps == 6
    assert "accumulate" in report._repr_html_()


def test_gradient_norms_are_per_micro_batch():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    expected = []
    with bw.accumulate(optimizer, steps=2, track_grad_norms=True) as acc:
        for j in range(4):
            xb, yb = X[j * 4:(j + 1) * 4], Y[j * 4:(j + 1) * 4]
            reference = make_model()
            loss_fn(reference(xb), yb).backward()
            expected.append(math.sqrt(sum(p.grad.pow(2).sum().item()
                                          for p in reference.parameters())))
            loss_fn(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert acc.report.grad_norms == pytest.approx(expected)


@pytest.mark.parametrize("scaled", [False, True])
def test_the_cheap_noise_tracker_adds_no_parameter_hook_and_changes_no_update(scaled):
    big, _, _ = train_big(OPTIMIZERS["adam"], clip=0.05)
    model = make_model()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    # a scaler on float64 weights: its unscale_ and inf checks run, the update is the same
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000) if scaled else None
    tracker = bw.NoiseTracker(warmup_updates=1, every_micro_batch=False)
    with bw.accumulate(optimizer, steps=4, model=model, scaler=scaler, noise=tracker) as acc:
        assert all(not p._backward_hooks for p in model.parameters())  # issue 5
        for j in range(16):
            loss = loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4])
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None and acc.is_sync_step:
                scaler.unscale_(optimizer)
            acc.clip_grad_norm_(0.05)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
    assert max_difference(big, model) < 1e-10
    assert acc.report.grad_norms == ()  # recorded with track_grad_norms=True only
    assert len(acc.report.losses) == 16
    assert tracker.report.n_updates == 4
    assert tracker.report.losses == acc.report.losses


def test_everything_is_restored_after_an_error():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward = torch.Tensor.backward

    def interrupted_loop():
        with bw.accumulate(optimizer, steps=4):
            loss_fn(model(X[:4]), Y[:4]).backward()
            optimizer.step()
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_loop()
    assert "step" not in vars(optimizer)
    assert "zero_grad" not in vars(optimizer)
    assert torch.Tensor.backward is backward
    assert all(not p._backward_hooks for p in model.parameters())
    before = model[0].weight.detach().clone()
    loss_fn(model(X[:4]), Y[:4]).backward()
    optimizer.step()  # a plain step again
    assert not torch.equal(before, model[0].weight)


def test_an_error_drops_the_micro_steps_since_the_last_update():
    # a plain loop had cleared its gradients at zero_grad; inside the block that zero_grad was a
    # micro-step's, so the sum of two micro-batches stayed in .grad and went into the re-run
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = bw.accumulate(optimizer, steps=4)

    def failing_loop():
        with acc:
            for j in range(2):
                loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
                optimizer.step()
                optimizer.zero_grad()
            raise RuntimeError("the loop's own")

    with pytest.raises(RuntimeError, match="the loop's own"):
        failing_loop()
    assert all(p.grad is None for p in model.parameters())
    assert (acc.report.remainder, acc.report.remainder_micro_steps) == ("dropped", 2)
    with bw.accumulate(optimizer, steps=4):  # the re-run: one update of the first 16 samples
        for j in range(4):
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
    big, _, _ = train_big(lambda p: torch.optim.SGD(p, lr=0.1), updates=1)
    assert max_difference(big, model) < 1e-10


def test_a_loop_that_clears_gradients_through_the_model_accumulates_too():
    big, _, _ = train_big(OPTIMIZERS["adamw"])
    model = make_model()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    with bw.accumulate(optimizer, steps=4, model=model):
        for j in range(16):
            model.zero_grad()
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            optimizer.step()
    assert max_difference(big, model) < 1e-10
    assert "zero_grad" not in vars(model)


def test_a_plateau_scheduler_steps_on_the_loops_metric_after_a_remainder():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    metrics = []
    with bw.accumulate(optimizer, steps=4, scheduler=sched) as acc:
        for j in range(6):  # an update of 4 micro-batches, a remainder of 2
            loss = loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            metrics.append(10.0 + j)  # worse every time: each scheduler step halves the rate
            sched.step(metrics[-1])
    assert (acc.report.remainder, acc.report.real_steps) == ("applied", 2)
    assert optimizer.param_groups[0]["lr"] == 0.1 / 2  # the first step sets the best; one more
    assert sched.best == 13.0  # the update's step saw micro-step 4's metric


def test_a_micro_steps_clip_norm_is_unscaled_as_the_loops_unscale_says():
    model = make_model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    norms = []
    with bw.accumulate(optimizer, steps=4, scaler=scaler):
        for j in range(4):
            scaler.scale(loss_fn(model(X[j * 4:(j + 1) * 4].float()),
                                 Y[j * 4:(j + 1) * 4])).backward()
            scaler.unscale_(optimizer)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    truth = make_model(torch.float32)  # PyTorch's own: the mean gradient of the first k
    for k in range(1, 5):
        truth.zero_grad()
        loss_fn(truth(X[:4 * k].float()), Y[:4 * k]).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in truth.parameters()]).item()
        assert norms[k - 1] == pytest.approx(expected, rel=1e-4), k


def test_batchnorm_warns_once():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop():
        with bw.accumulate(optimizer, 2, model=model):
            for j in range(4):
                model(X[j * 4:(j + 1) * 4]).sum().backward()
                optimizer.step()

    with pytest.warns(BatchwidgetsWarning) as record:
        loop()
    assert len(record) == 1
    assert "BatchNorm" in str(record[0].message)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, r"steps should be an int >= 1"),
    ({"steps": 2.5}, r"steps should be an int >= 1"),
    ({"remainder": "keep"}, "remainder should be one of"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        bw.accumulate(optimizer, **kwargs)


@pytest.mark.parametrize(("name", "value", "match"), [
    ("scaler", object(), r"scaler should be a torch\.amp\.GradScaler"),
    ("scheduler", 0.1, r"scheduler should be an LR scheduler with step\(\)"),
    # an optimizer has a step() too: its steps would have been swallowed as a scheduler's
    ("scheduler", "the optimizer", r"but got scheduler of type SGD; pass the scheduler"),
    ("model", "the optimizer", r"model should be a torch.nn.Module, but got model of type SGD"),
])
def test_a_scaler_or_scheduler_accumulate_cannot_intercept_is_refused(name, value, match):
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    step = optimizer.step
    value = optimizer if value == "the optimizer" else value
    with pytest.raises(TypeError, match=match) as error:
        bw.accumulate(optimizer, steps=2, **{name: value})
    assert "\n" not in str(error.value)
    assert optimizer.step == step  # nothing was patched


def test_optimizer_must_be_an_optimizer():
    with pytest.raises(TypeError, match=r"optimizer should be a torch\.optim\.Optimizer"):
        bw.accumulate(make_model(), steps=2)


# ---- DDP: two gloo processes -----------------------------------------------------------------

def _ddp_worker(rank, world, init_file, out_dir, steps, use_accumulate):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    ddp = DDP(make_model())
    calls = [0]

    def counting_allreduce(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    micro = 2  # per rank; global micro-batch = micro * world, update = steps micro-batches
    n_micro = 2 * steps

    def loop(ddp, optimizer):
        for j in range(n_micro):
            start = j * micro * world + rank * micro
            loss_fn(ddp(X[start:start + micro]), Y[start:start + micro]).backward()
            optimizer.step()
            optimizer.zero_grad()

    if use_accumulate:
        with bw.accumulate(optimizer, steps=steps, model=ddp):
            loop(ddp, optimizer)
    else:
        loop(ddp, optimizer)
    torch.save({"params": [p.detach() for p in ddp.module.parameters()], "calls": calls[0]},
               os.path.join(out_dir, f"{use_accumulate}-{rank}.pt"))
    # both ranks done before either tears gloo down: a rank that exits while the other still
    # talks to it makes gloo abort (SIGABRT, about 1 run in 4 on 2 busy cores); and DDP's
    # reducer, which holds the group and its pending work, goes first (with it alive at
    # teardown, gloo still aborted about 1 run in 6: "terminate called without an active
    # exception")
    del ddp, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_accumulation_equals_the_big_batch_with_fewer_allreduces(tmp_path):
    steps, world = 4, 2
    for use_accumulate in (True, False):
        mp.spawn(_ddp_worker, args=(world, str(tmp_path / f"init{use_accumulate}"),
                                    str(tmp_path), steps, use_accumulate), nprocs=world)
    results = {name: torch.load(tmp_path / f"{name}.pt")
               for name in ("True-0", "True-1", "False-0")}
    big, _, _ = train_big(OPTIMIZERS["sgd-momentum"], batch=2 * 2 * steps, updates=2)
    for rank in ("True-0", "True-1"):
        for p, q in zip(results[rank]["params"], big.parameters()):
            assert (p - q).abs().max().item() < 1e-10
    assert results["True-0"]["calls"] * steps == results["False-0"]["calls"]
    assert results["True-0"]["calls"] > 0


# ---- issue 13: the standard clip_grad_norm_ inside the block ----------------------------------

@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_standard_clip_grad_norm_clips_the_big_batch_gradient_once(name):
    big, _, _ = train_big(OPTIMIZERS[name], clip=0.05)
    model = make_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    with bw.accumulate(optimizer, steps=4):
        for j in range(16):
            loss_fn(model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
    assert max_difference(big, model) < 1e-10
    # without the block, clipping every micro-step's partial sum trains another model
    unblocked = make_model()
    optimizer = OPTIMIZERS[name](unblocked.parameters())
    for j in range(16):
        (loss_fn(unblocked(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]) / 4).backward()
        torch.nn.utils.clip_grad_norm_(unblocked.parameters(), 0.05)
        if j % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()
    assert max_difference(big, unblocked) > 1e-4
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_


def test_clipping_on_a_micro_step_changes_nothing_and_a_remainder_is_clipped():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=4):
        loss_fn(model(X[:4]), Y[:4]).backward()
        before = [p.grad.clone() for p in model.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
        expected = torch.linalg.vector_norm(torch.stack([b.norm() for b in before]))
        assert norm.item() == pytest.approx(expected.item())
        optimizer.step()
        loss_fn(model(X[4:8]), Y[4:8]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
    # the block ended after 2 of 4 micro-steps: the remainder step is the clipped batch of 8
    big, _, _ = train_big(lambda p: torch.optim.SGD(p, lr=0.1), batch=8, updates=1, clip=0.05)
    assert max_difference(big, model) < 1e-10


def test_clip_grad_norm_of_other_parameters_passes_through():
    model, other = make_model(), nn.Linear(5, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=4):
        other(X[:4]).sum().backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()])
                                    ).item() == pytest.approx(1e-3, rel=1e-4)


# ---- issue 12: only the thread that entered, never batchwidgets' own steps ---------------------

def test_backward_and_steps_from_another_thread_are_not_accumulated():
    import threading

    model, elsewhere = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.SGD(elsewhere.parameters(), lr=0.1)
    reference = make_model()
    loss_fn(reference(X[:8]), Y[:8]).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad

    def other_thread():  # a backward and a step on another thread, inside the block: untouched
        loss = loss_fn(elsewhere(X[:8]), Y[:8])
        loss.backward()
        other_optimizer.step()

    with bw.accumulate(optimizer, steps=2) as acc:
        loss_fn(model(X[:4]), Y[:4]).backward()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        optimizer.step()
        loss_fn(model(X[4:8]), Y[4:8]).backward()
        optimizer.step()
    assert acc.report.micro_steps == 2
    assert len(acc.report.losses) == 2
    assert max_difference(reference, model) < 1e-10
    assert max_difference(reference, elsewhere) < 1e-10  # the other thread's step was real


def test_batchwidgets_own_steps_inside_a_block_are_not_counted():
    from batchwidgets.engine._called import own_steps

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = make_model()
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=2, track_grad_norms=True) as acc:
        loss_fn(model(X[:4]), Y[:4]).backward()
        optimizer.step()
        with own_steps():  # what find_batch's probe steps run in
            for _ in range(3):
                loss_fn(probe(X[:8]), Y[:8]).backward()
                torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e-3)
                probe_optimizer.step()
                probe_optimizer.zero_grad()
        loss_fn(model(X[4:8]), Y[4:8]).backward()
        optimizer.step()
    report = acc.report
    assert (report.micro_steps, report.real_steps, len(report.losses)) == (2, 1, 2)
    assert len(report.grad_norms) == 2
    reference, _, _ = train_big(lambda p: torch.optim.SGD(p, lr=0.1), batch=8, updates=1)
    assert max_difference(reference, model) < 1e-10
    assert max_difference(make_model(), probe) > 1e-5  # its 3 steps were real


# ---- %%accumulate: the standard clip, and auto ------------------------------------------------

@pytest.fixture
def shell():
    from IPython.testing.globalipapp import start_ipython

    start_ipython()  # the shared test shell
    ip = get_ipython()  # noqa: F821 (start_ipython installs it)
    ip.run_line_magic("load_ext", "batchwidgets")
    yield ip
    ip.run_line_magic("unload_ext", "batchwidgets")
    for name in ("clip_model", "clip_opt", "X", "Y", "loss_fn", "torch", "noise_tracker"):
        ip.user_ns.pop(name, None)


CLIP_LOOP = """
for j in range(16):
    loss_fn(clip_model(X[j * 4:(j + 1) * 4]), Y[j * 4:(j + 1) * 4]).backward()
    torch.nn.utils.clip_grad_norm_(clip_model.parameters(), 0.05)
    clip_opt.step()
    clip_opt.zero_grad()
"""


def test_a_clipping_accumulate_cell_equals_the_clipped_big_batch(shell):
    big, _, _ = train_big(OPTIMIZERS["adam"], clip=0.05)
    model = make_model()
    shell.push({"clip_model": model, "clip_opt": OPTIMIZERS["adam"](model.parameters()),
                "X": X, "Y": Y, "loss_fn": loss_fn, "torch": torch})
    report = shell.run_cell_magic("accumulate", "4", CLIP_LOOP)
    assert report.real_steps == 4
    assert max_difference(big, model) < 1e-10


def test_an_error_in_an_accumulate_cell_shows_the_cells_own_line(shell, capsys):
    model = make_model()
    shell.push({"clip_model": model, "clip_opt": torch.optim.SGD(model.parameters(), lr=0.1),
                "X": X, "Y": Y, "loss_fn": loss_fn, "torch": torch})
    result = shell.run_cell("%%accumulate 4\nloss_fn(clip_model(X[:4]), Y[:4]).backward()\n"
                            "clip_opt.step()\nprint(no_such_name)\n")
    assert isinstance(result.error_in_exec, NameError)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "print(no_such_name)" in shown  # the line, as a plain cell's traceback shows it
    assert "Could not get source" not in shown
    assert "magics.py" not in shown  # the magic's own frames are hidden
    assert all(p.grad is None for p in model.parameters())  # the micro-step dropped


def test_an_auto_accumulate_cell_follows_a_new_tracker(shell):
    model = make_model()
    shell.push({"clip_model": model, "clip_opt": torch.optim.SGD(model.parameters(), lr=0.1),
                "X": X, "Y": Y, "loss_fn": loss_fn, "torch": torch})
    report = shell.run_cell_magic("accumulate", "auto", CLIP_LOOP)
    assert report.auto
    assert report.steps == 2  # 16 micro-steps: too few updates to look at the schedule
    assert report.real_steps == 8
    assert isinstance(shell.user_ns["noise_tracker"], bw.NoiseTracker)
    assert shell.user_ns["noise_tracker"].report.n_losses_seen == 16


def test_an_accumulate_cell_says_when_accumulating_does_not_pay(shell):
    # a tracker that has measured B_simple = 16 exactly (|G|^2 = 1, tr(Sigma) = 16) on updates
    # of 8 micro-batches of 6 = 48, three times B_simple
    tracker = bw.NoiseTracker(warmup_updates=2, overhead_target=None)
    for _ in range(200):
        tracker.update(small_sq_norms=[1 + 16 / 6] * 8, big_sq_norm=1 + 16 / 48,
                       micro_batch_size=6, n_micro=8)
    model = make_model()
    shell.push({"clip_model": model, "clip_opt": torch.optim.SGD(model.parameters(), lr=0.1),
                "X": X, "Y": Y, "loss_fn": loss_fn, "torch": torch, "noise_tracker": tracker})
    report = shell.run_cell_magic("accumulate", "8 --noise noise_tracker", """
for j in range(16):
    loss_fn(clip_model(X[j * 6:(j + 1) * 6]), Y[j * 6:(j + 1) * 6]).backward()
    clip_opt.step()
    clip_opt.zero_grad()
""")
    assert "Accumulating to this batch does not pay: B = 48 samples (8 micro-batches)" in (
        report.advice)
    # the cell's own two updates moved the estimate a little off 16
    assert re.search(r"B_simple ≈ 1[67](\.\d)? ± .*E_min·\(1 \+ B/B_simple\) = 3\.\d+× the "
                     r"fewest examples", report.advice), report.advice
    assert html.escape(report.advice) in report._repr_html_()  # escaped, as every value is
    assert report.advice in report.summary()


def test_a_find_batch_inside_an_accumulate_block_is_not_counted_as_micro_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=2, model=model) as acc:
        for _ in range(4):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        report = bw.find_batch(torch.nn.Linear(8, 2), torch.randn(8), budget="64KiB")
    assert report.n_attempts >= 3  # the probe ran real steps inside the block
    assert (acc.report.micro_steps, acc.report.real_steps) == (4, 2)
    assert len(acc.report.losses) == 4
