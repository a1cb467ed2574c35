"""find_batch on real models on the CPU: the answer checked against an independent run under the
same budget, the forms of make_batch, AMP, argument checks, and the error when nothing fits."""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
from torch import nn

import batchwidgets as bw
from batchwidgets.engine._batches import SyntheticBatches
from batchwidgets.engine.memory import BudgetExceededError, TensorMemoryTracker

KIB = 2**10


def mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def vectors(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def images(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 8, 8), torch.randint(0, 3, (batch_size,))


def trained(model: nn.Module, optimizer: torch.optim.Optimizer, make_batch) -> None:
    """Two real steps, so the optimizer has state and the gradients are not None."""
    for _ in range(2):
        optimizer.zero_grad()
        x, y = make_batch(4)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def trains_within(budget_bytes: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  make_batch, batch_size: int, steps: int = 2, keep_output: bool = True) -> bool:
    """The oracle: ``steps`` iterations of a plain training loop on copies, under the
    tensor-memory budget, counting the weights, gradients and optimizer state that already
    exist; its variables (the batch, the output, the loss) live as a loop's do, or with
    ``keep_output=False`` the output is deleted before backward."""
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    for param, param_copy in zip(model.parameters(), model_copy.parameters()):
        param_copy.grad = None if param.grad is None else param.grad.clone()  # deepcopy drops them
    model_copy.train()

    def existing() -> list:  # not kept in a variable: a list would hold freed gradients alive
        return [*model_copy.parameters(), *model_copy.buffers(),
                *[p.grad for p in model_copy.parameters() if p.grad is not None],
                *[dict(state) for state in optimizer_copy.state.values()]]

    try:
        with TensorMemoryTracker("cpu", budget_bytes, existing()):
            x = y = None
            for _ in range(steps):
                # `for x, y in loader: x, y = x.to(device), ...` lets the device's batch go
                # when it rebinds x, y to the loader's next (host) batch
                x = y = None
                x, y = make_batch(batch_size)
                out = model_copy(x)
                loss = nn.functional.cross_entropy(out, y)
                if not keep_output:
                    del out, x, y
                loss.backward()
                optimizer_copy.step()
                optimizer_copy.zero_grad(set_to_none=True)
            del loss
            if keep_output:
                del out, x, y
    except BudgetExceededError:
        return False
    return True


CASES = {
    "mlp, adam": (mlp, vectors, lambda p: torch.optim.Adam(p, lr=1e-3), 256 * KIB),
    "mlp, adamw": (mlp, vectors, lambda p: torch.optim.AdamW(p, lr=1e-3), 64 * KIB),
    "cnn with batchnorm, sgd momentum": (cnn, images, lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9), 1024 * KIB),
}


@pytest.mark.parametrize(("build", "make_batch", "make_optimizer", "budget"), CASES.values(),
                         ids=CASES.keys())
def test_find_batch_returns_largest_size_that_fits(build, make_batch, make_optimizer, budget):
    model = build()
    optimizer = make_optimizer(model.parameters())
    trained(model, optimizer, make_batch)
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget=budget)
    largest = report.max_batch_size
    assert trains_within(budget, model, optimizer, make_batch, largest)
    assert not trains_within(budget, model, optimizer, make_batch, largest + 1)
    assert report.first_oom_batch_size == largest + 1
    assert report.n_attempts <= 8
    assert (report.device, report.budget_bytes, report.limit_bytes) == ("cpu", budget, budget)


def test_a_model_with_batchnorm_starts_at_two_samples():
    model = cnn()
    report = bw.find_batch(model, images, loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget="512KiB")
    assert report.attempts[0].batch_size == 2


def test_two_steps_a_trial_count_the_optimizer_state_adam_creates_on_its_first_step():
    model = mlp(width=256)  # 21 KB of weights: Adam's state (42 KB) appears in the first step
    budget = 128 * KIB
    default, one_step = (bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                                       optimizer=torch.optim.Adam(model.parameters()),
                                       budget=budget, **steps)
                         for steps in ({}, {"steps_per_trial": 1}))
    fresh = torch.optim.Adam(model.parameters())
    assert trains_within(budget, model, fresh, vectors, default.max_batch_size)
    assert not trains_within(budget, model, fresh, vectors, one_step.max_batch_size)
    assert default.max_batch_size < one_step.max_batch_size


class Pairs(torch.utils.data.Dataset):
    """(x, y) samples, as ``vectors`` makes them."""

    def __init__(self, n: int) -> None:
        self.x, self.y = vectors(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def test_a_dataset_a_dataloader_and_a_callable_give_the_same_answer():
    model = mlp()
    answers = []
    for make_batch in (vectors, Pairs(100), torch.utils.data.DataLoader(Pairs(100), batch_size=7)):
        report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               budget=32 * KIB)
        answers.append((report.max_batch_size, report.memory_model))
    assert answers[0] == answers[1] == answers[2]


