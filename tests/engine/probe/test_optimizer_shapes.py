"""Optimizers fake tensors cannot step (issue 23, item 6): an 8-bit Adam that reads a value back,
an optimizer that calls .item(), one whose state is a custom object. Their state is learned from
one real step on a tiny copy and planned by shape: the same answer as a plan traced by real
steps, on a meta model too; what even a tiny copy cannot tell is one line naming optimizer=."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import batchwidgets as bw

CE = nn.functional.cross_entropy
BLOCK = 256


class Adam8bit(torch.optim.Optimizer):
    """Block-wise 8-bit Adam in plain PyTorch (the shape of bitsandbytes' Adam8bit): uint8
    moments with a float32 absmax per block of 256, and an overflow check read back to Python."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @staticmethod
    def _quantize(x):
        flat = x.reshape(-1).float()
        flat = nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK)).view(-1, BLOCK)
        absmax = flat.abs().amax(1).clamp_min(1e-12)
        if bool((absmax > 1e30).any()):  # a value read back: fake tensors cannot say
            raise FloatingPointError("moment overflow")
        q = (torch.round(flat / absmax[:, None] * 127) + 128).to(torch.uint8)
        return q.reshape(-1)[:x.numel()].clone(), absmax

    @staticmethod
    def _dequantize(q, absmax, like):
        flat = q.float() - 128
        flat = nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK)).view(-1, BLOCK)
        return (flat / 127 * absmax[:, None]).reshape(-1)[:like.numel()].view_as(like)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["m_absmax"] = self._quantize(torch.zeros_like(p))
                    state["v"], state["v_absmax"] = self._quantize(torch.zeros_like(p))
                state["step"] += 1
                grad = p.grad.float()
                m = self._dequantize(state["m"], state["m_absmax"], p).lerp_(grad, 1 - b1)
                v = self._dequantize(state["v"], state["v_absmax"], p).abs_().mul_(b2)
                v.addcmul_(grad, grad, value=1 - b2)
                denom = (v / (1 - b2 ** state["step"])).sqrt_().add_(group["eps"])
                p.add_((m / (1 - b1 ** state["step"]) / denom).to(p.dtype), alpha=-group["lr"])
                state["m"], state["m_absmax"] = self._quantize(m)
                state["v"], state["v_absmax"] = self._quantize(v)


class ClippingSGD(torch.optim.Optimizer):
    """SGD with momentum that reads the global gradient norm back with .item() each step."""

    def __init__(self, params, lr=0.1, momentum=0.9, max_norm=1.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "max_norm": max_norm})

    @torch.no_grad()
    def step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.norm() for g in grads]).norm().item()
        scale = min(1.0, self.defaults["max_norm"] / (norm + 1e-6))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad, alpha=scale)
                    p.add_(buf, alpha=-group["lr"])


class Moments:
    """A custom state object: the moments behind attributes, where no dict walk finds them."""

    def __init__(self, param):
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)


class ObjectAdam(torch.optim.Optimizer):
    """Adam whose state holds one Moments object per parameter."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    moments = self.state[p].setdefault("moments", Moments(p))
                    moments.exp_avg.lerp_(p.grad, 0.1)
                    moments.exp_avg_sq.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                    p.addcdiv_(moments.exp_avg, moments.exp_avg_sq.sqrt().add_(1e-8),
                               value=-group["lr"])


class FactoredItem(torch.optim.Optimizer):
    """Per-row state (Adafactor-like), and a value read back: neither fakes nor scales."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    rows = self.state[p].setdefault("rows", torch.zeros(p.shape[:1]))
                    rows.lerp_(p.grad.reshape(len(rows), -1).pow(2).mean(1), 0.1)
                    p.sub_(p.grad * group["lr"] / (rows.max().item() + 1e-8) ** 0.5)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def vectors(batch_size: int):
    return torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,))


def expected_state_bytes(optimizer: type, model: nn.Module) -> int:
    sizes = [p.numel() for p in model.parameters()]
    if optimizer is Adam8bit:  # two uint8 moments, a float32 absmax per block of each
        return sum(2 * n + 2 * 4 * math.ceil(n / BLOCK) for n in sizes)
    return sum(sizes) * 4 * (1 if optimizer is ClippingSGD else 2)


