"""measure_noise(): gradient noise from per-example gradients, checked against plain autograd one
example at a time, brute-force enumeration of mini-batches and a closed-form linear regression."""

import itertools
import math
import pickle
import random

import pytest
import torch
from _noise_data import make_data, make_mlp
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

import batchwidgets as bw
from batchwidgets._warnings import BatchwidgetsWarning
from batchwidgets.results import LayerNoise, NoiseReport

loss_fn = nn.functional.cross_entropy


def oracle_gradients(model, dataset, loss=loss_fn):
    """Per-example gradients (N, P) and losses (N,), one autograd call per example."""
    rows, losses, blocks = [], [], None
    for x, y in dataset:
        value = loss(model(x[None]), y[None])
        grads = torch.autograd.grad(value, [p for p in model.parameters() if p.requires_grad])
        blocks = [g.numel() for g in grads]
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
        losses.append(value.detach())
    return torch.stack(rows).double(), torch.stack(losses).double(), blocks


class Stream(IterableDataset):
    """A dataset of unknown size: measure_noise measures its first items as a sample of an
    infinite population (the rule the tests of the data's generating distribution need)."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def trace_cov(g):
    return (g - g.mean(0)).square().sum(1).mean().item()


def assert_close(actual, expected, rel=1e-10):
    assert actual == pytest.approx(expected, rel=rel, abs=1e-14)


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_measure_noise_matches_per_example_autograd(method):
    model, data = make_mlp(), make_data(23)
    g, losses, blocks = oracle_gradients(model, data)
    report = bw.measure_noise(model, data, loss_fn, batch_sizes=(1, 4), chunk_size=5,
                              method=method)
    assert report.method == method
    assert report.n_examples == report.n_available == 23
    assert not report.sampled
    assert_close(report.trace_cov, trace_cov(g))
    assert_close(report.grad_norm_sq, g.mean(0).square().sum().item())
    g2 = g.mean(0).square().sum().item()
    assert_close(report.b_simple_plain, trace_cov(g) / g2)
    # the whole data set: B_simple of the data is exactly tr(cov) / |G|^2 (issue 41)
    assert report.population_rule == "whole"
    assert report.b_simple == report.b_simple_plain
    assert_close(report.loss_mean, losses.mean().item())
    assert_close(report.loss_variance, losses.var(correction=0).item())
    names = [name for name, _ in model.named_parameters()]
    assert [layer.name for layer in report.layers] == names
    for layer, block in zip(report.layers, g.split(blocks, dim=1)):
        assert_close(layer.trace_cov, trace_cov(block))
        assert_close(layer.grad_norm_sq, block.mean(0).square().sum().item())
    assert_close(sum(layer.trace_cov for layer in report.layers), report.trace_cov)


def test_vmap_and_loop_paths_agree_on_float32_and_auto_picks_vmap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = make_data(40).tensors
    data = TensorDataset(x.float(), y)
    auto = bw.measure_noise(model, data, loss_fn, chunk_size=16)
    loop = bw.measure_noise(model, data, loss_fn, chunk_size=16, method="loop")
    assert auto.method == "vmap"
    assert auto.trace_cov == pytest.approx(loop.trace_cov, rel=1e-5)
    assert auto.grad_norm_sq == pytest.approx(loop.grad_norm_sq, rel=1e-5)


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: vmap cannot trace it, a loop can."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3).double()

    def forward(self, x):
        out = self.linear(x)
        return out * 2 if out.sum().item() > 0 else out


def test_auto_falls_back_to_a_loop_when_vmap_cannot_run_the_model():
    torch.manual_seed(0)
    model, data = DataDependent(), make_data(12)
    with pytest.raises(RuntimeError):
        bw.measure_noise(model, data, loss_fn, method="vmap")
    report = bw.measure_noise(model, data, loss_fn, chunk_size=5)
    g, _, _ = oracle_gradients(model, data)
    assert report.method == "loop"
    assert_close(report.trace_cov, trace_cov(g))
    assert_close(report.grad_norm_sq, g.mean(0).square().sum().item())


def test_forced_vmap_on_a_model_vmap_cannot_run_says_method_in_one_line():
    model, data = DataDependent(), make_data(12)
    before = snapshot(model)
    with pytest.raises(ValueError, match="method") as info:
        bw.measure_noise(model, data, loss_fn, method="vmap")
    message = str(info.value)
    assert "\n" not in message
    assert "method='vmap'" in message
    assert "method='loop'" in message
    assert "leave method out" in message
    assert "vmap: " not in message  # PyTorch's own message is the cause, not the error
    assert isinstance(info.value, RuntimeError)  # the type vmap's failure had: old code holds
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_same(before, snapshot(model))


class OwnError(nn.Module):
    """A model whose own forward raises: the user's error, whatever the method."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3).double()

    def forward(self, x):
        raise LookupError("my model's own bug")


