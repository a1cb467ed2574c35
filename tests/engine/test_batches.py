"""The batch convention shared by find_batch, measure_noise and NoiseTracker.measure: how each
form of batch is fed to the model and the loss, and the one-line errors naming the form that
would work (issue 13); %%accumulate picking the trained model over a leftover loop variable."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchwidgets as bw

KIB = 1024


def probe(model, make_batch, **options):
    options = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "budget": 64 * KIB,
               "max_batch_size": 32, "steps_per_trial": 1, **options}
    return bw.find_batch(model, make_batch, **options)


class Recorder(nn.Module):
    """Records what forward was given; returns logits (no loss)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = []

    def forward(self, features, extra=None):
        self.calls.append((features.shape, None if extra is None else extra.shape))
        return self.linear(features)


class WithLabels(nn.Module):
    """A Hugging Face-like forward: labels=, and an output object with .loss and .logits."""

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.labels_seen = []

    def forward(self, features, labels=None):
        self.labels_seen.append(labels)
        logits = self.linear(features)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return self.Output(logits, loss)


def pairs(n):
    return torch.randn(n, 4), torch.randint(0, 3, (n,))


def one_line(caught) -> str:
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_tuple_without_loss_fn_goes_in_as_labels_when_forward_takes_them():
    model = WithLabels()
    probe(model, pairs)
    assert model.labels_seen
    assert all(labels is not None for labels in model.labels_seen)


def test_a_tuple_without_loss_fn_is_refused_when_nothing_would_read_its_target():
    with pytest.raises(TypeError, match="loss_fn should be given") as caught:
        probe(Recorder(), pairs)
    message = one_line(caught)
    assert "takes no labels=" in message
    assert "loss_fn=torch.nn.functional.cross_entropy" in message


def test_a_tuple_x_z_y_feeds_x_and_z_to_the_model_and_y_to_loss_fn():
    model = Recorder()
    probe(model, lambda n: (torch.randn(n, 4), torch.randn(n, 2), torch.randint(0, 3, (n,))),
          loss_fn=nn.functional.cross_entropy)
    assert all(extra == (shape[0], 2) for shape, extra in model.calls)


def test_a_dict_with_labels_and_a_tensor_loss_names_the_output_type_and_the_fix():
    model = WithLabels()

    def make(n):
        x, y = pairs(n)
        return {"features": x, "labels": y}

    with pytest.raises(TypeError, match="loss_fn should take the model's whole output") as caught:
        probe(model, make, loss_fn=nn.functional.cross_entropy)
    assert "returns a Output" in one_line(caught)
    model.labels_seen.clear()
    report = probe(model, make, loss_fn=lambda output, labels: nn.functional.cross_entropy(
        output.logits, labels))
    assert report.max_batch_size > 1
    assert set(map(type, model.labels_seen)) == {type(None)}  # labels went to loss_fn only


def test_a_dict_without_labels_and_a_two_argument_loss_says_where_the_target_goes():
    with pytest.raises(TypeError, match="batch should be an") as caught:
        probe(Recorder(), lambda n: {"features": torch.randn(n, 4)},
              loss_fn=nn.functional.cross_entropy)
    message = one_line(caught)
    assert "a dict with a 'labels' entry" in message
    assert "loss_fn(output) of one argument" in message


def test_a_key_forward_does_not_take_is_named():
    with pytest.raises(TypeError, match="'label'") as caught:
        probe(WithLabels(), lambda n: {"features": torch.randn(n, 4),
                                       "label": torch.randint(0, 3, (n,))})
    assert "Hugging Face models take 'labels'" in one_line(caught)


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    labels: torch.Tensor


def test_a_dataclass_batch_is_fed_as_keywords_and_moved_whole():
    model = WithLabels()
    report = probe(model, lambda n: Batch(*pairs(n)))
    assert report.max_batch_size > 1
    assert all(labels is not None for labels in model.labels_seen)
    tracker = bw.NoiseTracker(warmup_updates=1)
    assert tracker.measure(model, Batch(*pairs(8)))


def test_an_iterator_is_refused_with_the_fix_pass_the_loader():
    loader = DataLoader(TensorDataset(*pairs(16)), batch_size=4)
    with pytest.raises(TypeError, match="make_batch should") as caught:
        probe(WithLabels(), iter(loader))
    assert "pass the DataLoader itself: find_batch(model, loader)" in one_line(caught)


def test_the_output_mean_still_probes_a_model_fed_inputs_alone():
    report = probe(Recorder(), torch.zeros(4))
    assert report.max_batch_size > 1


# ---- %%accumulate and a leftover `m` from `for m in model.modules()` ---------------------------

@pytest.fixture
def ip():
    start_ipython()  # the shared test shell: returns it only on the first call
    shell = get_ipython()
    shell.run_line_magic("load_ext", "batchwidgets")
    names = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - names:
        shell.user_ns.pop(name)


def test_accumulate_prefers_the_model_over_a_part_left_by_a_loop(ip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = pairs(16)
    ip.push({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "X": x, "Y": y,
             "nn": nn})
    ip.run_cell("for m in model.modules():\n    pass")
    assert isinstance(ip.user_ns["m"], nn.Linear)  # a part of model, all of it trained
    report = ip.run_cell_magic("accumulate", "2", """
for i in range(0, 16, 4):
    nn.functional.cross_entropy(model(X[i:i + 4]), Y[i:i + 4]).backward()
    opt.step()
    opt.zero_grad()
""")
    assert report.micro_batch_size == 4  # found from the model's inputs: model was picked
    assert report.real_steps == 2


# The walkers and the default device of engine/_util, seen through the public functions.


@dataclasses.dataclass
class Pair:
    inputs: torch.Tensor
    target: torch.Tensor


def collate_pair(samples):
    inputs, targets = zip(*samples)
    return Pair(torch.stack(inputs), torch.stack(targets))


def test_a_loader_of_dataclass_batches_counts_their_examples_and_bytes():
    data = TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long))
    loader = DataLoader(data, batch_size=8, collate_fn=collate_pair)
    trial = bw.measure_loader(loader, device="cpu", max_batches=4, duration_s=10.0)
    assert trial.n_batches == 4
    assert trial.n_samples == 4 * 8  # each batch holds 8 examples, not 1
    per_batch = 8 * 4 * 4 + 8 * 8  # float32 inputs + int64 targets
    assert trial.bytes_per_s == pytest.approx(per_batch * trial.batches_per_s)


def test_the_probe_and_the_loader_agree_on_the_default_device():
    def step(batch_size):
        torch.zeros(batch_size, 4).sum()

    loader_device = bw.measure_loader(TensorDataset(torch.zeros(8, 2)), max_batches=1).device
    probe_device = bw.find_batch(step, max_batch_size=4, steps_per_trial=1).device
    assert loader_device == probe_device
    if not torch.accelerator.is_available():
        assert probe_device == "cpu"
