"""A plan for a CUDA target models what the target's kernels keep, not what the CPU's keep:
dropout's bool mask, the attention backend of each call, the foreach optimizer step; and the
recorded H100 boundaries lie in the plan's band (NOTE [ The target's kernels ])."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import batchwidgets as bw
from batchwidgets.engine.memory._kernels import cuda_kernels, sdpa_backend


def _qkv(dtype=torch.float32, heads=4, kv_heads=4, rows=256, keys=256, size=32):
    return (torch.empty(2, heads, rows, size, dtype=dtype),
            torch.empty(2, kv_heads, keys, size, dtype=dtype),
            torch.empty(2, kv_heads, keys, size, dtype=dtype))


@pytest.mark.parametrize(("capability", "dtype", "mask", "causal", "size", "expected"), [
    ((9, 0), torch.float32, False, False, 32, "efficient"),  # flash takes half types only
    ((9, 0), torch.bfloat16, False, False, 32, "flash"),
    ((8, 0), torch.bfloat16, True, False, 32, "efficient"),  # flash takes no mask
    ((8, 0), torch.float32, False, False, 6, "math"),  # head size not a multiple of 4
    ((7, 5), torch.bfloat16, False, False, 32, "math"),  # no bf16 before Ampere
    ((7, 5), torch.float16, False, True, 32, "efficient"),  # no flash before Ampere
    ((8, 6), torch.bfloat16, False, False, 256, "efficient"),  # flash backward: head <= 192
])
def test_the_attention_backend_follows_cudas_rules(capability, dtype, mask, causal, size,
                                                   expected):
    q, k, v = _qkv(dtype, size=size)
    q.requires_grad_()
    attn_mask = torch.ones(256, 256, dtype=torch.bool) if mask else None
    assert sdpa_backend(capability, q, k, v, attn_mask, 0.1, causal) == expected


def test_the_attention_backend_honours_the_users_backend_choice_and_gqa():
    q, k, v = _qkv(torch.bfloat16, heads=8, kv_heads=2)
    assert sdpa_backend((9, 0), q, k, v, None, 0.0, False) == "math"  # heads differ
    assert sdpa_backend((9, 0), q, k, v, None, 0.0, False, enable_gqa=True) == "flash"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert sdpa_backend((9, 0), q, k, v, None, 0.0, False, enable_gqa=True) == "efficient"


class Encoder(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _plan_at(length: int, target: str) -> int:
    torch.manual_seed(0)
    return bw.find_batch(Encoder(), lambda b: (torch.randint(0, 100, (b, length)),
                                               torch.randint(0, 10, (b,))),
                         loss_fn=F.cross_entropy, target=target).max_batch_size


def test_fused_attention_keeps_no_square_matrix_so_a_plan_scales_with_the_length():
    # the CPU runs the math path here (dropout), keeping L x L scores three times over; an
    # A100's memory-efficient kernel keeps the output and a row of statistics: twice the length,
    # half the batch
    assert _plan_at(512, "A100-80GB") == pytest.approx(2 * _plan_at(1024, "A100-80GB"), rel=0.01)


class Dropped(nn.Module):
    """An MLP whose dropout is given: the same step, its mask kept as ``dropout`` keeps it."""

    def __init__(self, dropout) -> None:
        super().__init__()
        self.first, self.second, self.dropout = nn.Linear(256, 2048), nn.Linear(2048, 10), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.dropout(F.relu(self.first(x))))


def _plan_mlp(dropout) -> int:
    torch.manual_seed(0)
    model = Dropped(dropout)
    return bw.find_batch(model, lambda b: (torch.randn(b, 256), torch.randint(0, 10, (b,))),
                         loss_fn=F.cross_entropy, target="1GiB", keep_output=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).max_batch_size


def test_dropout_on_a_target_keeps_cudas_bool_mask_not_the_cpus_float_noise():
    fused = _plan_mlp(lambda x: torch.native_dropout(x, 0.5, True)[0])  # CUDA's kernel itself
    float_noise = _plan_mlp(lambda x: x * torch.empty_like(x).bernoulli_(0.5) / 0.5)  # the CPU's
    assert _plan_mlp(nn.Dropout(0.5)) == fused > float_noise


def test_a_targets_optimizer_takes_the_foreach_step_and_the_users_groups_stay_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters())
    report = bw.find_batch(model, lambda b: (torch.randn(b, 512), torch.randint(0, 512, (b,))),
                           loss_fn=F.cross_entropy, optimizer=optimizer, target="A100-80GB")
    weights = sum(p.numel() * 4 for p in model.parameters())
    peak_at_one = dict(report.target_peaks)[1]
    # weights, gradients, two moments and the sqrt of every exp_avg_sq at once (foreach); the
    # per-parameter loop of the CPU would hold one layer's sqrt
    assert peak_at_one >= 5 * weights
    assert "_foreach_sqrt" in report.peak_segments[0].where
    assert [group["foreach"] for group in optimizer.param_groups] == [None]


def test_the_target_functions_act_on_the_plans_thread_only_and_come_back():
    originals = (F.scaled_dot_product_attention, F.dropout, torch.dropout)
    q = torch.randn(1, 2, 8, 16)
    seen = {}
    with cuda_kernels((9, 0)):
        seen["here"] = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        worker = threading.Thread(target=lambda: seen.update(
            there=F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)))
        worker.start()
        worker.join()
    assert not seen["here"].any()  # the plan's stand-in: zeros, the numbers are never read
    torch.testing.assert_close(seen["there"], F.scaled_dot_product_attention(q, q, q))
    assert (F.scaled_dot_product_attention, F.dropout, torch.dropout) == originals


def wide_cnn() -> nn.Module:  # benchmarks/probe_vs_peers.py's CUDA workloads
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(256, 10))


class LongEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        self.position = nn.Parameter(torch.zeros(256, 128))
        layer = nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))


H100_TRUTHS = {  # benchmarks/results/probe_vs_peers_cuda.json: an H100 capped at 8 GiB, torch 2.11
    "wide CNN": (wide_cnn, lambda b: (torch.randn(b, 3, 64, 64), torch.randint(0, 10, (b,))), 641),
    "encoder": (LongEncoder, lambda b: (torch.randint(0, 1000, (b, 256)),
                                        torch.randint(0, 10, (b,))), 784),
}


@pytest.mark.parametrize(("build", "make_batch", "truth"), H100_TRUTHS.values(),
                         ids=H100_TRUTHS.keys())
def test_the_recorded_h100_boundaries_lie_in_the_plans_band(build, make_batch, truth):
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = make_batch(2)  # the benchmark's warm-up step: Adam's state exists
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    report = bw.find_batch(model, make_batch, loss_fn=F.cross_entropy, optimizer=optimizer,
                           target="8GiB")
    low, high = report.target_band
    assert low <= truth <= high
    assert truth - 2 <= report.max_batch_size <= 1.05 * truth  # the encoder's: 4% above
    assert report.recommended_batch_size < truth


def test_the_foreach_step_is_the_plans_thread_only():
    seen = {}
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([param])

    def record(opt, args, kwargs) -> None:  # runs after the global hooks
        seen[threading.get_ident()] = opt.param_groups[0]["foreach"]

    optimizer.register_step_pre_hook(record)

    def step() -> None:
        param.grad = torch.ones(3)
        optimizer.step()

    with cuda_kernels((9, 0)):
        step()
        worker = threading.Thread(target=step)
        worker.start()
        worker.join()
    assert seen == {threading.get_ident(): True, worker.ident: None}
    assert optimizer.param_groups[0]["foreach"] is None
