"""Hugging Face models (built from tiny configs, nothing downloaded) and a small CNN through every
public function: dict and ``BatchEncoding`` batches, the loss the model computes itself, and the
GPT-2 ``(input_ids, labels)`` tuple whose labels must be used (issue 13)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from _oracles import pad_text
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import batchwidgets as bw
from batchwidgets._warnings import BatchwidgetsWarning

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ, N = 100, 16, 24


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, exact comparisons


def bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=SEQ, num_labels=3)


def bert_classifier() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(bert_config()).eval()


def bert_masked_lm() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(bert_config()).eval()


class TinyResNet(nn.Module):
    """A resnet-like CNN: a stem, two residual blocks with BatchNorm, pooling, a classifier."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)) for _ in range(2))
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean((2, 3)))


def token_ids(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class Items(Dataset):
    """A map-style dataset of ready-made items (dicts, as a tokenized HF dataset gives)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def lm_items(n: int = N) -> Items:
    ids = token_ids(n)
    return Items([{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                   "labels": ids[i]} for i in range(n)])


def classifier_items(n: int = N) -> Items:
    ids = token_ids(n)
    labels = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(1))
    return Items([{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                   "labels": labels[i]} for i in range(n)])


def mlm_items(n: int = N) -> Items:
    ids = token_ids(n)
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]  # a quarter of the tokens are predicted
    return Items([{"input_ids": ids[i], "labels": labels[i]} for i in range(n)])


MODELS = {"gpt2": (gpt2, lm_items), "bert": (bert_classifier, classifier_items),
          "bert-mlm": (bert_masked_lm, mlm_items)}


def encoded(batch: dict) -> transformers.BatchEncoding:
    return transformers.BatchEncoding(batch)


def probe(model: nn.Module, make_batch, **options) -> bw.BatchSizeReport:
    options = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "budget": "4MiB",
               "max_batch_size": 64, "steps_per_trial": 1, **options}
    return bw.find_batch(model, make_batch, **options)


def attempts(report: bw.BatchSizeReport) -> list:
    return [(a.batch_size, a.fits, a.peak_memory_bytes) for a in report.attempts]


# ---- find_batch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_find_batch_takes_dict_and_batch_encoding_batches_and_uses_the_models_loss(name):
    build, items = MODELS[name]
    model, data = build(), items()
    before = [p.detach().clone() for p in model.parameters()]
    by_dataset = probe(model, data)
    collate = torch.utils.data.default_collate
    by_encoding = probe(model, lambda n: encoded(collate([data[i % N] for i in range(n)])))
    assert by_dataset.max_batch_size > 1
    assert attempts(by_dataset) == attempts(by_encoding)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_gpt2_tuples_without_loss_fn_train_on_the_labels_not_on_the_logits():
    """Issue 13: (input_ids, labels) with no loss_fn once trained on the mean of the logits, and
    the probe said 18 where the real language-model loss fits 9. Now the labels go in as
    labels=, so the probe sees the same memory as with dict batches."""
    model, ids = gpt2(), token_ids(64)
    as_tuples = probe(model, lambda n: (ids[:n], ids[:n]), budget="3MiB")
    as_dicts = probe(model, lambda n: {"input_ids": ids[:n], "labels": ids[:n]}, budget="3MiB")
    assert attempts(as_tuples) == attempts(as_dicts)
    data = TensorDataset(ids[:8], ids[:8])
    report = bw.measure_noise(model, data, batch_sizes=(1,), method="loop")
    expected = torch.stack([model(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss
                            for i in range(8)]).mean()
    assert report.loss_mean == pytest.approx(expected.item(), rel=1e-6)


def test_a_dict_batch_with_a_tensor_loss_says_the_convention_in_one_line():
    model, data = gpt2(), lm_items()
    with pytest.raises(TypeError) as caught:
        probe(model, data, loss_fn=nn.functional.cross_entropy)
    message = str(caught.value)
    assert message.startswith("loss_fn should take the model's whole output")
    assert "CausalLMOutput" in message
    assert "leave loss_fn out" in message
    assert "\n" not in message


def test_a_dict_batch_with_labels_gives_them_to_loss_fn_and_the_rest_to_the_model():
    model, data = bert_classifier(), classifier_items()
    seen = []

    def loss_fn(output, labels):
        seen.append((output.loss, labels.shape))
        return nn.functional.cross_entropy(output.logits, labels)

    report = probe(model, data, loss_fn=loss_fn)
    assert seen
    assert {loss is None for loss, _ in seen} == {True}  # labels were not given to the model
    fitted = {(a.batch_size,) for a in report.attempts if a.fits}
    assert fitted <= {shape for _, shape in seen} <= {(a.batch_size,) for a in report.attempts}


# ---- measure_noise and NoiseTracker.measure -----------------------------------------------------

def caught_warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("name", list(MODELS))
def test_measure_noise_on_dict_datasets_matches_one_backward_per_example(name):
    build, items = MODELS[name]
    model, data = build(), items(12)
    auto, messages = caught_warnings(lambda: bw.measure_noise(model, data, batch_sizes=(1, 4)))
    loop = bw.measure_noise(model, data, batch_sizes=(1, 4), method="loop")
    assert auto.n_examples == loop.n_examples == 12
    assert auto.trace_cov == pytest.approx(loop.trace_cov, rel=1e-4)
    assert auto.grad_norm_sq == pytest.approx(loop.grad_norm_sq, rel=1e-4)
    expected = torch.stack([model(**torch.utils.data.default_collate([data[i]])).loss
                            for i in range(12)]).mean()
    assert loop.loss_mean == pytest.approx(expected.item(), rel=1e-6)
    # PyTorch's "performance drop ... batching rule" warning comes once at most, as ours
    assert not any("There is a performance drop" in m for m in messages)
    assert sum("batching rule" in m for m in messages) <= 1


def test_measure_noise_forced_to_vmap_on_bert_says_method_in_one_line():
    """BERT calls .item() inside forward: vmap cannot run it, a loop can (issue 22)."""
    with pytest.raises(ValueError, match="method should be 'loop' or 'auto' for "
                                         "BertForSequenceClassification") as info:
        bw.measure_noise(bert_classifier(), classifier_items(8), batch_sizes=(1,),
                         method="vmap")
    assert "\n" not in str(info.value)
    assert "pass method='loop', or leave method out" in str(info.value)
    assert bw.measure_noise(bert_classifier(), classifier_items(8),
                            batch_sizes=(1,)).method == "loop"


def test_measure_noise_on_gpt2_by_vmap_says_the_missing_batching_rule_once():
    ids = token_ids(12)  # no attention_mask: GPT-2 checks it in Python, which vmap cannot run
    model, data = gpt2(), Items([{"input_ids": ids[i], "labels": ids[i]} for i in range(12)])
    report, messages = caught_warnings(
        lambda: bw.measure_noise(model, data, batch_sizes=(1,), chunk_size=4, method="vmap"))
    assert report.method == "vmap"
    slow = [m for m in messages if "batching rule" in m]
    assert len(slow) <= 1  # three chunks, each with dozens of attention calls
    assert not any("There is a performance drop" in m for m in messages)
    assert slow[0].startswith("measure_noise: torch.func.vmap has no batching rule for aten::")


@pytest.mark.parametrize("name", list(MODELS))
def test_noise_tracker_measures_dict_and_batch_encoding_batches_without_loss_fn(name):
    build, items = MODELS[name]
    model = build()
    batch = torch.utils.data.default_collate([items()[i] for i in range(8)])
    tracker = bw.NoiseTracker(warmup_updates=1)
    before = [p.detach().clone() for p in model.parameters()]
    assert tracker.measure(model, batch)
    assert tracker.measure(model, None, encoded(batch), parts=4)
    report = tracker.report
    assert report.n_updates == 2
    assert report.grad_norm_sq is not None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_noise_tracker_split_equals_the_gradients_of_the_halves():
    model, data = gpt2(), lm_items(8)
    batch = torch.utils.data.default_collate([data[i] for i in range(8)])
    tracker = bw.NoiseTracker(warmup_updates=1)
    tracker.measure(model, batch, parts=2)
    halves = []
    for part in (slice(0, 4), slice(4, 8)):
        loss = model(**{k: v[part] for k, v in batch.items()}).loss
        halves.append(torch.autograd.grad(loss, list(model.parameters())))
    small = [sum(g.double().square().sum() for g in half).item() for half in halves]
    big = sum(((a + b) / 2).double().square().sum()
              for a, b in zip(*halves)).item()
    # the two-batch-size estimator of NOTE [ The two-batch-size estimator ], B_small=4, B_big=8
    g2 = (8 * big - 4 * sum(small) / 2) / 4
    assert tracker.report.grad_norm_sq == pytest.approx(g2, rel=1e-4)


# ---- accumulate and tune_loader -----------------------------------------------------------------

def test_accumulate_on_gpt2_dict_batches_equals_the_big_batch():
    ids = token_ids(16)
    model, reference = gpt2(), gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with bw.accumulate(optimizer, steps=4, model=model):
        for i in range(0, 16, 4):
            model(**encoded({"input_ids": ids[i:i + 4], "labels": ids[i:i + 4]})).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    big = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(input_ids=ids, labels=ids).loss.backward()
    big.step()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


def test_tune_loader_measures_a_loader_of_dict_batches():
    loader = DataLoader(lm_items(), batch_size=4)
    report = bw.tune_loader(loader, "cpu", max_workers=0, duration_s=0.05)
    assert report.best.samples_per_s > 0
    assert report.best.batch_size == 4


# ---- critical_batch on variable-length text ------------------------------------------------------

def text_items(n: int) -> Items:
    """Token sequences of 4 to SEQ - 1 tokens (no padding: the collate_fn pads), labelled by
    their first token, as a tokenized dataset gives them."""
    generator = torch.Generator().manual_seed(3)
    items = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (4 + i % (SEQ - 4),), generator=generator)
        items.append({"input_ids": ids, "labels": ids[0] % 3})
    return Items(items)


@pytest.mark.slow
def test_critical_batch_measures_bert_on_padded_text_and_puts_everything_back():
    """The user's case: a BERT in train mode (dropout), AdamW with its state, a DataLoader whose
    collate_fn pads variable-length text. The branches and the noise scale beside them
    (measure_noise, per-example gradients) batch the items the way the loop does."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert_config())  # train mode
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(text_items(256), batch_size=8, shuffle=True, collate_fn=pad_text)
    for batch in itertools.islice(loader, 2):  # AdamW state to put back
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    rng = torch.get_rng_state()
    report = bw.critical_batch(model, loader, optimizer=optimizer, seeds=1, base_steps=16)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(optimizer.state.values(), moments))
    assert all(m.training for m in model.modules())  # the model and every module
    assert report.examples_noise == 256  # measure_noise read every item, padded by pad_text()
    direct = bw.measure_noise(model, loader, batch_sizes=(1,), max_examples=512)  # same weights
    assert report.b_simple == (direct.b_simple if direct.measurable else None)
    assert report.target_loss < report.start_loss
    assert any(b.steps_to_target is not None for b in report.ladder)
    assert report.lr_scaling == "sqrt"