class ShapeRecorder(nn.Module):
    """Records the input shapes it is given; the output's mean is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return x * self.scale


class Sequences(torch.utils.data.Dataset):
    """Variable-length samples: item i has i + 1 values (the last is the longest)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.ones(i + 1)


@pytest.mark.parametrize("n", [10, 200])
def test_a_dataset_of_variable_size_samples_is_probed_with_its_largest_sample(n):  # issue 11
    model = ShapeRecorder()
    bw.find_batch(model, Sequences(n), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  budget=64 * KIB, max_batch_size=8)
    lengths = {shape[1] for shape in model.shapes}
    assert lengths == {n}  # every sample is read: the longest of all, not of a few spread ones
    # default_collate cannot stack the shortest beside it: the longest alone, repeated


def test_one_example_tensor_is_repeated_into_batches_and_the_output_mean_is_the_loss():
    model = ShapeRecorder()
    report = bw.find_batch(model, torch.zeros(3, 5), budget=64 * KIB, max_batch_size=16)
    assert report.max_batch_size > 1
    assert {shape[1:] for shape in model.shapes} == {(3, 5)}
    assert [shape[0] for shape in model.shapes[::2]] == [a.batch_size for a in report.attempts]


class LossInOutput(nn.Module):
    """A Hugging Face-style model: keyword inputs, and the loss inside the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.linear(features)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def test_a_dict_batch_is_passed_as_keywords_and_the_outputs_loss_is_used():
    model = LossInOutput()

    def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
        return {"features": torch.randn(batch_size, 8),
                "labels": torch.randint(0, 2, (batch_size,))}

    report = bw.find_batch(model, make_batch, budget=64 * KIB)
    assert report.max_batch_size > 0
    assert report.first_oom_batch_size == report.max_batch_size + 1


def test_without_an_optimizer_find_batch_probes_with_adamw():
    model = mlp()
    default = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy, budget=32 * KIB)
    explicit = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                             optimizer=torch.optim.AdamW(model.parameters()), budget=32 * KIB)
    assert default.max_batch_size == explicit.max_batch_size
    assert not any(p.grad is not None for p in model.parameters())


class AutocastRecorder(nn.Module):
    """Records whether autocast was on and the scale of the gradient reaching the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.autocast: list[tuple[bool, torch.dtype]] = []
        self.output_grad_scale: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        out = self.linear(x)
        out.register_hook(lambda grad: self.output_grad_scale.append(float(grad.abs().sum())))
        return out


@pytest.mark.parametrize(("amp", "dtype", "scaled"), [
    ("bf16", torch.bfloat16, False), ("fp16", torch.float16, True), (None, None, False)])
def test_amp_probes_under_autocast_and_fp16_scales_the_loss(amp, dtype, scaled):
    model = AutocastRecorder()
    torch.manual_seed(0)
    report = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), amp=amp,
                           budget=64 * KIB, max_batch_size=4)
    assert report.amp == amp
    enabled = {entry[0] for entry in model.autocast}
    assert enabled == {amp is not None}
    if amp is not None:
        assert {entry[1] for entry in model.autocast} == {dtype}
    # cross_entropy's gradient sums to at most 2 per sample: a GradScaler multiplies it by 2**16
    assert (min(model.output_grad_scale) > 1000) == scaled


def test_amp_bf16_fits_more_samples_than_fp32():
    model = mlp(width=128)
    reports = {amp: bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  amp=amp, budget="128KiB")
               for amp in (None, "bf16")}
    assert reports["bf16"].max_batch_size > reports[None].max_batch_size
    assert (reports["bf16"].memory_model.per_sample_bytes
            < reports[None].memory_model.per_sample_bytes)


def test_on_step_sees_every_attempt_as_it_finishes():
    seen = []
    model = mlp()
    report = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           budget=64 * KIB, on_step=seen.append)
    assert tuple(seen) == report.attempts


def test_each_attempt_records_size_fit_peak_memory_time_and_throughput():
    model = mlp()
    report = bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=64 * KIB)
    for attempt in report.attempts:
        assert attempt.peak_memory_bytes > 0
        if attempt.fake:  # traced on fake tensors first: nothing ran, nothing to time
            assert (attempt.step_time_s, attempt.samples_per_s) == (None, None)
        elif attempt.fits:
            assert attempt.peak_memory_bytes <= 64 * KIB
            assert attempt.step_time_s > 0
            assert attempt.samples_per_s == pytest.approx(attempt.batch_size / attempt.step_time_s)
        else:
            assert attempt.peak_memory_bytes > 64 * KIB
            assert (attempt.step_time_s, attempt.samples_per_s) == (None, None)
            assert attempt.error.startswith("BudgetExceededError: ")
    assert report.recommended_batch_size <= report.max_batch_size
    assert report.baseline_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads MemAvailable (Linux)")
