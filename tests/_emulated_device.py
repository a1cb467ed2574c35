"""An emulated device that disagrees with the probe's meter: it runs out of memory (raises
``torch.cuda.OutOfMemoryError``) once a batch passes ``edge`` samples, from inside the model's
forward, from inside its backward (an autograd Function, after the last layer's gradients are
made), or from inside the optimizer's step (after it updated every weight), while the probe's
budget allows far more. And the check that a model trains after find_batch exactly as one that
never met it. Shared by tests/engine/probe/test_device_disagrees.py and the jobs of
tests/engine/probe/test_ranks_fail_alone.py (whose workers import it by path)."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

WHERE = ("forward", "backward", "step")


def out_of_memory(size: int) -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB (emulated device, batch of {size})")


class _InBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, device):
        ctx.device = device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        device = ctx.device
        if device.where == "backward" and device.runs_out(len(grad)):
            raise out_of_memory(len(grad))
        return grad, None


class Device(nn.Module):
    """A layer that emulates the device: it runs out of memory past ``edge`` samples at ``where``
    (``"forward"``, ``"backward"``, ``"step"``: the step reads the last batch's size) while
    ``armed``; only on the rank ``failing`` (None: every rank); never in a fake trace."""

    def __init__(self, edge: int, where: str, failing: int | None = None) -> None:
        super().__init__()
        self.edge, self.where, self.failing = edge, where, failing
        self.last = 0
        self.armed = True
        self.fake = False

    def runs_out(self, size: int) -> bool:
        if not self.armed or size <= self.edge or self.fake:
            return False
        if self.failing is None or not torch.distributed.is_initialized():
            return True
        return torch.distributed.get_rank() == self.failing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake = isinstance(x, FakeTensor)  # a fake trace never meets the device
        self.last = len(x)
        if self.where == "forward" and self.runs_out(len(x)):
            raise out_of_memory(len(x))
        return _InBackward.apply(x, self) if self.where == "backward" else x


def net(device: Device, seed: int = 0) -> nn.Module:
    """A small MLP with the emulated device between its layers (the last layer's gradients are
    made, and DDP's bucket for them reduced, before it runs out in backward)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), device, nn.ReLU(),
                         nn.Linear(32, 4))


def step_runs_out(optimizer: torch.optim.Optimizer, device: Device) -> torch.optim.Optimizer:
    """``optimizer`` whose step runs out of memory after it updated every weight, at a size past
    the device's edge (a post-hook: the step's own state and counters changed already)."""
    def hook(optimizer, args, kwargs):
        if device.where == "step" and device.runs_out(device.last):
            raise out_of_memory(device.last)
    optimizer.register_step_post_hook(hook)
    return optimizer


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def batches(count: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=generator),
             torch.randint(0, 4, (size,), generator=generator)) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, scaler=None,
          amp: bool = False) -> None:
    """Steps of the user's own loop (under fp16 autocast and ``scaler`` with ``amp``)."""
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> list:
    """Weights, optimizer state and the scaler's scale, as host tensors (a shard's local part)."""
    tensors = [local(p).detach().clone() for p in model.parameters()]
    tensors += [local(v).detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
                for s in optimizer.state.values() for v in s.values()]
    if scaler is not None:
        tensors.append(scaler.get_scale() * torch.ones(1))
    return tensors


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