OPTIMIZERS = [Adam8bit, ClippingSGD, ObjectAdam]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_state_learned_on_a_tiny_copy_plans_what_real_steps_plan(optimizer):
    model = mlp()
    users = optimizer(model.parameters())
    fake = bw.find_batch(model, vectors, loss_fn=CE, optimizer=users, target="176MiB")
    real = bw.find_batch(model, vectors, loss_fn=CE, optimizer=users, target="176MiB",
                         trace="real")
    assert fake.trace == "fake"
    assert real.trace == "real"
    assert fake.max_batch_size == real.max_batch_size > 0
    assert fake.target_band == real.target_band
    assert f"Optimizer state planned by shape: {optimizer.__name__}'s " in fake.method
    # every state tensor counted, a custom object's too (a shallow fake copy counted it as 0)
    assert fake.memory_split.optimizer_bytes == pytest.approx(
        expected_state_bytes(optimizer, model), rel=0.01)  # at the peak, inside the step
    assert not users.state  # the user's optimizer was never stepped


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_meta_model_is_planned_with_them_as_the_same_model_on_the_cpu(optimizer):
    with torch.device("meta"):
        meta = mlp()
    planned = bw.find_batch(meta, vectors, loss_fn=CE, optimizer=optimizer(meta.parameters()),
                            target="176MiB")
    model = mlp()
    assert planned.max_batch_size == bw.find_batch(
        model, vectors, loss_fn=CE, optimizer=optimizer(model.parameters()),
        target="176MiB").max_batch_size > 0
    assert all(p.is_meta and p.grad is None for p in meta.parameters())


def test_the_method_says_what_the_state_holds_per_parameter():
    model = mlp()
    report = bw.find_batch(model, vectors, loss_fn=CE, optimizer=Adam8bit(model.parameters()),
                           target="176MiB")
    assert ("float32 rank 2: m n uint8, m_absmax n/256 float32, v n uint8, v_absmax n/256 "
            "float32") in report.method
    assert "x the bytes of each parameter, one at a time" in report.method


def test_state_held_before_the_plan_is_planned_too_and_left_as_it_was():
    model = mlp()
    users = ObjectAdam(model.parameters())
    CE(model(vectors(4)[0]), vectors(4)[1]).backward()
    users.step()
    users.zero_grad()
    moments = [users.state[p]["moments"].exp_avg.clone() for p in model.parameters()]
    fake = bw.find_batch(model, vectors, loss_fn=CE, optimizer=users, target="176MiB")
    real = bw.find_batch(model, vectors, loss_fn=CE, optimizer=users, target="176MiB",
                         trace="real")  # the moments counted from the start (they were not)
    assert fake.trace == "fake"
    assert fake.max_batch_size == real.max_batch_size > 0
    assert fake.memory_split.optimizer_bytes == real.memory_split.optimizer_bytes > 0
    assert all(torch.equal(users.state[p]["moments"].exp_avg, m)
               for p, m in zip(model.parameters(), moments))


def test_state_no_tiny_copy_can_scale_is_one_line_on_a_meta_model():
    with torch.device("meta"):
        meta = mlp()
    with pytest.raises(ValueError, match=r"^optimizer should") as info:
        bw.find_batch(meta, vectors, loss_fn=CE, optimizer=FactoredItem(meta.parameters()),
                      target="176MiB")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("optimizer should step on fake tensors, or on a tiny CPU copy, "
                              "to be planned without running, but FactoredItem's step cannot "
                              "run on fake tensors")
    assert "its state 'rows'" in message
    assert "optimizer=torch.optim.AdamW(" in message


def test_on_a_real_model_it_is_traced_by_real_steps_and_says_why():
    model = mlp()
    report = bw.find_batch(model, vectors, loss_fn=CE, optimizer=FactoredItem(model.parameters()),
                           target="176MiB")
    assert report.trace == "real"
    assert "Traced by real steps: optimizer should step on fake tensors" in report.method


def test_bitsandbytes_adam8bit_is_planned_as_real_steps_plan_it():
    """The real thing, where it installs (bitsandbytes >= 0.45 steps on the CPU): uint8 moments,
    float32 block scales and a fixed 256-entry quantization map per parameter; parameters under
    its 4096-element floor keep float32 moments, which the tiny copy (4096 and up) does not see:
    the state planned is that much lower (0.5% here), the answer the same."""
    bnb = pytest.importorskip("bitsandbytes")
    model = mlp()
    fake = bw.find_batch(model, vectors, loss_fn=CE, optimizer=bnb.optim.Adam8bit(
        model.parameters()), target="176MiB")
    real = bw.find_batch(model, vectors, loss_fn=CE, optimizer=bnb.optim.Adam8bit(
        model.parameters()), target="176MiB", trace="real")
    assert fake.trace == "fake"
    assert fake.max_batch_size == real.max_batch_size > 0
    assert fake.memory_split.optimizer_bytes == pytest.approx(
        real.memory_split.optimizer_bytes, rel=0.01)
    assert "qmap1 256 float32" in fake.method