def test_measure_noise_pads_by_the_loaders_collate_fn_without_changing_an_example():
    """Chunks of 8 padded to their longest item (BERT masks the padding) give the per-example
    gradients of each item alone (chunks of one: nothing padded)."""
    model = bert_classifier()
    loader = DataLoader(text_items(16), batch_size=4, shuffle=True, collate_fn=pad_text)
    padded = bw.measure_noise(model, loader, batch_sizes=(1, 4), chunk_size=8)
    alone = bw.measure_noise(model, loader, batch_sizes=(1, 4), chunk_size=1, method="loop")
    assert padded.n_examples == alone.n_examples == 16
    assert padded.trace_cov == pytest.approx(alone.trace_cov, rel=1e-4)
    assert padded.grad_norm_sq == pytest.approx(alone.grad_norm_sq, rel=1e-4)
    assert padded.loss_mean == pytest.approx(alone.loss_mean, rel=1e-5)


def test_variable_length_text_without_its_collate_fn_is_a_one_line_error():
    model = bert_classifier()
    with pytest.raises(ValueError, match=r"^data should give items of one shape.*DataLoader"
                       ) as measured:
        bw.measure_noise(model, text_items(16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^data should give items of one shape.*critical_batch"
                       ) as branched:
        bw.critical_batch(model, text_items(64), optimizer=optimizer, noise=False)
    for error in (measured, branched):
        assert "\n" not in str(error.value)


# ---- a vision model -----------------------------------------------------------------------------

def images(n: int = N) -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=generator),
                         torch.randint(0, 5, (n,), generator=generator))


def test_a_small_cnn_goes_through_find_batch_measure_noise_and_the_tracker():
    torch.manual_seed(0)
    model = TinyResNet()
    report = probe(model, images(), loss_fn=nn.functional.cross_entropy, budget="1MiB")
    assert report.first_oom_batch_size == report.max_batch_size + 1
    with pytest.warns(BatchwidgetsWarning, match="BatchNorm"):
        noise = bw.measure_noise(model, images(12), nn.functional.cross_entropy,
                                 batch_sizes=(1, 4))
    assert noise.n_examples == 12
    tracker = bw.NoiseTracker(warmup_updates=1)
    x, y = images(8).tensors
    assert tracker.measure(model, nn.functional.cross_entropy, [x, y])
    with pytest.raises(TypeError, match="loss_fn should be given"):
        probe(model, images())  # (x, y) with no loss_fn, and TinyResNet takes no labels=
