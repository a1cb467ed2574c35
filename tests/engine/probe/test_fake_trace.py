"""Plans without running (issue 23, first part): target plans traced on fake tensors agree with
the same plans traced by real steps, models built on the meta device are planned without a
weight, frozen parameters hold no gradient or optimizer state, and what fake tensors cannot run
falls back to real steps, or is one line on a meta model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from _oracles import pad_text
from torch import nn

import batchwidgets as bw

CE = nn.functional.cross_entropy


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def vectors(batch_size: int):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


def images(batch_size: int):
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def tokens(batch_size: int):
    return torch.randn(batch_size, 64, 64), torch.randint(0, 4, (batch_size,))


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=256)


def lm_batch(batch_size: int):
    ids = torch.randint(0, 1000, (batch_size, 64))
    return {"input_ids": ids, "labels": ids}


CASES = {
    "mlp": (mlp, vectors, CE, "2GiB"),
    "cnn with batchnorm": (cnn, images, CE, "T4"),
    "encoder (sdpa)": (Encoder, tokens, CE, "A100-40GB"),
    "llama dict batches": (lambda: transformers.LlamaForCausalLM(llama_config()), lm_batch, None,
                           "T4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fake_trace_plans_what_a_real_trace_plans(case):
    build, make_batch, loss_fn, target = CASES[case]
    real = bw.find_batch(build(), make_batch, loss_fn=loss_fn, target=target, trace="real")
    fake = bw.find_batch(build(), make_batch, loss_fn=loss_fn, target=target)
    assert fake.trace == "fake"
    assert real.trace == "real"
    assert fake.max_batch_size == real.max_batch_size > 0
    assert fake.target_band == real.target_band
    assert [a.fake for a in fake.attempts] == [True, True]
    assert [a.fake for a in real.attempts] == [False, False]
    assert all(a.step_time_s is None for a in fake.attempts)  # nothing ran
    assert "fake trace" in fake.summary()


def test_padded_text_from_a_dataloader_is_planned_on_a_fake_trace_as_on_a_real_one():
    # the samples' real tensors went into fake ops one by one: traces of two sizes never lined
    # up and the plan doubled to its ceiling (NOTE [ The batch is made on real tensors ])
    generator = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(0, 500, (int(n),), generator=generator),
              "labels": torch.tensor(int(n) % 2)}
             for n in torch.randint(8, 64, (64,), generator=generator)]
    loader = torch.utils.data.DataLoader(items, batch_size=16, collate_fn=pad_text)
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    fake = bw.find_batch(model, loader, target="T4")
    real = bw.find_batch(model, loader, target="T4", trace="real")
    assert fake.trace == "fake"
    assert fake.n_attempts == 2
    assert fake.max_batch_size == real.max_batch_size > 1000


def test_the_trace_is_real_without_a_target_and_for_a_bare_step():
    report = bw.find_batch(mlp(), vectors, loss_fn=CE, budget="256KB")
    assert report.trace == "real"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch_size):
        x, y = vectors(batch_size)
        CE(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    assert bw.find_batch(step, optimizer=optimizer, target="T4").trace == "real"


def test_a_fake_plan_leaves_the_model_optimizer_modes_and_rng_as_they_were():
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = vectors(8)
    CE(model(x), y).backward()
    optimizer.step()  # state exists, gradients are held
    model.eval()
    params = list(model.parameters())
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict(),
                            [p.grad for p in params]))
    rng = torch.get_rng_state()
    with pytest.warns(bw.BatchwidgetsWarning, match="held gradients"):
        report = bw.find_batch(model, vectors, loss_fn=CE, optimizer=optimizer, target="T4")
    assert report.trace == "fake"
    assert list(model.parameters()) == params  # the same objects
    assert not model.training
    state, optimizer_state, grads = before
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))
    assert (optimizer.state_dict()["state"][0]["exp_avg"]
            .equal(optimizer_state["state"][0]["exp_avg"]))
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.warns(bw.BatchwidgetsWarning, match="held gradients"):
        real = bw.find_batch(model, vectors, loss_fn=CE, optimizer=optimizer, target="T4",
                             trace="real")  # the state and gradients held, traced for real
    assert real.max_batch_size == report.max_batch_size


def test_a_meta_model_is_planned_without_a_weight_and_as_the_same_model_on_the_cpu():
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(llama_config())
    report = bw.find_batch(meta, lm_batch, target="T4")
    on_cpu = bw.find_batch(transformers.LlamaForCausalLM(llama_config()), lm_batch,
                           target="T4", trace="real")
    assert report.max_batch_size == on_cpu.max_batch_size > 0
    assert report.trace == "fake"
    assert all(p.is_meta and p.grad is None for p in meta.parameters())


def test_a_bf16_meta_model_with_frozen_weights_holds_gradients_and_state_for_the_rest():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)], nn.Linear(256, 8))
    model = model.to(torch.bfloat16)
    for param in model[:4].parameters():
        param.requires_grad_(False)  # a frozen base; the head trains
    head = sum(p.numel() for p in model[4].parameters()) * 2  # bf16 bytes
    report = bw.find_batch(model, lambda n: (torch.randn(n, 256, dtype=torch.bfloat16),
                                             torch.randint(0, 8, (n,))),
                           loss_fn=CE, target="T4", max_batch_size=4096)
    split = report.memory_split
    assert split.gradients_bytes == head
    assert head * 2 <= split.optimizer_bytes <= head * 2 + 64  # exp_avg, exp_avg_sq, step
    assert split.parameters_bytes == sum(p.numel() for p in model.parameters()) * 2


def test_when_the_states_alone_do_not_fit_the_error_says_which_and_what_would():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(16)])  # 1.07B parameters
    with pytest.raises(bw.NoBatchSizeFits) as info:
        bw.find_batch(model, lambda n: (torch.randn(n, 8192), torch.randn(n, 8192)),
                      loss_fn=nn.functional.mse_loss, target="T4")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("No batch size fits on T4 (predicted, not run): the model's "
                              "states alone (weights 4.3 GB, gradients 4.3 GB, optimizer state "
                              "8.6 GB) need 17.2 GB, more than the 15.3 GB usable.")
    for hint in ("bf16", "requires_grad=False", "FSDP"):
        assert hint in message
    assert info.value.report.max_batch_size == 0


def test_on_a_small_target_the_error_counts_in_mebibytes_as_the_target_was_given():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 8.4M parameters
    with pytest.raises(bw.NoBatchSizeFits, match=r"states alone \(weights 32\.0 MiB, gradients "
                       r"32\.0 MiB, optimizer state 64\.1 MiB\) need 128\.1 MiB, more than the "
                       r"128\.0 MiB usable"):
        bw.find_batch(model, lambda n: (torch.randn(n, 1024), torch.randn(n, 1024)),
                      loss_fn=nn.functional.mse_loss, target="128MiB")


class ReadsBack(nn.Module):
    """A branch on a tensor's value: fake tensors cannot say which way it goes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        out = self.linear(x)
        return out * 2 if out.sum().item() > 0 else out