@pytest.mark.parametrize("method", ["vmap", "loop", "auto"])
def test_an_error_from_the_models_own_forward_keeps_its_type_and_cause_and_says_the_call(method):
    with pytest.raises(LookupError, match=r"^measure_noise called model\(batch\[0\]\) .*"
                                          r"it raised LookupError: my model's own bug$") as raised:
        bw.measure_noise(OwnError(), make_data(12), loss_fn, method=method)
    assert str(raised.value.__cause__) == "my model's own bug"  # the user's own error


@pytest.mark.parametrize("batch_size", [1, 2, 3, 6])
def test_grad_variance_matches_enumerating_every_mini_batch(batch_size):
    n, model, data = 6, make_mlp(), make_data(6)
    g, losses, _ = oracle_gradients(model, data)
    report = bw.measure_noise(model, data, loss_fn, batch_sizes=(batch_size,))

    def variance(batches, values):  # exact: every batch is equally likely
        means = torch.stack([values[list(b)].mean(0) for b in batches])
        return (means - values.mean(0)).square().reshape(len(means), -1).sum(1).mean().item()

    subsets = list(itertools.combinations(range(n), batch_size))
    tuples = list(itertools.product(range(n), repeat=batch_size))
    assert_close(report.grad_variance_without_replacement[batch_size], variance(subsets, g))
    assert_close(report.grad_variance_with_replacement[batch_size], variance(tuples, g))
    assert report.grad_variance == report.grad_variance_without_replacement
    assert_close(report.loss_variance_per_batch[batch_size], variance(subsets, losses))
    with_replacement = bw.measure_noise(model, data, loss_fn, batch_sizes=(batch_size,),
                                        replacement=True)
    assert with_replacement.replacement
    assert_close(with_replacement.grad_variance[batch_size], variance(tuples, g))
    assert_close(with_replacement.loss_variance_per_batch[batch_size], variance(tuples, losses))


def test_finite_sample_identities_hold_exactly():
    report = bw.measure_noise(make_mlp(), make_data(10), loss_fn, batch_sizes=(1, 5, 10, 20),
                              replacement=True)
    assert report.grad_variance_with_replacement[1] == report.trace_cov
    assert report.grad_variance_without_replacement[1] == report.trace_cov
    assert report.grad_variance_without_replacement[10] == 0.0
    assert 20 not in report.grad_variance_without_replacement  # no 20 of 10 without replacement
    assert report.grad_variance[20] == report.trace_cov / 20
    assert report.b_simple_plain == report.trace_cov / report.grad_norm_sq
    assert report.noise_floor == 0.0  # the whole data set: nothing sampled (issue 41)
    assert report.b_simple == report.trace_cov / report.grad_norm_sq


