"""Plans for N GPUs from one process (issue 25): find_batch(..., target="4x1GiB", parallel=...)
gives the per-rank batch under each strategy from one fake trace, the global batch, one rank's
memory split, and one-line errors for parallel= without GPUs to share."""

from __future__ import annotations

import pytest
import torch
import transformers
from _plan_factories import llama_tokens, meta_llama
from torch import nn

import batchwidgets as bw


def wide_mlp(device: str = "meta") -> nn.Module:
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 134 MB of fp32


X = torch.zeros(2048)


def plan(target: str, parallel: str | None, model: nn.Module | None = None):
    return bw.find_batch(model or wide_mlp(), X, target=target, parallel=parallel,
                         max_batch_size=2**16)


def test_sharding_more_state_fits_a_larger_batch_per_rank():
    report = plan("4x1GiB", "compare")
    batch = {row.parallel: row.max_batch_size for row in report.parallel_plans}
    assert 0 < batch["ddp"] < batch["zero1"] < batch["zero2"] < batch["fsdp"]
    assert report.parallel == "fsdp"
    assert report.max_batch_size == batch["fsdp"]
    assert report.world_size == 4
    assert report.global_batch_size == 4 * report.max_batch_size


def test_each_rank_holds_its_strategys_share_of_the_states():
    rows = {row.parallel: row for row in plan("4x1GiB", "ddp").parallel_plans}
    weights = sum(p.numel() * 4 for p in wide_mlp().parameters())
    ddp, zero1, zero3 = rows["ddp"], rows["zero1"], rows["zero3"]
    assert ddp.parameters_bytes == weights
    assert ddp.communication_bytes == weights
    assert zero1.optimizer_bytes == pytest.approx(ddp.optimizer_bytes / 4, abs=4)
    assert zero1.parameters_bytes == weights
    assert zero3.parameters_bytes == pytest.approx(weights / 4, abs=4)
    assert rows["fsdp"].communication_bytes < zero3.communication_bytes  # blocks, not buckets
    # every gradient after backward, its shard from ZeRO-2 on
    assert ddp.gradients_bytes == zero1.gradients_bytes == weights
    for name in ("zero2", "zero3", "fsdp"):
        assert rows[name].gradients_bytes == pytest.approx(weights / 4, abs=4)
    # the activations at each row's answer: the same per sample under every strategy
    per_sample = [row.activations_bytes / row.max_batch_size for row in rows.values()]
    assert min(per_sample) > 0
    assert max(per_sample) == pytest.approx(min(per_sample), rel=0.01)


def test_an_llms_rows_hold_its_gradients_though_its_peak_comes_before_them():
    # a Llama's peak is in its forward (the logits), where no gradient exists yet
    model = meta_llama(128, 2, 344, 4000)
    report = bw.find_batch(model, llama_tokens(4000, 128), target="4x1GiB", parallel="compare")
    assert report.memory_split.gradients_bytes == 0  # at the peak
    trained = sum(p.numel() * 4 for p in model.parameters())
    rows = {row.parallel: row for row in report.parallel_plans}
    assert rows["ddp"].gradients_bytes == trained
    assert rows["zero2"].gradients_bytes == pytest.approx(trained / 4, abs=4)


def test_report_is_per_rank_and_names_the_global_batch():
    report = plan("4x1GiB", "zero2")
    assert report.parallel == "zero2"
    assert report.target == "1GiB"
    assert report.memory_split.communication_bytes > 0
    summary = report.summary()
    assert "per rank" in summary
    assert "4x1GiB" in summary
    assert f"global_batch_size={report.global_batch_size}" in summary
    assert "strategies on 4x1GiB" in report._repr_html_()


def test_a_count_without_parallel_plans_ddp():
    report = bw.find_batch(wide_mlp(), X, target="2x1GiB", max_batch_size=4096)
    assert (report.parallel, report.world_size) == ("ddp", 2)


def test_nothing_fits_under_ddp_names_the_strategies_that_would():
    with pytest.raises(bw.NoBatchSizeFits) as caught:
        plan("4x600MiB", "ddp")
    message = str(caught.value)
    assert "parallel='ddp'" in message
    assert "4x600MiB" in message
    assert "parallel='fsdp'" in message
    assert "parallel='zero1'" in message  # 134 MB of weights, gradients, DDP's buckets: it fits


@pytest.mark.parametrize(("target", "parallel", "match"), [
    ("A100-80GB", "fsdp", "target='8xA100-80GB'"),
    (None, "ddp", "target='8xA100-80GB'"),
    ("4xA100-80GB", "zero4", "'zero3'"),
])
def test_parallel_without_gpus_to_share_is_one_line(target, parallel, match):
    with pytest.raises(ValueError, match=match) as caught:
        bw.find_batch(wide_mlp("cpu"), X, target=target, parallel=parallel)
    assert "\n" not in str(caught.value)
    assert "parallel" in str(caught.value)


def test_plan_leaves_a_real_model_as_it_was():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    report = bw.find_batch(model, torch.zeros(64), target="2x256MiB", parallel="fsdp",
                           max_batch_size=1024)
    assert report.world_size == 2
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_plan_inside_a_process_group_takes_its_world_size(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                                         rank=0, world_size=1)
    try:
        report = bw.find_batch(wide_mlp(), X, target="1GiB", parallel="zero3",
                               max_batch_size=4096)
    finally:
        torch.distributed.destroy_process_group()
    assert (report.world_size, report.parallel) == (1, "zero3")


