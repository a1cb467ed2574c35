"""NoBatchSizeFits's advice is computed from the model and the call (issue 46): nothing is
suggested that is already so (bf16 on a bf16 model, checkpointing where it is on, freezing a
frozen base, a smaller micro-batch at batch size 1), sizes come back in the user's units, every
sentence parses, and the op named is the user's module's, never a profiler's."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import batchwidgets as bw


class Wide(nn.Module):
    """Small weights, large activations: one sample's step holds ~1.6 MB, its states ~1 KiB."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8, dtype=dtype) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        wide = x.unsqueeze(-1).expand(-1, -1, 50_000) * 2.0  # saved for the backward of exp
        return wide.exp().mean(-1)


class Heavy(nn.Module):
    """Weights of 1 MiB (fp32): with AdamW the states alone are 4 MiB."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256, dtype=dtype) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def checkpointed(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                          use_reentrant=False)
    return model


def frozen_base(model: nn.Module) -> nn.Module:
    for p in model.layers[:3].parameters():
        p.requires_grad_(False)
    return model


def refused(model: nn.Module, features: int, **options) -> str:
    dtype = next(model.parameters()).dtype
    with pytest.raises(bw.NoBatchSizeFits) as info:
        bw.find_batch(model, torch.randn(features, dtype=dtype), device="cpu", cache=False,
                      loss_fn=lambda out: out.float().square().mean(), **options)
    return str(info.value)


AMP = "amp='bf16'"
CHECKPOINT = "activation checkpointing"
FREEZE = "freezing the base weights"
BF16_WEIGHTS = "model.to(torch.bfloat16)"
MICRO = "a smaller micro-batch"
SGD = "an optimizer with less state"

CASES = {  # name: (model, input features, options, said, never said)
    "fp32, one sample over the budget": (
        Wide, 8, {"budget": "1MiB"}, [AMP, CHECKPOINT, "a budget of 1.0 MiB"],
        [MICRO, "states alone"]),
    "bf16 weights": (
        lambda: Wide(torch.bfloat16), 8, {"budget": "1MiB"}, [CHECKPOINT],
        [AMP, "bf16", MICRO]),
    "under autocast already": (
        Wide, 8, {"budget": "1MiB", "amp": "bf16"}, [CHECKPOINT], [AMP, MICRO]),
    "checkpointed": (
        lambda: checkpointed(Wide()), 8, {"budget": "1MiB"}, [AMP], [CHECKPOINT, MICRO]),
    "states alone over a decimal budget": (
        Heavy, 256, {"budget": "2MB"},
        ["states alone (weights 1.1 MB, gradients 1.1 MB, optimizer state 2.1 MB) need 4.2 MB",
         BF16_WEIGHTS, FREEZE, SGD],
        [CHECKPOINT, AMP, MICRO, "MiB"]),
    "frozen base, plain SGD": (
        lambda: frozen_base(Heavy()), 256,
        {"budget": "256KiB", "optimizer": "sgd"},
        ["a budget of 256.0 KiB", BF16_WEIGHTS], [FREEZE, SGD, MICRO, " KB", " MB"]),
    "bf16 frozen base": (
        lambda: frozen_base(Heavy(torch.bfloat16)), 256, {"budget": "128KiB"},
        [SGD], [FREEZE, BF16_WEIGHTS, AMP, MICRO]),
    "multiple_of above one": (
        Wide, 8, {"budget": "1MiB", "multiple_of": 8}, ["a smaller micro-batch than 8"], []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_advice_names_only_what_the_model_and_the_call_are_not_already(case):
    make, features, options, said, never = CASES[case]
    model = make()
    if options.get("optimizer") == "sgd":
        options = {**options, "optimizer": torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1)}
    message = refused(model, features, **options)
    for words in said:
        assert words in message, (words, message)
    for words in never:
        assert words not in message, (words, message)
    assert "\n" not in message
    try_line = message.split(" Try ", 1)[1].split(" Last error:")[0]
    assert try_line.endswith(".")
    assert ", or " not in try_line


def test_a_target_capped_in_mib_is_said_in_mib_in_sentences_that_parse():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB of weights
    with pytest.raises(bw.NoBatchSizeFits) as info:  # 32 MiB a layer for one sample
        bw.find_batch(model, lambda n: (torch.randn(n, 8192, 1024), torch.randn(n, 8192, 1024)),
                      loss_fn=nn.functional.mse_loss, target="T4@256MiB")
    message = str(info.value)
    assert "256.0 MiB usable" in message
    assert not re.search(r"\d (GB|MB|KB)\b", message), message  # the cap was given in MiB
    assert "states alone" not in message  # 64 MiB fit in 256
    assert re.search(r"the model's states \(weights 16\.0 MiB, [^)]*\) take [\d.]+ MiB of the "
                     r"256\.0 MiB usable, and one sample's step needs more than the [\d.]+ MiB "
                     r"left beside them", message), message
    assert "leave, of" not in message
    assert MICRO not in message  # batch size 1 did not fit: no smaller one


def test_a_target_where_the_states_alone_do_not_fit_names_only_what_shrinks_them():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096, dtype=torch.bfloat16)
                                for _ in range(40)])
    for p in model[:39].parameters():
        p.requires_grad_(False)
    with pytest.raises(bw.NoBatchSizeFits) as info:
        bw.find_batch(model, lambda n: (torch.randn(n, 4096, dtype=torch.bfloat16),
                                        torch.randn(n, 4096, dtype=torch.bfloat16)),
                      loss_fn=nn.functional.mse_loss, target="1GiB")
    message = str(info.value)
    assert "states alone" in message
    assert "more than the 1.0 GiB usable" in message
    for words in (BF16_WEIGHTS, FREEZE, AMP, CHECKPOINT, MICRO):
        assert words not in message, (words, message)
    assert "more GPUs that shard the states" in message


class Profiled(Wide):
    """A forward inside a profiler's record_function, as Lightning runs its hooks: the op that
    crosses the budget runs inside it, and the function's exit runs as the error unwinds."""

    def forward(self, x):
        with torch.profiler.record_function("training_step"):
            return super().forward(x)


def test_the_op_named_is_the_users_module_never_the_profilers():
    message = refused(Profiled(), 8, budget="1MiB")
    last = message.split("Last error: ", 1)[1]
    assert "profiler" not in last, last
    assert "tried to allocate 0 bytes" not in last
    assert "after Profiled forward, at aten." in last, last


@pytest.mark.parametrize(("target", "suggested"), [("1xT4", "'8xT4'"), ("T4", "'8xT4'"),
                                                   ("1x1GiB", "'8x1GiB'")])
def test_a_parallel_plan_for_one_gpu_suggests_a_target_that_parses(target, suggested):
    with pytest.raises(ValueError, match="should come with more than one GPU") as error:
        bw.find_batch(Wide(), lambda n: torch.randn(n, 8), target=target, parallel="fsdp")
    message = str(error.value)
    assert f"e.g. target={suggested}" in message
    fixed = re.search(r"e\.g\. target='([^']+)'", message).group(1)
    assert bw.find_batch(Wide(), lambda n: torch.randn(n, 8), target=fixed, parallel="fsdp",
                         max_batch_size=8, cache=False).world_size == 8  # it plans