def test_linear_regression_matches_its_closed_form_noise():
    # y = x.w* + sigma*eps, x ~ N(0, I_d), loss 0.5 (x.w - y)^2 at w = w* + delta:
    # g_i = (x_i.delta - sigma eps_i) x_i, E g = delta, and by Isserlis' theorem
    # Cov g = |delta|^2 I + delta delta^T + sigma^2 I, so tr Cov = (d+1)|delta|^2 + d sigma^2.
    # Sample estimates with N = 4000 have a relative standard error of about 3%; tolerance 12%.
    n, d, sigma = 4000, 5, 0.5
    generator = torch.Generator().manual_seed(7)
    w_true = torch.randn(d, generator=generator, dtype=torch.float64)
    delta = 0.3 * torch.randn(d, generator=generator, dtype=torch.float64)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    y = x @ w_true + sigma * torch.randn(n, generator=generator, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w_true + delta)
    report = bw.measure_noise(model, TensorDataset(x, y[:, None]),
                              lambda out, target: 0.5 * (out - target).square().mean(),
                              max_examples=n, chunk_size=1000)
    expected_trace = (d + 1) * delta.square().sum().item() + d * sigma**2
    assert report.trace_cov == pytest.approx(expected_trace, rel=0.12)
    assert report.grad_norm_sq == pytest.approx(delta.square().sum().item(), rel=0.12)


