"""On a real CUDA device (skipped without one): the exact boundary under a ``budget``, real
out-of-memory errors survived, memory and the process cap back where they were, state restored."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import batchwidgets as bw

pytestmark = pytest.mark.gpu
BUDGET = 2**30  # emulate a 1 GiB GPU


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    # ~64 MiB of weights; activations ~100 KiB a sample, so the boundary sits in the thousands
    return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(),
                         nn.Linear(2048, 10)).cuda()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch_size, 2048, device="cuda"),
            torch.randint(0, 10, (batch_size,), device="cuda"))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        x, y = make_batch(8)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return optimizer


def to_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_host(v) for v in value]
    return copy.deepcopy(value)


def trains_under_the_cap(model: nn.Module, optimizer: torch.optim.Optimizer,
                         batch_size: int) -> bool:
    """The oracle: two plain training steps with the process capped at BUDGET, on the model
    itself (a copy on the GPU would take room), put back from host copies afterwards."""
    weights, optimizer_state = to_host(model.state_dict()), to_host(optimizer.state_dict())
    grads = [to_host(p.grad) for p in model.parameters()]
    total = torch.cuda.get_device_properties(0).total_memory
    previous = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(BUDGET / total)
    try:
        for _ in range(2):
            x, y = make_batch(batch_size)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del x, y
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.set_per_process_memory_fraction(previous)
        model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad.to(param.device)
        torch.cuda.empty_cache()
    return True


def test_under_a_cuda_budget_find_batch_finds_the_exact_boundary():
    model = wide_mlp()
    optimizer = trained(model)
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget=BUDGET)
    assert report.device.startswith("cuda")
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert report.n_attempts <= 2 * math.log2(report.max_batch_size) + 2  # allocator rounding
    assert trains_under_the_cap(model, optimizer, report.max_batch_size)
    assert not trains_under_the_cap(model, optimizer, report.first_oom_batch_size)


def test_real_ooms_are_survived_and_memory_and_the_cap_come_back():
    model = wide_mlp()
    optimizer = trained(model)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    fraction = torch.cuda.get_per_process_memory_fraction()
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget=BUDGET)
    assert report.n_ooms >= 1
    assert all("out of memory" in a.error for a in report.attempts if not a.fits)
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.get_per_process_memory_fraction() == fraction
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(int(free * 0.8), dtype=torch.uint8, device="cuda")  # the cap is gone
    del big


def test_on_cuda_everything_is_restored_bit_for_bit_and_the_rngs_too():
    model = wide_mlp()
    optimizer = trained(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    rngs = (torch.get_rng_state(), torch.cuda.get_rng_state_all())
    model.eval()
    bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy, optimizer=optimizer,
                  budget=BUDGET)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    after = optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for key, values in state["state"].items():
        assert all(torch.equal(values[name], after["state"][key][name]) for name in values)
    assert torch.equal(rngs[0], torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(rngs[1], torch.cuda.get_rng_state_all()))
    assert not model.training


def test_a_bare_step_on_cuda_is_searched_by_its_real_ooms():
    def step(batch_size: int) -> None:
        torch.empty(batch_size * 2**20, dtype=torch.uint8, device="cuda")  # 1 MiB a sample

    report = bw.find_batch(step, budget="256MiB")
    assert report.device.startswith("cuda")
    assert 100 < report.max_batch_size < 256
    assert report.first_oom_batch_size == report.max_batch_size + 1


def test_a_cpu_model_probed_on_cuda_comes_back_to_the_cpu_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):  # optimizer state and gradients exist, on the CPU
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 256)),
                                    torch.randint(0, 10, (8,))).backward()
        optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    state = to_host(optimizer.state_dict())

    def cpu_batch(batch_size):
        return torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,))

    report = bw.find_batch(model, cpu_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, device="cuda", budget="512MiB",
                           max_batch_size=4096)
    assert report.device.startswith("cuda")
    assert report.max_batch_size > 8
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    after = optimizer.state_dict()
    for key, saved in state["state"].items():
        for name, value in saved.items():
            assert after["state"][key][name].device.type == "cpu"
            assert torch.equal(after["state"][key][name], value)


def test_a_live_loader_switches_pin_memory_on_cuda_and_leaves_no_pinning_thread():
    """Pinned batches after the switch, the same order as the plain DataLoader, copies made
    non_blocking; the pinning thread of each inner loader stops with its workers."""
    import threading
    import time

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(256, 1024), torch.arange(256))
    threads = threading.active_count()
    live = bw.live_loader(data, batch_size=16, shuffle=True,
                          generator=torch.Generator().manual_seed(0), num_workers=1)
    seen, pinned = [], []
    for i, (x, ids) in enumerate(live):
        seen.append(ids.tolist())
        pinned.append(x.is_pinned())
        x.cuda(non_blocking=True)
        if i == 3:
            live.set(pin_memory=True)
        if i == 9:
            live.set(pin_memory=False, num_workers=0)
    plain = DataLoader(data, batch_size=16, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    assert seen == [ids.tolist() for _, ids in plain]
    assert pinned == [False] * 4 + [True] * 6 + [False] * 6
    live.close()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10  # worker queues' feeder threads end a moment after close
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads
