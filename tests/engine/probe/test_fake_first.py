"""A local probe searches on fake tensors first (issue 23, NOTE [ A free first guess ] in
probe/_probe.py): its small sizes cost no step, its first real size is the edge, and the answer
rests on two real steps there, exact against an independent oracle, on models the search was
not tuned on too."""

from __future__ import annotations

import copy

import pytest
import torch
from _oracles import fits_on_a_fresh_device
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine.memory import BudgetExceededError, TensorMemoryTracker
from batchwidgets.engine.memory._simulated import simulated_cuda

MIB = 2**20


def fits_under_budget(model: nn.Module, make, batch_size: int, budget: int,
                      loss_fn=None) -> bool:
    """The oracle: two iterations of a plain AdamW loop on a copy, the live tensor bytes
    (weights included) under ``budget``, counted by the tracker alone; the loop's variables
    live as a loop's do (the output until the next forward has returned)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        with TensorMemoryTracker("cpu", budget, [*model.parameters(), *model.buffers()]):
            for _ in range(2):
                batch = None  # a loader's loop lets the device's last batch go first
                batch = make(batch_size)
                if isinstance(batch, dict):
                    out = model(**batch)
                    loss = out.loss
                else:
                    out = model(batch[0])
                    loss = loss_fn(out, batch[1])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del batch, out, loss
    except BudgetExceededError:
        return False
    return True


def assert_real_steps_only_at_the_edge(report: bw.BatchSizeReport) -> None:
    fake = [a for a in report.attempts if a.fake]
    real = [a for a in report.attempts if not a.fake]
    assert [a.batch_size for a in fake[:2]] == [2, 4]  # the small sizes: traced, not run
    assert all(a.step_time_s is None for a in fake)
    assert report.attempts[:len(fake)] == tuple(fake)  # every fake trial before any real one
    assert len(real) <= 3
    assert sum(not a.fits for a in real) <= 1
    assert real[0].batch_size >= report.max_batch_size - 1  # the first real size is the edge
    assert report.trace == "real"  # the answer rests on real steps
    assert "Traced first on fake tensors" in report.method


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def images(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))


def test_the_real_steps_run_only_at_the_edge_a_fake_search_found():
    model = mlp()
    budget = 2 * MIB
    report = bw.find_batch(model, images, loss_fn=F.cross_entropy, budget=budget)
    assert_real_steps_only_at_the_edge(report)
    assert [a.batch_size for a in report.attempts if not a.fake] == [
        report.max_batch_size, report.max_batch_size + 1]
    assert fits_under_budget(model, images, report.max_batch_size, budget, F.cross_entropy)
    assert not fits_under_budget(model, images, report.max_batch_size + 1, budget,
                                 F.cross_entropy)
    real = bw.find_batch(model, images, loss_fn=F.cross_entropy, budget=budget, trace="real")
    assert not any(a.fake for a in real.attempts)  # trace="real": real steps only
    assert real.max_batch_size == report.max_batch_size


def test_the_fake_search_changes_nothing_of_the_users():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = images(4)  # a step: Adam has state, and the model holds gradients
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict()["state"])
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with pytest.warns(bw.BatchwidgetsWarning, match="held gradients"):
        report = bw.find_batch(model, images, loss_fn=F.cross_entropy, optimizer=optimizer,
                               budget=2 * MIB)
    assert_real_steps_only_at_the_edge(report)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name])
    for key, value in optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, state[key][name])
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert model.training


class Encoder(nn.Module):
    """An embedding, two PyTorch encoder layers (dropout on), a classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1000, 48)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(48, 4, 96, batch_first=True), 2, enable_nested_tensor=False)
        self.head = nn.Linear(48, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


def token_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (batch_size, 24)), torch.randint(0, 10, (batch_size,))


def test_a_transformer_encoder_it_was_not_tuned_on_is_exact_in_two_or_three_real_sizes():
    model = Encoder()
    budget = 6 * MIB
    report = bw.find_batch(model, token_batch, loss_fn=F.cross_entropy, budget=budget)
    assert_real_steps_only_at_the_edge(report)
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert fits_under_budget(model, token_batch, report.max_batch_size, budget, F.cross_entropy)
    assert not fits_under_budget(model, token_batch, report.max_batch_size + 1, budget,
                                 F.cross_entropy)


def test_a_bert_from_its_config_fed_dict_batches_is_exact_in_two_or_three_real_sizes():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=2000, hidden_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=96,
                                     max_position_embeddings=64)
    model = transformers.BertForMaskedLM(config)

    def batch(batch_size: int) -> dict:
        ids = torch.randint(0, 2000, (batch_size, 20),
                            generator=torch.Generator().manual_seed(batch_size))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    budget = 12 * MIB
    report = bw.find_batch(model, batch, budget=budget)
    assert_real_steps_only_at_the_edge(report)
    assert fits_under_budget(model, batch, report.max_batch_size, budget)
    assert not fits_under_budget(model, batch, report.max_batch_size + 1, budget)


def test_on_the_simulated_cuda_device_the_fake_search_places_the_real_steps_at_the_edge():
    model = Encoder()
    budget = 24 * MIB
    with simulated_cuda():
        report = bw.find_batch(model, token_batch, loss_fn=F.cross_entropy,
                               optimizer=torch.optim.Adam(model.parameters()), budget=budget)
    assert_real_steps_only_at_the_edge(report)
    assert "caching allocator" in report.method
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert fits_on_a_fresh_device(Encoder, token_batch, report.max_batch_size, budget)
    assert not fits_on_a_fresh_device(Encoder, token_batch,
                                                report.max_batch_size + 1, budget)


class ReadsBack(nn.Module):
    """Reads a value back to Python in its forward: fake tensors have none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / max(1.0, float(x.abs().max()))


def test_a_step_fake_tensors_cannot_run_is_searched_by_real_steps_and_the_report_says_why():
    budget = 3 * MIB
    report = bw.find_batch(ReadsBack(), images, loss_fn=F.cross_entropy, budget=budget)
    assert "No fake trace first" in report.method
    assert "cannot run on fake tensors" in report.method
    assert not any(a.fake for a in report.attempts)
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert report.max_batch_size == bw.find_batch(ReadsBack(), images, loss_fn=F.cross_entropy,
                                                  budget=budget, trace="real").max_batch_size


def test_a_step_of_your_own_runs_real_steps_only_and_the_report_says_why():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch_size: int) -> None:
        x, y = images(batch_size)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    report = bw.find_batch(model, step=step, optimizer=optimizer, budget=3 * MIB)
    assert not any(a.fake for a in report.attempts)
    assert "No fake trace first: a step(batch_size) of your own" in report.method