def test_without_a_budget_the_cpu_probe_may_use_half_the_available_ram():
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo
                         if line.startswith("MemAvailable:"))
    report = bw.find_batch(lambda batch_size: None, device="cpu", max_batch_size=2)
    assert report.budget_bytes is None
    assert report.limit_bytes == pytest.approx(available / 2, rel=0.1)


class Broken(nn.Module):
    """A model with a bug that shows from the third size tried on (the first real size, when
    the first sizes are traced on fake tensors and the bug is deterministic, as most are)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.calls = 0
        self.error = ValueError("shapes do not match: the user's bug")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 5:  # two steps a size: the third size
            raise self.error
        return self.linear(x)


def test_an_error_from_the_users_model_says_what_find_batch_called_with_the_users_as_cause():
    model = Broken()
    with pytest.raises(ValueError, match="the user's bug") as info:
        bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy, budget=64 * KIB)
    error = info.value
    size = error.args[0].split("at batch size ")[1].split()[0]
    assert str(error).splitlines()[0] == (
        f"find_batch called model(batch[0]) with float32[{size}, 16] at batch size {size} "
        f"(real tensors), and it raised ValueError: shapes do not match: the user's bug")
    assert error.__cause__ is model.error  # the user's own error, as it was raised
    frames = [frame.name for frame in traceback.extract_tb(model.error.__traceback__)]
    assert frames[-1] == "forward"  # the user's frame is still there to debug
    files = [frame.filename for frame in traceback.extract_tb(model.error.__traceback__)]
    assert not [f for f in files if "batchwidgets" in f]  # none of the probe's own frames
    outer = traceback.extract_tb(error.__traceback__)
    assert [frame.name for frame in outer][-1] == "find_batch"  # raised from the public call


def test_an_oom_like_error_of_another_type_is_not_treated_as_out_of_memory():
    def step(batch_size: int) -> None:
        if batch_size > 2:
            raise ValueError("CUDA out of memory, says the user's own check")

    with pytest.raises(ValueError, match="user's own check") as info:
        bw.find_batch(step, device="cpu")
    assert str(info.value) == ("find_batch called step(4) at batch size 4 (real tensors), and "
                               "it raised ValueError: CUDA out of memory, says the user's own "
                               "check")
    assert str(info.value.__cause__) == "CUDA out of memory, says the user's own check"


def test_when_nothing_fits_one_error_carries_the_report_and_suggests_next_steps():
    model = mlp()
    with pytest.raises(bw.NoBatchSizeFits) as info:
        bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy,
                      optimizer=torch.optim.Adam(model.parameters()), budget="8KiB", start=4)
    error = info.value
    report = error.report
    assert isinstance(error, RuntimeError)
    # halving down on fake tensors first, then one real step confirms that 1 does not fit
    assert [(a.batch_size, a.fake) for a in report.attempts] == [
        (4, True), (2, True), (1, True), (1, False)]
    assert (report.max_batch_size, report.first_oom_batch_size) == (0, 1)
    assert report.stop_reason == "nothing fits"
    message = str(error)
    smallest = report.attempts[-1]
    assert smallest.peak_memory_bytes
    # Adam's states alone (10.8 KB) are over the 8 KiB: only what shrinks them (issue 46)
    for part in ("batch_size=1", "cpu", "a budget of 8.0 KiB", "states alone",
                 "model.to(torch.bfloat16)", "freezing the base weights", "smaller model"):
        assert part in message
    for part in ("accumulat", "amp=", "bytes"):  # nothing smaller than 1; the user's units
        assert part not in message.split(" Last error:")[0]


BAD_ARGUMENTS = {
    "model": ({"model": 42}, TypeError, "model=42"),
    "make_batch": ({"make_batch": None}, TypeError, "make_batch is required"),
    "make_batch type": ({"make_batch": 3.5}, TypeError, "float"),
    "amp": ({"amp": "fp8"}, ValueError, "amp='fp8'"),
    "multiple_of": ({"multiple_of": 0}, ValueError, "multiple_of=0"),
    "max_batch_size": ({"max_batch_size": 4, "multiple_of": 8}, ValueError, "max_batch_size=4"),
    "headroom": ({"headroom": 1.5}, ValueError, "headroom=1.5"),
    "steps_per_trial": ({"steps_per_trial": 0}, ValueError, "steps_per_trial=0"),
    "start multiple": ({"start": 6, "multiple_of": 4}, ValueError, "start=6"),
    "start zero": ({"start": 0}, ValueError, "start=0"),
    "start above max": ({"start": 8, "max_batch_size": 4}, ValueError, "max_batch_size=4"),
    "budget": ({"budget": "lots"}, ValueError, "budget='lots'"),
    "budget a fraction of a byte": ({"budget": 1.5}, ValueError, "budget=1.5"),
    "loss_fn": ({"loss_fn": 5}, TypeError, "loss_fn=5"),
    "on_step": ({"on_step": "print"}, TypeError, "on_step='print'"),
    "should_stop": ({"should_stop": True}, TypeError, "should_stop=True"),
    "target's GPU, counted": ({"target": "8xZ100"}, ValueError, "target='8xZ100'"),
}


@pytest.mark.parametrize(("overrides", "error_type", "shown"), BAD_ARGUMENTS.values(),
                         ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_raise_before_any_step_and_show_the_value(overrides, error_type, shown):
    model = ShapeRecorder()
    arguments = {"model": model, "make_batch": torch.zeros(3), **overrides}
    with pytest.raises(error_type) as info:
        bw.find_batch(**arguments)
    assert shown in str(info.value)
    assert "should" in str(info.value) or "required" in str(info.value)
    assert model.shapes == []


def test_slicing_a_preloaded_dataset_charges_only_the_batch_not_the_dataset():
    answers = []
    for rows in (1_000, 100_000):  # 64 KB and 6.4 MB of features, against a 64 KiB budget
        features, labels = torch.randn(rows, 16), torch.randint(0, 4, (rows,))
        model = mlp()
        def make_batch(batch_size, features=features, labels=labels):
            return features[:batch_size], labels[:batch_size]

        report = bw.find_batch(
            model, make_batch,
            loss_fn=nn.functional.cross_entropy,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=64 * KIB,
            max_batch_size=1_000)
        answers.append(report.max_batch_size)
    assert answers[0] == answers[1] > 100


def test_a_model_with_sparse_gradients_is_probed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Flatten(), nn.Linear(32, 2))
    report = bw.find_batch(model, lambda n: (torch.randint(0, 100, (n, 4)),
                                             torch.randint(0, 2, (n,))),
                           loss_fn=nn.functional.cross_entropy,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=64 * KIB)
    assert report.first_oom_batch_size == report.max_batch_size + 1


def test_synthetic_batches_make_random_inputs_and_labels_of_the_given_shape():
    make = SyntheticBatches((3, 8, 8), num_classes=10)
    inputs, labels = make(5)
    assert inputs.shape == (5, 3, 8, 8)
    assert labels.shape == (5,)
    assert int(labels.min()) >= 0
    assert int(labels.max()) < 10
    assert SyntheticBatches((4,))(2).shape == (2, 4)


# ---- forced options fail as ours, in one line (issue 22) ---------------------------------------

def test_seq_len_with_a_make_batch_of_one_parameter_says_to_add_seq_len():
    with pytest.raises(TypeError, match="seq_len") as info:
        bw.find_batch(mlp(), vectors, loss_fn=nn.functional.cross_entropy, seq_len=[8, 16])
    assert "\n" not in str(info.value)
    assert "def vectors(batch_size, seq_len)" in str(info.value)


@pytest.mark.parametrize("name", ["scaler", "scheduler"])
def test_a_scaler_or_scheduler_that_cannot_be_put_back_is_refused_before_anything_runs(name):
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=f"{name} should have state_dict") as info:
        bw.find_batch(model, vectors, loss_fn=nn.functional.cross_entropy, budget=64 * KIB,
                      **{name: object()})
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_amp_that_autocast_would_switch_off_is_refused_not_measured_in_float32():
    """The rule behind amp=: PyTorch's autocast warns "Disabling autocast" for a dtype a device
    does not support and runs in float32; the probe refuses it in one line instead (float64 on
    the CPU stands for bf16 on an MPS or CPU build without it)."""
    from batchwidgets.engine.probe import _checks

    _checks.check_amp("bf16", torch.device("cpu"))  # supported here: no error
    saved = dict(_checks.AMP_DTYPES)
    _checks.AMP_DTYPES["bf16"] = torch.float64
    try:
        with pytest.raises(ValueError, match="amp should be a precision autocast runs on cpu"):
            _checks.check_amp("bf16", torch.device("cpu"))
    finally:
        _checks.AMP_DTYPES.update(saved)


class CountedReads(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 16), torch.randint(0, 4, (n,))
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.reads += 1
        return self.x[index], self.y[index]


def test_the_dataset_is_read_once_for_the_probe_and_every_measured_what_if():
    """The arguments are resolved once (the probe's plan): the measured what-if probes reuse
    the samples read, instead of scanning the dataset again for each row."""
    data = CountedReads(40)
    model = mlp()
    report = bw.find_batch(model, data, loss_fn=nn.functional.cross_entropy, budget=64 * KIB,
                           what_if=True)
    assert [row.name for row in report.what_if if row.measured][:2] == ["bf16", "fp16"]
    assert data.reads == 40