class Noisy(nn.Module):
    """Dropout (uses the RNG in train mode), BatchNorm (buffers) and a frozen parameter."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(dropout),
                                  nn.Linear(8, 3)).double()
        self.body[0].bias.requires_grad_(False)

    def forward(self, x):
        return self.body(x)


def snapshot(model):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()], [m.training for m in model.modules()],
            torch.get_rng_state(), random.getstate())


def assert_same(before, after):
    for old, new in zip(before[:3], after[:3]):
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(old, new))
    assert before[3] == after[3]
    assert torch.equal(before[4], after[4])
    assert before[5] == after[5]


def test_model_gradients_buffers_modes_and_rng_are_untouched():
    torch.manual_seed(3)
    model = Noisy(dropout=0.5)
    model.train()
    model.body[1].eval()  # BatchNorm already in eval: no warning
    model(make_data(4).tensors[0]).sum().backward()  # gradients the user had
    before = snapshot(model)
    report = bw.measure_noise(model, make_data(20), loss_fn, chunk_size=8)
    assert_same(before, snapshot(model))
    assert not report.eval_batchnorm
    assert "body.0.bias" not in [layer.name for layer in report.layers]  # frozen: not measured


def test_batchnorm_in_train_mode_warns_and_is_measured_with_running_statistics():
    torch.manual_seed(3)
    model, data = Noisy(), make_data(12)
    with torch.no_grad():  # non-trivial running statistics
        model.body[1].running_mean.uniform_(-1, 1)
        model.body[1].running_var.uniform_(0.5, 2)
    before = snapshot(model)
    with pytest.warns(BatchwidgetsWarning, match="BatchNorm") as caught:
        report = bw.measure_noise(model, data, loss_fn)
    assert caught[0].filename == __file__  # stacklevel points at the user's line
    assert_same(before, snapshot(model))
    assert report.eval_batchnorm
    g, _, _ = oracle_gradients(model.eval(), data)
    assert_close(report.trace_cov, trace_cov(g))


def test_larger_data_is_measured_on_a_stated_evenly_spaced_sample():
    model, data = make_mlp(), make_data(100)
    report = bw.measure_noise(model, DataLoader(data, batch_size=7, shuffle=True), loss_fn,
                              max_examples=10)
    assert (report.n_examples, report.n_available, report.sampled) == (10, 100, True)
    subset = bw.measure_noise(model, Subset(data, range(0, 100, 10)), loss_fn)
    assert not subset.sampled
    assert report.trace_cov == subset.trace_cov
    assert report.grad_norm_sq == subset.grad_norm_sq


def test_a_list_of_examples_is_measured_as_the_dataset_of_them():
    # what a user holds without a Dataset class: a list of (x, y) pairs (or of dicts, or a
    # Hugging Face datasets.Dataset: anything with len() and [i])
    data = make_data(10)
    as_list = bw.measure_noise(make_mlp(), [data[i] for i in range(10)], loss_fn)
    assert as_list == bw.measure_noise(make_mlp(), data, loss_fn)


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"model": "model"}, TypeError, "model"),
    ({"data": torch.zeros(4, 5)}, TypeError, "data"),
    ({"loss_fn": None}, TypeError, "loss_fn"),  # (x, y) items and a model that takes no labels=
    ({"loss_fn": "mse"}, TypeError, "loss_fn"),
    ({"data": iter(make_data(10))}, TypeError, "data"),
    ({"batch_sizes": 8}, TypeError, "batch_sizes"),
    ({"batch_sizes": (0, 2)}, ValueError, "batch_sizes"),
    ({"batch_sizes": ()}, ValueError, "batch_sizes"),
    ({"batch_sizes": (16,)}, ValueError, "batch_sizes"),  # 16 > the 10 examples
    ({"max_examples": 1}, ValueError, "max_examples"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"method": "jacobian"}, ValueError, "method"),
    ({"data": make_data(1)}, ValueError, "data"),
    ({"data": {"x": torch.zeros(4, 5)}}, TypeError, "data"),  # columns, not examples
])
def test_bad_arguments_raise_one_line_errors_naming_the_argument(kwargs, error, name):
    arguments = {"model": make_mlp(), "data": make_data(10), "loss_fn": loss_fn,
                 "batch_sizes": (1, 2), **kwargs}
    with pytest.raises(error) as caught:
        bw.measure_noise(**arguments)
    message = str(caught.value)
    assert message.startswith(f"{name} should")
    assert "\n" not in message


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3).double()

    def forward(self, x, scale):
        return self.linear(x) * scale[:, None]


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_items_x_z_y_feed_the_model_x_and_z_and_the_loss_y(method):
    x, y = make_data(9).tensors
    scale = torch.linspace(0.5, 2, 9, dtype=torch.float64)
    torch.manual_seed(0)
    model = TwoInputs()
    report = bw.measure_noise(model, TensorDataset(x, scale, y), loss_fn, batch_sizes=(1,),
                              method=method)
    losses = [loss_fn(model(x[i:i + 1], scale[i:i + 1]), y[i:i + 1]) for i in range(9)]
    assert_close(report.loss_mean, torch.stack(losses).mean().item())


class DictModel(nn.Module):
    """Keyword inputs and a loss inside the output when given labels (as Hugging Face models)."""

    def __init__(self):
        super().__init__()
        self.mlp = make_mlp()

    def forward(self, features, labels=None):
        logits = self.mlp(features)
        loss = None if labels is None else loss_fn(logits, labels)
        return {"logits": logits, "loss": loss}


class Dicts(torch.utils.data.Dataset):
    def __init__(self, data, with_labels=True):
        self.data, self.with_labels = data, with_labels

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"features": x, "labels": y} if self.with_labels else {"features": x}


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_dict_items_use_the_models_own_loss_or_loss_fn_on_their_labels(method):
    data = make_data(11)
    g, _, _ = oracle_gradients(make_mlp(), data)
    own = bw.measure_noise(DictModel(), Dicts(data), batch_sizes=(1,), method=method)
    given = bw.measure_noise(DictModel(), Dicts(data), lambda out, y: loss_fn(out["logits"], y),
                             batch_sizes=(1,), method=method)
    for report in (own, given):
        assert report.method == method
        assert_close(report.trace_cov, trace_cov(g))
        assert_close(report.grad_norm_sq, g.mean(0).square().sum().item())
    with pytest.raises(TypeError, match="loss_fn should be given"):  # no labels, no .loss
        bw.measure_noise(DictModel(), Dicts(data, with_labels=False), batch_sizes=(1,))


def test_report_is_plain_data_and_its_html_escapes_every_value():
    report = NoiseReport(trace_cov=2.0, grad_norm_sq=0.5, loss_mean=1.0, loss_variance=0.25,
                         n_examples=10, n_available=None, sampled=True, batch_sizes=(1, 4, 20),
                         layers=(LayerNoise("<script>", 2.0, 0.5),))
    assert report.b_simple_plain == 4.0
    assert report.b_simple == pytest.approx(2.0 * 10 / 9 / (0.5 - 2.0 / 9))  # 8
    assert report.grad_variance == {1: 2.0, 4: 2.0 / 4 * 6 / 9}
    assert report.grad_variance_with_replacement[20] == 0.1
    assert pickle.loads(pickle.dumps(report)) == report
    html = report._repr_html_()
    assert "&lt;script&gt;" in html
    assert "<script>" not in html
    assert "without replacement" in html
    assert LayerNoise("w", 1.0, 0.0).b_simple == math.inf
    assert math.isnan(LayerNoise("w", 0.0, 0.0).b_simple)


# ---- issue 5: loaders that do not shuffle, and the advice ----------------------------------------

def test_a_loader_that_does_not_shuffle_is_a_warning_and_is_kept_in_the_report():
    model, data = make_mlp(), make_data(40)
    with pytest.warns(BatchwidgetsWarning, match="does not shuffle") as caught:
        report = bw.measure_noise(model, DataLoader(data, batch_size=8), loss_fn)
    message = str(caught[0].message)
    assert "reads its 40 examples in order (SequentialSampler, batch_size=8)" in message
    assert "shuffle=True" in message
    assert "measure_noise draws the examples itself" in message
    assert caught[0].filename == __file__
    assert report.warnings == (message[:-1],)
    assert report.batch_size == 8
    assert "Warning: the DataLoader does not shuffle" in report.advice
    assert "does not shuffle" in report._repr_html_()
    shuffled = bw.measure_noise(model, DataLoader(data, batch_size=8, shuffle=True), loss_fn)
    assert shuffled.warnings == ()
    assert (shuffled.trace_cov, shuffled.grad_norm_sq) == (report.trace_cov, report.grad_norm_sq)


def noise_report(b_simple, batch_sizes=(8, 32, 256), batch_size=None, n=1000):
    """A report of a whole data set whose B_simple is ``b_simple``: tr(cov) = b/2, |G|^2 = 1/2."""
    return NoiseReport(trace_cov=b_simple * 0.5, grad_norm_sq=0.5,
                       loss_mean=1.0, loss_variance=0.25, n_examples=n, n_available=n,
                       sampled=False, batch_sizes=batch_sizes, batch_size=batch_size)


def test_advice_gives_the_trade_off_at_each_batch_size_and_the_learning_rate():
    advice = noise_report(64.0).advice
    assert "critical batch size B_simple ≈ 64 examples (McCandlish et al. 2018)" in advice
    # S/S_min = 1 + 64/B and E/E_min = 1 + B/64 at B = 8, 32 and 256
    assert "at batch size B = 8: 9× the fewest steps and 1.12× the fewest examples" in advice
    assert "at batch size B = 32: 3× the fewest steps and 1.5× the fewest examples" in advice
    assert "at batch size B = 256: 1.25× the fewest steps and 5× the fewest examples" in advice
    # from the smallest size, 8, to 64: (1 + 8) / (1 + 1) = 4.5 against linear scaling's 8
    assert "from B = 8 to B' = 64: ×4.5 by the noise-scale rule at B_simple = 64" in advice
    assert "×8 by linear scaling" in advice
    assert "Goyal et al. 2017" in advice
    page = noise_report(64.0)._repr_html_()
    assert "<th>steps / S_min</th><th>examples / E_min</th>" in page
    assert "<td>9</td><td>1.12</td>" in page


def test_advice_at_the_loaders_batch_size_and_for_a_vanishing_gradient():
    advice = noise_report(1234.0, batch_size=128).advice
    assert "at the current batch B = 128: 10.6× the fewest steps and 1.1× the fewest" in advice
    assert "from B = 128 to B' = 1200:" in advice  # B_simple to two significant digits
    flat = NoiseReport(trace_cov=1.0, grad_norm_sq=0.0, loss_mean=1.0, loss_variance=0.0,
                       n_examples=4, n_available=4, sampled=False, batch_sizes=(1, 2))
    assert "is not finite" in flat.advice
    assert "<td>-</td><td>-</td>" in flat._repr_html_()


# ---- issue 13: few examples, error bars, frozen models and NaN losses --------------------------

def regression(n, offset, seed, dim=20):
    """Linear regression at w* + offset: B_simple = ((d+1)|delta|^2 + d) / |delta|^2 for the
    data (see test_linear_regression_matches_its_closed_form_noise); offset 0: pure noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    w = torch.randn(dim, 1, generator=generator, dtype=torch.float64)
    y = x @ w + torch.randn(n, 1, generator=generator, dtype=torch.float64)
    model = nn.Linear(dim, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w + offset * torch.randn(dim, 1, generator=generator,
                                                     dtype=torch.float64)).T)
    return model, TensorDataset(x, y)


