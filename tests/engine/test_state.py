"""Restoration, bit for bit, however find_batch ends: success, nothing fits, the user's error,
KeyboardInterrupt. Weights, buffers, gradients, optimizer state and param groups, scheduler and
scaler, RNGs, train/eval modes and backend flags."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import batchwidgets as bw
from batchwidgets.engine.memory import track_tensor_memory

KIB = 2**10


class Net(nn.Module):
    """MLP or small CNN with BatchNorm and Dropout. Its forward consumes every RNG (torch, Python,
    numpy), flips global flags the way user code might, and can be told to fail on a given call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if kind == "mlp":
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1),
                                      nn.Linear(32, 4))
        else:
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1),
                                      nn.Linear(4, 4))
        self.kind = kind
        self.calls = 0
        self.fail_on_call: int | None = None
        self.failure: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += not is_fake(x)  # the real steps' calls (a fake trial runs nothing)
        if self.calls == self.fail_on_call:
            raise self.failure
        random.random()
        np.random.rand()
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = True
        return self.body(x)

    def make_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, 16) if self.kind == "mlp" else (batch_size, 3, 8, 8)
        return torch.randn(shape), torch.randint(0, 4, (batch_size,))


SETUPS = {
    "mlp, adam": {"kind": "mlp", "optimizer": lambda p: torch.optim.Adam(p, lr=1e-3)},
    "cnn with batchnorm in eval mode, sgd momentum, scheduler": {
        "kind": "cnn", "optimizer": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "eval": True, "scheduler": True},
    "mlp, adamw, fp16 with scheduler and grad scaler": {
        "kind": "mlp", "optimizer": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
        "scheduler": True, "scaler": True, "amp": "fp16"},
}
EXITS = ("success", "nothing fits", "user error", "keyboard interrupt")


class Training:
    """A model, optimizer, scheduler and scaler after two real steps (so optimizer state exists
    and the gradients are not None), with a snapshot of everything that must come back."""

    def __init__(self, kind: str, optimizer, eval: bool = False, scheduler: bool = False,
                 scaler: bool = False, amp: str | None = None) -> None:
        self.model = Net(kind)
        self.optimizer = optimizer(self.model.parameters())
        self.scheduler = (torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
                          if scheduler else None)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        self.amp = amp
        for _ in range(2):
            x, y = self.model.make_batch(4)
            loss = nn.functional.cross_entropy(self.model(x), y)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.scheduler:
                self.scheduler.step()
        self.model.train(not eval)
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False

    def find_batch(self, budget: int) -> bw.BatchSizeReport:
        return bw.find_batch(self.model, self.model.make_batch,
                             loss_fn=nn.functional.cross_entropy, optimizer=self.optimizer,
                             budget=budget, amp=self.amp, scheduler=self.scheduler,
                             scaler=self.scaler)

    def snapshot(self) -> dict:
        model, optimizer = self.model, self.optimizer
        return {
            "objects": ([id(p) for p in model.parameters()], [id(b) for b in model.buffers()],
                        [id(g) for g in optimizer.param_groups]),
            "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": [p.grad.clone() for p in model.parameters()],
            "modes": [m.training for m in model.modules()],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": self.scheduler and copy.deepcopy(self.scheduler.state_dict()),
            "scaler": self.scaler and (self.scaler.state_dict(),
                                       copy.deepcopy(dict(self.scaler._per_optimizer_states))),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "flags": (torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled(),
                      torch.backends.cudnn.benchmark),
        }


def assert_equal(before: object, after: object, where: str = "") -> None:
    """Bit-exact equality through dicts, lists and tuples, with torch.equal on tensors."""
    assert type(before) is type(after), where
    if isinstance(before, torch.Tensor):
        assert before.dtype == after.dtype, where
        assert torch.equal(before, after), where
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            assert_equal(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after)):
            assert_equal(b, a, f"{where}[{i}]")
    elif isinstance(before, np.ndarray):
        assert np.array_equal(before, after), where
    else:
        assert before == after, where