# -- one FSDP2 rank traced on a fake process group; each storage's share on a rank ------------
def mlp(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))


def cpu_plan(parallel: str, world_size: int = 2, model: nn.Module | None = None, **options):
    model = model or mlp()
    return bw.find_batch(model, lambda n: (torch.zeros(n, 256), torch.zeros(n, dtype=torch.long)),
                         loss_fn=nn.functional.cross_entropy,
                         optimizer=torch.optim.AdamW(model.parameters()), budget="16MiB",
                         target=f"{world_size}xCPU", parallel=parallel, **options)


# torch 2.4.1 to 2.7.1 (.ci/floor) stop FSDP2 on the fake group with c10d's "Not implemented":
# there the plan takes FSDP2's published rules and says why
TRACED_FSDP2 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


def test_fsdp_is_traced_on_one_rank_of_a_fake_process_group_and_leaves_none_behind():
    model = mlp("meta")
    report = cpu_plan("fsdp", model=model)
    if TRACED_FSDP2:
        assert "One FSDP2 rank of 2 traced on a fake process group" in report.method
    else:
        assert "FSDP2 planned by its published rules: one FSDP2 rank could not be traced" \
            in report.method
    assert not torch.distributed.is_initialized()
    assert all(type(p) is nn.Parameter and p.is_meta for p in model.parameters())
    assert report.target == "CPU"
    assert report.limit_bytes == 16 * 2**20
    assert report.predict_peak_bytes(report.max_batch_size) <= 16 * 2**20
    assert report.predict_peak_bytes(report.max_batch_size + 1) > 16 * 2**20


def test_a_rank_holds_less_the_more_its_strategy_shards():
    report = cpu_plan("compare", world_size=4)
    batch = {row.parallel: row.max_batch_size for row in report.parallel_plans}
    assert 0 < batch["ddp"] < batch["zero1"] < batch["zero2"]
    assert batch["fsdp"] > batch["ddp"]
    # a rank's optimizer share is the largest rank's when whole parameters are dealt out
    rows = {row.parallel: row for row in report.parallel_plans}
    largest = 512 * 512 + 512  # the 512x512 weight alone on a rank (of 4) is the most state
    total = sum(p.numel() for p in mlp().parameters())
    assert rows["zero1"].optimizer_bytes == pytest.approx(
        rows["ddp"].optimizer_bytes * 512 * 512 / total, rel=0.01)
    assert largest > total / 4


def test_more_ranks_shard_more_of_the_state():
    # (not ZeRO-1/2 here: the 512x512 weight's state alone is the largest rank's, at 2 and 4)
    two, four = cpu_plan("fsdp", 2), cpu_plan("fsdp", 4)
    assert four.max_batch_size > two.max_batch_size
    assert (two.world_size, four.world_size) == (2, 4)
    assert four.global_batch_size == 4 * four.max_batch_size


def test_a_cpu_target_needs_the_budget_of_each_process():
    with pytest.raises(ValueError, match="budget") as caught:
        bw.find_batch(mlp(), torch.zeros(256), target="2xCPU", parallel="ddp")
    assert "\n" not in str(caught.value)
    assert "target='4xCPU'" in str(caught.value)


def test_a_model_fully_shard_cannot_wrap_is_one_line_naming_the_fix():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.tensor(2.0))  # FSDP2 shards no scalar

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.scale

    with pytest.raises(ValueError, match="fully_shard") as caught:
        bw.find_batch(Scaled(), torch.zeros(8), target="2x1GiB", parallel="fsdp",
                      max_batch_size=64)
    assert "\n" not in str(caught.value)
    assert "parallel='zero3'" in str(caught.value)
    assert not torch.distributed.is_initialized()
    report = bw.find_batch(Scaled(), torch.zeros(8), target="2x1GiB", parallel="compare",
                           max_batch_size=64)  # compare plans FSDP2 by its rules then
    assert "FSDP2 planned by its published rules: fully_shard cannot wrap" in report.method


def test_a_zero_stage_never_plans_below_the_stage_it_holds_less_than():
    # A GPT-2's cut optimizer state once fragmented the allocator replay: ZeRO-1 41, DDP 42
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())

    def tokens(batch_size: int) -> dict:
        ids = torch.randint(0, 50257, (batch_size, 1024))
        return {"input_ids": ids, "labels": ids}

    report = bw.find_batch(model, tokens, target="8xA100-80GB", parallel="zero1")
    batch = {row.parallel: row.max_batch_size for row in report.parallel_plans}
    assert 0 < batch["ddp"] <= batch["zero1"] <= batch["zero2"]
    assert report.max_batch_size == batch["zero1"]
    assert report.predict_peak_bytes(report.max_batch_size) <= report.limit_bytes
    assert report.predict_peak_bytes(report.max_batch_size + 1) > report.limit_bytes
    rows = {row.parallel: row for row in report.parallel_plans}
    assert rows["zero1"].optimizer_bytes < rows["ddp"].optimizer_bytes  # its own states