@pytest.mark.parametrize("n", [16, 32, 64])
def test_few_examples_where_the_noise_dominates_are_not_measurable(n):
    """Issue 13: B_simple came out close to N (15.4, 31.7, 63.2) with confident advice."""
    model, data = regression(8 * n, offset=0.0, seed=n)
    report = bw.measure_noise(model, data, nn.functional.mse_loss, batch_sizes=(1,),
                              max_examples=n)
    assert not report.measurable
    assert report.reason.startswith(f"not measurable from {n} examples")
    assert "noise floor" in report.reason
    assert report.advice.startswith("critical batch size: not measurable")
    assert "Learning rate" not in report.advice  # no confident advice
    assert report.summary().startswith("B_simple: not measurable")
    assert "(not measurable)" in report._repr_html_()


def test_enough_examples_measure_b_simple_with_an_honest_error_bar():
    """Across 16 seeds the spread of B_simple matches the reported standard error (within the
    factor 2 a jackknife over 16 groups allows), and the true B_simple (22) lies inside."""
    streams = [regression(1024, offset=1.0, seed=s) for s in range(16)]
    reports = [bw.measure_noise(model, Stream(data), nn.functional.mse_loss, batch_sizes=(1,),
                                chunk_size=512, max_examples=512) for model, data in streams]
    assert all(r.measurable and r.reason == "" for r in reports)
    values = torch.tensor([r.b_simple for r in reports], dtype=torch.float64)
    errors = torch.tensor([r.b_simple_error for r in reports], dtype=torch.float64)
    assert 0.5 < values.std().item() / errors.mean().item() < 2
    assert abs(values.mean().item() - 21.0 * 512 / (512 + 21)) < 3 * errors.mean().item()
    assert f"± {reports[0].b_simple_error:.2g}"[:4] in reports[0].summary()