def run_until(training: Training, exit_path: str) -> BaseException | None:
    """Run find_batch so that it ends the given way; return what it raised."""
    failures = {"user error": ValueError("the user's model has a bug"),
                "keyboard interrupt": KeyboardInterrupt()}
    if exit_path in failures:
        training.model.calls = 0
        training.model.fail_on_call = 3  # two steps a trial: inside the second real trial
        training.model.failure = failures[exit_path]
    budget = 1 * KIB if exit_path == "nothing fits" else 256 * KIB
    try:
        training.find_batch(budget)
    except (Exception, KeyboardInterrupt) as error:
        return error
    finally:
        training.model.fail_on_call = None
    return None


@pytest.mark.parametrize("exit_path", EXITS)
@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
def test_find_batch_restores_everything_however_it_ends(setup, exit_path):
    training = Training(**setup)
    random.seed(1)
    np.random.seed(1)
    before = training.snapshot()
    raised = run_until(training, exit_path)
    after = training.snapshot()
    expected = {"success": type(None), "nothing fits": bw.NoBatchSizeFits,
                "user error": ValueError, "keyboard interrupt": KeyboardInterrupt}[exit_path]
    assert type(raised) is expected
    if exit_path in ("user error", "keyboard interrupt"):  # the user's own error, or said in
        # our words with it as the cause (engine/_called.py)
        assert training.model.failure in (raised, raised.__cause__)
        assert training.model.calls == 3
    assert_equal(before, after, "state")


def test_the_restore_check_sees_a_change():
    # The matrix above could pass vacuously if the snapshot missed what a step changes.
    training = Training(**SETUPS["mlp, adamw, fp16 with scheduler and grad scaler"])
    before = training.snapshot()
    x, y = training.model.make_batch(4)
    nn.functional.cross_entropy(training.model(x), y).backward()
    training.optimizer.step()
    training.scheduler.step()
    after = training.snapshot()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    for key in ("state_dict", "grads", "optimizer", "scheduler", "torch_rng", "python_rng",
                "numpy_rng", "flags"):
        with pytest.raises(AssertionError):
            assert_equal(before[key], after[key], key)


def test_an_eval_mode_model_is_probed_in_train_mode_and_left_in_eval_mode():
    training = Training(**SETUPS["cnn with batchnorm in eval mode, sgd momentum, scheduler"])
    modes = []
    training.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    training.find_batch(256 * KIB)
    assert set(modes) == {True}
    assert not any(m.training for m in training.model.modules())


@pytest.mark.parametrize("exit_path", ["success", "nothing fits"])
def test_nothing_the_probe_allocated_outlives_it(exit_path):
    training = Training(**SETUPS["mlp, adam"])
    model, optimizer = training.model, training.optimizer
    existing = [*model.parameters(), *model.buffers(), *[p.grad for p in model.parameters()],
                *[dict(state) for state in optimizer.state.values()]]
    # The outer tracker sees every tensor the probe creates and frees, on top of what exists.
    with track_tensor_memory(baseline=existing) as outside:
        error = run_until(training, exit_path)
        del error, existing
    assert outside.live_bytes == outside.baseline_bytes
    assert outside.peak_bytes > 2 * outside.baseline_bytes


