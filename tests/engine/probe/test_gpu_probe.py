"""This round's CUDA paths on a real GPU (skipped without one): the per-op model replayed through
the caching allocator's model finds the capped boundary in a handful of sizes, the memory split
adds up, the frontier holds at each length, and a target prediction made on the CPU is compared
with the real capped boundary. The figures are what benchmarks/results records when a GPU is
lent."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw

pytestmark = pytest.mark.gpu
MIB = 2**20


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(128, 10))


def images(device: str):
    def make(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(batch_size, 3, 64, 64, device=device),
                torch.randint(0, 10, (batch_size,), device=device))
    return make


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30522, 128)
        self.layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
        self.head = nn.Linear(128, 30522)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(ids)))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_the_cuda_search_takes_a_handful_of_sizes_under_a_cap():
    model = cnn().cuda()
    report = bw.find_batch(model, images("cuda"), loss_fn=F.cross_entropy, budget="2GiB")
    assert report.first_oom_batch_size == report.max_batch_size + 1
    assert report.n_attempts <= 6
    assert report.n_ooms <= 2
    assert "per-op model" in report.method


def test_the_memory_split_on_cuda_adds_up_to_the_traced_peak():
    model = cnn().cuda()
    report = bw.find_batch(model, images("cuda"), loss_fn=F.cross_entropy, budget="2GiB")
    split = report.memory_split
    assert split is not None
    assert split.parameters_bytes == sum(p.numel() * p.element_size() for p in model.parameters()
                                         ) + sum(b.numel() * b.element_size()
                                                 for b in model.buffers())
    assert split.activations_bytes > 0


def test_the_frontier_on_cuda_is_verified_at_each_length():
    model = TokenModel().cuda()

    def tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 30522, (batch_size, seq_len), device="cuda")
        return ids, ids

    report = bw.find_batch(model, tokens, loss_fn=lm_loss, budget="4GiB", seq_len=[64, 128, 256])
    assert list(report.frontier) == [64, 128, 256]
    assert report.frontier[64] >= report.frontier[128] >= report.frontier[256] > 0


def test_a_target_predicted_on_the_cpu_against_the_real_capped_boundary():
    cpu_model = cnn()
    planned = bw.find_batch(cpu_model, images("cpu"), loss_fn=F.cross_entropy, target="2GiB")
    measured = bw.find_batch(cnn().cuda(), images("cuda"), loss_fn=F.cross_entropy,
                             budget="2GiB")
    ratio = planned.max_batch_size / measured.max_batch_size
    print(f"predicted {planned.max_batch_size}, real {measured.max_batch_size}, ratio {ratio:.3f}")
    assert 0.8 <= ratio <= 1.01