def test_the_error_bar_is_the_delete_a_group_jackknife_of_the_examples():
    model, data = make_mlp(), make_data(80)
    g, _, _ = oracle_gradients(model, data)
    g = g[:40]  # the first 40 of data of unknown size: the infinite-population rule
    report = bw.measure_noise(model, Stream(data), loss_fn, batch_sizes=(1,), chunk_size=7,
                              max_examples=40)
    groups = [torch.arange(40)[torch.arange(40) % 16 != k] for k in range(16)]

    def statistics(rows):
        n, mean = len(rows), rows.mean(0)
        trace = (rows - mean).square().sum(1).mean().item()
        g2 = mean.square().sum().item()
        return g2 - trace / (n - 1), trace * n / (n - 1) / (g2 - trace / (n - 1))

    left_out = torch.tensor([statistics(g[rows]) for rows in groups], dtype=torch.float64)
    expected = (15 / 16 * (left_out - left_out.mean(0)).square().sum(0)).sqrt()
    assert report.grad_norm_sq_error == pytest.approx(expected[0].item(), rel=1e-6)
    if (left_out[:, 0] > 0).all():
        assert report.b_simple_error == pytest.approx(expected[1].item(), rel=1e-6)
    else:  # a group left out leaves no signal above the floor: B_simple's error is unbounded
        assert report.b_simple_error is None
        assert not report.measurable