def test_what_fake_tensors_cannot_run_is_traced_by_real_steps_and_says_why():
    report = bw.find_batch(ReadsBack(), vectors, loss_fn=CE, target="T4")
    assert report.trace == "real"
    assert not any(a.fake for a in report.attempts)
    assert "Traced by real steps: aten._local_scalar_dense.default in ReadsBack" in report.method
    assert report.max_batch_size == bw.find_batch(ReadsBack(), vectors, loss_fn=CE,
                                                  target="T4", trace="real").max_batch_size


def test_on_a_meta_model_it_is_one_line_naming_the_op_and_the_module():
    with torch.device("meta"):
        model = ReadsBack()
    with pytest.raises(ValueError, match=r"_local_scalar_dense\.default in ReadsBack") as info:
        bw.find_batch(model, vectors, loss_fn=CE, target="T4")
    assert "\n" not in str(info.value)
    assert all(p.is_meta for p in model.parameters())


def test_the_users_own_error_in_a_fake_plan_propagates_as_it_is():
    with pytest.raises(TypeError, match="loss_fn should be given for"):
        bw.find_batch(mlp(), vectors, target="T4")  # (x, y) batches without a loss_fn


@pytest.mark.parametrize(("options", "match"), [
    ({"trace": "symbolic", "target": "T4"}, r"trace should be one of \['fake', 'real'\]"),
    ({"trace": "fake"}, "trace='fake' plans for a GPU that is not here: pass target "),
])
def test_bad_trace_options_are_one_line(options, match):
    with pytest.raises(ValueError, match=match):
        bw.find_batch(mlp(), vectors, loss_fn=CE, **options)