class HalfwayScaledStep:
    """A bare step with a GradScaler that runs out of memory after unscale_(), before update()."""

    def __init__(self) -> None:
        self.model = nn.Linear(4, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = torch.amp.GradScaler("cpu")

    def __call__(self, batch_size: int) -> None:
        loss = self.model(torch.randn(batch_size, 4)).square().mean()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()


def test_a_scaler_interrupted_between_unscale_and_update_is_ready_again():
    step = HalfwayScaledStep()
    report = bw.find_batch(step, device="cpu", optimizer=step.optimizer, scaler=step.scaler)
    assert report.max_batch_size == 8
    step(2)  # the user's next step: unscale_() would raise if the scaler were left half way


@pytest.fixture
def medium_matmul_precision():
    """float32 matmul precision "medium" (as Lightning suggests), put back afterwards."""
    owners = [torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    if not hasattr(torch.backends, "fp32_precision"):
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium")
        yield
        torch.set_float32_matmul_precision(before)
        return
    before = [owner.fp32_precision for owner in owners]
    torch.set_float32_matmul_precision("medium")
    yield
    for owner, precision in zip(owners, before):
        owner.fp32_precision = precision


def test_backend_flags_come_back_through_the_api_the_user_used(medium_matmul_precision):
    def step(batch_size: int) -> None:
        torch.use_deterministic_algorithms(True)
        if batch_size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    bw.find_batch(step, device="cpu")
    assert torch.get_float32_matmul_precision() == "medium"  # raised after mixing the two APIs
    assert not torch.are_deterministic_algorithms_enabled()


class BareStep:
    """``find_batch(step)``: the step trains a model find_batch never sees; only its optimizer is
    passed. Fails like ``Net`` when told to."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(8, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.calls = 0
        self.fail_on_call: int | None = None
        self(4)  # momentum buffers and gradients exist before the probe
        self.calls = 0

    def __call__(self, batch_size: int) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise KeyboardInterrupt
        self.optimizer.zero_grad()
        # at most 64 rows: the search tries millions of samples after its prediction misses (the
        # meter does not see this OOM), and the step need only change the weights before it fails
        self.model(torch.randn(min(batch_size, 64), 8)).square().mean().backward()
        self.optimizer.step()
        if batch_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_bare_steps_weights_come_back_through_its_optimizer(interrupted):
    step = BareStep()
    step.fail_on_call = 5 if interrupted else None
    weights = [p.detach().clone() for p in step.model.parameters()]
    grads = [p.grad.clone() for p in step.model.parameters()]
    state = copy.deepcopy(step.optimizer.state_dict())
    if interrupted:
        with pytest.raises(KeyboardInterrupt):
            bw.find_batch(step, device="cpu", optimizer=step.optimizer)
    else:
        assert bw.find_batch(step, device="cpu", optimizer=step.optimizer).max_batch_size == 16
    assert_equal(weights, [p.detach() for p in step.model.parameters()], "weights")
    assert_equal(grads, [p.grad for p in step.model.parameters()], "grads")
    assert_equal(state, step.optimizer.state_dict(), "optimizer")


class LearnedLoss(nn.Module):
    """A loss with weights of its own (a class weighting, trained or not) and dropout, divided by
    a temperature the optimizer trains beside the model."""

    def __init__(self, temperature: nn.Parameter) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.drop = nn.Dropout(0.1)
        self.temperature = [temperature]  # no module's parameter

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.drop(logits * self.scale) / self.temperature[0],
                                           target)


@pytest.mark.parametrize("how", ["probe", "target, real trace", "target, fake trace",
                                 "critical_batch"])
def test_what_a_step_trains_outside_the_model_comes_back(how):
    # The optimizer trains a temperature that no module holds, and the loss module has weights
    # of its own (not in the optimizer): a step changes the first and accumulates gradients
    # into both, and the loss module is in eval mode.
    model = Net("mlp")
    temperature = nn.Parameter(torch.ones(()))
    loss_fn = LearnedLoss(temperature).eval()
    optimizer = torch.optim.AdamW([*model.parameters(), temperature], lr=0.1)
    x, y = model.make_batch(4)
    loss_fn.train()(model(x), y).backward()
    optimizer.step()
    loss_fn.eval()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    outside = (temperature, loss_fn.scale)

    def snapshot() -> list:
        return [[t.detach().clone() for t in outside], [t.grad.clone() for t in outside],
                loss_fn.training, copy.deepcopy(optimizer.state_dict())]

    before = snapshot()
    if how == "critical_batch":
        data = torch.utils.data.TensorDataset(*model.make_batch(64))
        bw.critical_batch(model, data, optimizer=optimizer, loss_fn=loss_fn, batch_sizes=[2, 4, 8],
                          base_steps=4, seeds=1, eval_examples=8, noise=False, target_loss=10.0)
    else:
        options = {"probe": {"budget": 256 * KIB},
                   "target, real trace": {"target": "1GiB", "trace": "real"},
                   "target, fake trace": {"target": "1GiB", "trace": "fake"}}[how]
        report = bw.find_batch(model, model.make_batch, loss_fn=loss_fn, optimizer=optimizer,
                               **options)
        assert report.trace == ("fake" if how.endswith("fake trace") else "real")
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    assert_equal(before, snapshot(), "outside the model")
