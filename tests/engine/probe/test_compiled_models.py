"""A compiled model is probed like any other (torch.compile(module) and module.compile(), a custom
module, a container, a Hugging Face model fed a dict, mode= and dynamic=): the report says it
measured the eager step, the model's weights and modes come back, and the model still compiles
afterwards (a step under find_batch's dispatch modes must not leave Dynamo skipping its forward
for good)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch import nn

import batchwidgets as bw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::batchwidgets.BatchwidgetsWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Counting:
    """A torch.compile backend that counts the graphs it compiles and the calls it runs."""

    def __init__(self) -> None:
        self.compiled = self.ran = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> object:
        self.compiled += 1

        def run(*args):
            self.ran += 1
            return gm(*args)
        return run


def snapshot(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def probe(model: nn.Module, make_batch, **options) -> bw.BatchSizeReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bw.find_batch(model, make_batch, cache=False, **options)


def assert_restored(model: nn.Module, before: dict, training: bool) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.training is training
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_torch_compile_of_a_custom_module_is_probed_and_still_compiles_afterwards():
    backend = Counting()
    model = torch.compile(Net(), backend=backend)
    before = snapshot(model)
    report = probe(model, torch.randn(32), budget="8MiB", max_batch_size=4096)
    assert 0 < report.max_batch_size <= 4096
    assert report.measured_step.startswith("the eager step")
    assert "measured the eager step" in report.summary()
    assert backend.compiled == 0  # nothing compiled under the meter
    assert_restored(model, before, training=True)
    model(torch.randn(4, 32)).sum().backward()  # the user's next step compiles as before
    assert backend.compiled == 1
    assert backend.ran == 1


def test_module_compile_is_probed_the_same_way():
    backend = Counting()
    net = Net().eval()
    net.compile(backend=backend)
    before = snapshot(net)
    report = probe(net, torch.randn(32), budget="8MiB", max_batch_size=4096)
    assert report.measured_step.startswith("the eager step")
    assert_restored(net, before, training=False)
    net(torch.randn(4, 32))
    assert backend.compiled == 1


def test_a_compiled_container_answers_as_the_eager_one():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8))
    backend = Counting()
    model = torch.compile(eager, backend=backend)
    before = snapshot(model)
    report = probe(model, torch.randn(32), budget="4MiB", max_batch_size=8192)
    plain = probe(eager, torch.randn(32), budget="4MiB", max_batch_size=8192)
    assert report.max_batch_size == plain.max_batch_size > 0
    assert plain.measured_step == ""
    assert_restored(model, before, training=True)
    model(torch.randn(2, 32))
    assert backend.compiled == 1


def test_a_compiled_hugging_face_model_fed_a_dict():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128,
                                     n_positions=16)
    torch.manual_seed(0)
    model = torch.compile(transformers.GPT2LMHeadModel(config), backend="aot_eager")
    before = snapshot(model)

    def tokens(batch_size: int) -> dict:
        ids = torch.randint(0, 128, (batch_size, 16))
        return {"input_ids": ids, "labels": ids}

    report = probe(model, tokens, budget="16MiB", max_batch_size=512)
    assert 0 < report.max_batch_size <= 512
    assert report.measured_step.startswith("the eager step")
    assert_restored(model, before, training=True)


@pytest.mark.parametrize("options", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                     {"dynamic": True}, {"dynamic": False}])
def test_mode_and_dynamic_variants_are_probed(options):
    model = torch.compile(Net(), **options)  # inductor: never run under the probe
    before = snapshot(model)
    report = probe(model, torch.randn(32), budget="8MiB", max_batch_size=4096)
    assert 0 < report.max_batch_size <= 4096
    assert "eager step" in report.summary()
    assert_restored(model, before, training=True)


def test_a_compiled_model_planned_for_a_target_says_so_too():
    with torch.device("meta"):
        model = torch.compile(Net(), backend="eager")
    report = probe(model, torch.zeros(32), target="T4", max_batch_size=1024)
    assert report.max_batch_size == 1024
    assert report.measured_step.startswith("the eager step")