def test_a_meta_model_needs_a_target_and_a_fake_trace():
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(ValueError, match="target should name a GPU to plan for when the model "
                                         "is on the meta device"):
        bw.find_batch(model, vectors, loss_fn=CE)
    with pytest.raises(ValueError, match="trace should be 'fake'"):
        bw.find_batch(model, vectors, loss_fn=CE, target="T4", trace="real")


@pytest.mark.parametrize("parallel", [None, "fsdp", "compare"])
def test_a_plan_stays_within_max_batch_size_and_says_when_it_decided(parallel):
    # a small model fits the ceiling on an 80 GB target; the user's cap is the answer then
    with torch.device("meta"):
        model = mlp()
    target = "A100-80GB" if parallel is None else "4xA100-80GB"
    capped = bw.find_batch(model, vectors, loss_fn=CE, target=target, parallel=parallel,
                           max_batch_size=1000)
    assert capped.max_batch_size == 1000
    assert capped.stop_reason.endswith("max_batch_size reached")
    assert all(row.max_batch_size <= 1000 for row in capped.parallel_plans or ())
    free = bw.find_batch(model, vectors, loss_fn=CE, target=target, parallel=parallel,
                         max_batch_size=2**20)
    assert free.max_batch_size > 1000


@pytest.mark.parametrize("trace", ["fake", "real"])
def test_a_target_reports_predicted_peak_is_the_targets_and_agrees_with_its_answer(trace):
    """predict_peak_bytes on a target plan is the replay's peak on the target: under the usable
    memory at max_batch_size, over it one size later (it was the CPU's scale before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    report = bw.find_batch(model, lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
                           loss_fn=CE, target="2GiB", trace=trace)
    top, limit = report.max_batch_size, report.limit_bytes
    assert limit == 2 * 2**30
    assert 0.9 * limit < report.predict_peak_bytes(top) <= limit
    assert report.predict_peak_bytes(top + 1) > limit
    assert report.predict_peak_bytes(top // 2) < report.predict_peak_bytes(top)
    assert 0 < report.headroom_bytes < limit


def test_the_plot_of_a_target_plan_draws_the_targets_curve_and_names_it():
    import matplotlib

    matplotlib.use("Agg")
    report = bw.find_batch(mlp(), vectors, loss_fn=CE, target="T4")
    figure = bw.plot_probe(report)
    memory_ax = figure.axes[0]
    assert memory_ax.get_title() == f"memory on T4 (predicted): max batch {report.max_batch_size}"
    curve = next(line for line in memory_ax.lines if line.get_label() == "predicted on T4")
    assert list(curve.get_xdata()) == [size for size, _ in report.target_peaks]


@pytest.mark.slow
def test_the_what_ifs_of_a_meta_model_are_planned_as_those_of_the_same_model_on_the_cpu():
    """bf16, activation checkpointing, another optimizer: every row planned for the target on
    fake tensors (predicted: nothing ran), the meta model never materialised or changed."""
    with torch.device("meta"):
        meta = Encoder()
    params = list(meta.parameters())
    planned = bw.find_batch(meta, tokens, loss_fn=CE, target="256MiB", what_if=True)
    on_cpu = bw.find_batch(Encoder(), tokens, loss_fn=CE, target="256MiB", what_if=True)
    rows = {row.name: row.max_batch_size for row in planned.what_if}
    assert rows == {row.name: row.max_batch_size for row in on_cpu.what_if}
    assert {"bf16", "fp16", "SGD without momentum (no optimizer state)", "foreach=False",
            "checkpoint layer.self_attn (MultiheadAttention)"} <= set(rows)
    assert rows["bf16"] > planned.max_batch_size > 0  # half the activations' bytes
    assert rows["checkpoint layer.self_attn (MultiheadAttention)"] > planned.max_batch_size
    assert not any(row.measured for row in planned.what_if)
    assert list(meta.parameters()) == params
    assert all(p.is_meta and p.grad is None for p in params)
    assert len(rows) == len(planned.what_if)  # one row a change: the re-plan, not also a guess


def test_a_half_precision_model_gets_no_mixed_precision_rows():
    with torch.device("meta"):
        meta = Encoder().to(torch.bfloat16)
    rows = bw.find_batch(meta, lambda n: (torch.randn(n, 64, 64, dtype=torch.bfloat16),
                                          torch.randint(0, 4, (n,))),
                         loss_fn=CE, target="256MiB", what_if=True).what_if
    assert {"SGD without momentum (no optimizer state)", "foreach=False"} <= {
        row.name for row in rows}
    assert not {"bf16", "fp16"} & {row.name for row in rows}


def checkpointed_bert(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
            vocab_size=1000, max_position_embeddings=128))
    model.gradient_checkpointing_enable()
    return model


def masked_texts(batch_size: int) -> dict:
    ids = torch.randint(0, 1000, (batch_size, 128))
    return {"input_ids": ids, "labels": ids}  # one tensor twice: one allocation, as on real ones


def test_activation_checkpointing_is_planned_on_fake_tensors_as_on_real_ones():
    # Checkpointing runs each layer's forward again inside backward, so the fake weights must
    # stand in for the whole step: a meta model once raised a device mismatch there, and a real
    # one was planned at 437 where real steps plan 400 (1GiB; 152 without checkpointing).
    real = bw.find_batch(checkpointed_bert(), masked_texts, target="1GiB", trace="real")
    fake = bw.find_batch(checkpointed_bert(), masked_texts, target="1GiB", trace="fake")
    meta = checkpointed_bert("meta")
    planned = bw.find_batch(meta, masked_texts, target="1GiB")
    assert (fake.trace, planned.trace) == ("fake", "fake")
    assert real.max_batch_size == fake.max_batch_size == planned.max_batch_size
    plain = checkpointed_bert()
    plain.gradient_checkpointing_disable()
    without = bw.find_batch(plain, masked_texts, target="1GiB")
    assert real.max_batch_size > 2 * without.max_batch_size
    assert all(p.is_meta for p in meta.parameters())


def test_a_meta_models_checkpoint_every_block_row_is_its_checkpointed_plan():
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=1000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)

    def tokens(batch_size: int) -> dict:
        ids = torch.randint(0, 1000, (batch_size, 256))
        return {"input_ids": ids, "labels": ids}

    report = bw.find_batch(model, tokens, target="1GiB", what_if=True)
    row = {row.name: row for row in report.what_if}["checkpoint every block (3 LlamaDecoderLayer)"]
    assert not row.measured
    assert not model.is_gradient_checkpointing
    assert model.config.use_cache
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(p.is_meta for p in model.parameters())
    model.gradient_checkpointing_enable()
    assert row.max_batch_size == bw.find_batch(model, tokens, target="1GiB").max_batch_size
    assert row.max_batch_size > 1.3 * report.max_batch_size