def test_a_frozen_model_is_a_one_line_error_with_the_fix():
    model = make_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="model") as caught:
        bw.measure_noise(model, make_data(8), loss_fn, batch_sizes=(1,))
    message = str(caught.value)
    assert message.startswith("model should have trainable parameters")
    assert "requires_grad_(True)" in message
    assert "\n" not in message


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_examples_with_a_nan_loss_are_left_out_with_a_warning(method):
    x, y = make_data(12).tensors
    x = x.clone()
    x[3] = math.nan
    model = make_mlp()
    with pytest.warns(BatchwidgetsWarning, match="1 of 12 examples had a non-finite loss"):
        report = bw.measure_noise(model, TensorDataset(x, y), loss_fn, batch_sizes=(1,),
                                  method=method)
    keep = [i for i in range(12) if i != 3]
    clean = bw.measure_noise(model, TensorDataset(x[keep], y[keep]), loss_fn, batch_sizes=(1,))
    assert report.n_examples == 11
    assert_close(report.trace_cov, clean.trace_cov)
    assert math.isfinite(report.b_simple)
    x[:] = math.nan
    with pytest.raises(ValueError, match="data should give finite losses"):
        bw.measure_noise(model, TensorDataset(x, y), loss_fn, batch_sizes=(1,))


def analytic_regression(n: int, seed: int, dim: int = 20, offset: float = 1.0):
    """``regression``'s task, with the data's true B_simple: g_i = 2 (x_i.delta - eps_i) x_i, so
    tr(Sigma) = 4((d+1)|delta|^2 + d) and |G|^2 = 4|delta|^2 (Isserlis' theorem)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    w = torch.randn(dim, 1, generator=generator, dtype=torch.float64)
    y = x @ w + torch.randn(n, 1, generator=generator, dtype=torch.float64)
    delta = offset * torch.randn(dim, 1, generator=generator, dtype=torch.float64)
    model = nn.Linear(dim, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w + delta).T)
    norm_sq = delta.square().sum().item()
    gradients = 2 * (x @ (w + delta) - y) * x  # per example, the oracle
    return model, TensorDataset(x, y), ((dim + 1) * norm_sq + dim) / norm_sq, gradients


def test_b_simple_does_not_grow_with_the_examples_and_its_error_bar_covers_the_truth():
    """Issue 27: the plain tr(cov)/|G_N|^2 is pulled toward N (E|G_N|^2 = |G|^2 + tr(Sigma)/N);
    the reported B_simple is not, at 64, 256 and 1024 examples, and its jackknife error bar
    covers the data's true value as a standard error should."""
    for n in (64, 256, 1024):
        rows = []
        for seed in range(12):
            model, data, truth, _ = analytic_regression(2 * n, seed)
            # the data's generating distribution is the population: data of unknown size
            report = bw.measure_noise(model, Stream(data), nn.functional.mse_loss,
                                      batch_sizes=(1,), chunk_size=n, max_examples=n)
            assert report.measurable, report.reason
            rows.append((report.b_simple - truth, report.b_simple_error,
                         report.b_simple_plain - truth))
        errors = torch.tensor(rows, dtype=torch.float64)
        bias, spread, plain_bias = errors.mean(0).tolist()
        assert abs(bias) < spread, (n, bias, spread)  # unbiased within one standard error
        covered = ((errors[:, 0] / errors[:, 1]).abs() < 2).double().mean().item()
        assert covered >= 0.75, (n, covered)
        if n == 64:  # the plain one is pulled toward N: B N/(N + B) - B, about -5.6 here
            assert plain_bias < -2 * spread / 12**0.5 < 0, (plain_bias, spread)


def test_the_error_bar_of_b_simple_is_the_jackknife_of_the_unbiased_ratio():
    model, data, _, g = analytic_regression(512, seed=3)
    g = g[:256]
    report = bw.measure_noise(model, Stream(data), nn.functional.mse_loss, batch_sizes=(1,),
                              chunk_size=100, max_examples=256)

    def ratio(rows):
        n, mean = len(rows), rows.mean(0)
        trace = (rows - mean).square().sum(1).mean().item()
        return trace * n / (n - 1) / (mean.square().sum().item() - trace / (n - 1))

    assert report.b_simple == pytest.approx(ratio(g), rel=1e-9)
    left_out = torch.tensor([ratio(g[torch.arange(256) % 16 != k]) for k in range(16)],
                            dtype=torch.float64)
    expected = (15 / 16 * (left_out - left_out.mean()).square().sum()).sqrt().item()
    assert report.b_simple_error == pytest.approx(expected, rel=1e-6)
