"""Issue 41, "Every report tells one story": each case the issue met, as a test. The general check
over every report type, panel and tutorial is tests/results/test_report_consistency.py."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
from _noise_data import make_data, make_mlp
from _paths import ROOT
from conftest import cnn, images
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import batchwidgets as bw
from batchwidgets.results import CriticalBatchReport, NoiseReport


def biased_mlp():
    """make_mlp with its output pushed to one class: a mean gradient well above the noise."""
    model = make_mlp()
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([3.0, 0.0, 0.0]))
    return model


def per_example_gradients(model, data):
    rows = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x[None]), y[None])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows).double()


def trace_cov(g):
    return (g - g.mean(0)).square().sum(1).mean().item()


# ---- B_simple on a whole data set, and N of M ------------------------------------------------

def test_b_simple_of_a_whole_data_set_is_trace_cov_over_grad_norm_sq_exactly():
    """8 examples measured whole: nothing was sampled, so nothing is corrected (it read 1.196
    where tr(cov)/|G|^2 is 0.910), and there is no sampling error."""
    report = bw.measure_noise(make_mlp(), make_data(8), nn.functional.cross_entropy,
                              batch_sizes=(1, 8))
    assert not report.sampled
    assert report.grad_variance[8] == 0.0
    assert report.population_rule == "whole"
    assert report.b_simple == report.trace_cov / report.grad_norm_sq
    assert report.noise_floor == 0.0
    assert report.b_simple_error == 0.0
    assert "the whole data set" in report.summary()


def population(m, dim=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, dim, generator=generator, dtype=torch.float64) + 0.7


@pytest.mark.parametrize(("n", "m"), [(2, 6), (3, 7), (5, 8)])
def test_n_of_m_estimates_are_unbiased_over_every_sample(n, m):
    """The finite-population rule, against every one of the C(M, N) samples: the mean of the
    estimates is the population's tr(Sigma) (normalised by M) and |G|^2, to rounding."""
    g = population(m)
    truth_trace, truth_g2 = trace_cov(g), g.mean(0).square().sum().item()
    traces, signals = [], []
    for rows in itertools.combinations(range(m), n):
        sample = g[list(rows)]
        report = NoiseReport(trace_cov=trace_cov(sample),
                             grad_norm_sq=sample.mean(0).square().sum().item(), loss_mean=0.0,
                             loss_variance=0.0, n_examples=n, n_available=m, sampled=True,
                             batch_sizes=(1,))
        assert report.population_rule == "finite"
        traces.append(report.population_trace_cov)
        signals.append(report.population_grad_norm_sq)
    assert math.fsum(traces) / len(traces) == pytest.approx(truth_trace, rel=1e-12)
    assert math.fsum(signals) / len(signals) == pytest.approx(truth_g2, rel=1e-12)


def test_n_of_m_examples_use_the_finite_rule_and_its_error_bar_has_the_correction():
    """40 of 120 examples, evenly spaced: tr(cov) N/(N-1) (M-1)/M over |G_N|^2 - tr(cov)/(N-1)
    (M-N)/M, the jackknife error times sqrt(1 - N/M); the report names the rule."""
    model, data = biased_mlp(), make_data(120)
    report = bw.measure_noise(model, data, nn.functional.cross_entropy, batch_sizes=(1,),
                              max_examples=40, chunk_size=7)
    assert report.measurable
    n, m = 40, 120
    g = per_example_gradients(model, data)[[i * m // n for i in range(n)]]

    def estimates(rows):
        k = len(rows)
        trace, g2 = trace_cov(rows), rows.mean(0).square().sum().item()
        signal = g2 - trace / (k - 1) * (m - k) / m
        return signal, trace * k / (k - 1) * (m - 1) / m / signal

    assert report.population_rule == "finite"
    assert "finite-population rule" in report.summary()
    signal, b_simple = estimates(g)
    assert report.b_simple == pytest.approx(b_simple, rel=1e-9)
    assert report.population_grad_norm_sq == pytest.approx(signal, rel=1e-9)
    left_out = torch.tensor([estimates(g[torch.arange(n) % 16 != k]) for k in range(16)],
                            dtype=torch.float64)
    spread = (15 / 16 * (left_out - left_out.mean(0)).square().sum(0)).sqrt()
    correction = math.sqrt(1 - n / m)
    assert report.grad_norm_sq_error == pytest.approx(spread[0].item() * correction, rel=1e-6)
    assert report.b_simple_error == pytest.approx(spread[1].item() * correction, rel=1e-6)


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_data_of_unknown_size_uses_the_infinite_rule_and_says_so():
    model, data = biased_mlp(), make_data(60)
    report = bw.measure_noise(model, Stream(data), nn.functional.cross_entropy,
                              batch_sizes=(1,), max_examples=30)
    n = 30
    assert (report.n_available, report.population_rule) == (None, "infinite")
    assert report.b_simple == pytest.approx(
        report.trace_cov * n / (n - 1) / (report.grad_norm_sq - report.trace_cov / (n - 1)))
    assert "infinite-population rule" in report.summary()
    assert "unknown size" in dict(report.rows())["estimated from"]


# ---- two B_simple numbers for the same weights -------------------------------------------------

def critical_report(**fields):
    base = {"critical_batch_size": 70.0, "critical_batch_size_error": 9.0, "target_loss": 0.5,
            "start_loss": 1.0, "examples": 40_000, "ladder": (), "base_batch_size": 8,
            "s_min": 10.0, "e_min": 700.0, "lr_scaling": "linear", "b_simple": 67.3,
            "b_simple_error": 7.3, "examples_noise": 512, "seeds_fitted": 2}
    return CriticalBatchReport(**{**base, **fields})


def test_critical_batch_shows_b_simple_with_its_error_and_examples():
    """It said "B_simple 67.3 at the same weights (ratio 1)": no error, no sample size."""
    report = critical_report()
    summary = report.summary()
    assert "B_simple 67.3 ± 7.3 from 512 examples" in summary
    assert "67.3 ± 7.3 from 512 examples" in dict(report.rows())["B_simple at these weights"]
    # the ratio with its error, and whether the two numbers agree within them
    assert "ratio 1.04 ± 0.17" in summary
    assert "agree within their errors" in summary


def test_two_b_simple_estimates_say_whether_they_differ_within_their_errors():
    noise = NoiseReport(trace_cov=40.0,
                        grad_norm_sq=1.0, loss_mean=0.0, loss_variance=0.0, n_examples=1024,
                        n_available=1024, sampled=False, batch_sizes=(1,), b_simple_error=0.0)
    assert noise.b_simple == 40.0
    close = dataclass_replace(critical_report(), b_simple=40.0 + 7.0, b_simple_error=7.3)
    text = noise.compare(close)
    assert "B_simple 40 ± 0 from 1024 examples and 47 ± 7.3 from 512 examples" in text
    assert "agree within their errors" in text
    far = dataclass_replace(close, b_simple=80.0, b_simple_error=4.0)
    assert "differ by more than their errors" in noise.compare(far)


def dataclass_replace(report, **fields):
    import dataclasses

    return dataclasses.replace(report, **fields)


# ---- advice that contradicts itself ------------------------------------------------------------

def whole(b_simple, batch_sizes=(8, 32, 256), batch_size=None):
    """A report of a whole data set whose B_simple is ``b_simple`` exactly."""
    return NoiseReport(trace_cov=b_simple / 2, grad_norm_sq=0.5, loss_mean=1.0,
                       loss_variance=0.25, n_examples=1000, n_available=1000, sampled=False,
                       batch_sizes=batch_sizes, batch_size=batch_size, b_simple_error=0.0)


def test_the_learning_rate_advice_gives_each_rule_its_own_factor():
    """It said "multiply it by B'/B (linear scaling) ... from B = 8 to 81: x5.57 (linear
    scaling: x10.1; ...)": the rule named and the factor given differed."""
    advice = whole(81.4).advice
    assert "from B = 8 to B' = 81: ×5.57 by the noise-scale rule at B_simple = 81.4" in advice
    assert "×10.1 by linear scaling B'/B" in advice
    assert "multiply it by B'/B" not in advice


# ---- a report's rows disagree ------------------------------------------------------------------

@pytest.fixture(scope="module")
def probed():
    """The gallery's small CNN and its images (conftest.py) probed once for the tests that read
    its report (nothing remembered: its attempts are its own)."""
    return bw.find_batch(cnn(), images, loss_fn=nn.functional.cross_entropy,
                         budget="8MiB", device="cpu", cache=False)


def test_traced_row_names_the_fake_sizes_the_search_began_with(probed):
    """"traced: real steps" stood beside "Traced first on fake tensors (sizes 2, 4, 569)"."""
    report = probed
    fake = [a.batch_size for a in report.attempts if a.fake]
    real = [a.batch_size for a in report.attempts if not a.fake]
    assert fake
    assert "Traced first on fake tensors" in report.method
    traced = dict(report.rows())["traced"]
    assert traced.startswith(f"real steps at sizes {', '.join(map(str, real))}")
    assert f"fake tensors at sizes {', '.join(map(str, fake))}" in traced


def test_batches_from_says_what_the_batches_were_built_from(probed):
    """"64 samples of one size (all samples read)" for a 2,048-sample data set; "-" for a
    make_batch callable (the demo)."""
    x, y = images(2048)
    report = bw.find_batch(cnn(), TensorDataset(x, y), loss_fn=nn.functional.cross_entropy,
                           budget="8MiB", device="cpu")
    assert report.worst_case == ("64 of the 2,048 samples, in turn (all 2,048 samples read, all "
                                 "of one size)")
    assert dict(probed.rows())["batches from"] == "images(batch_size), called at each size tried"
    one = bw.find_batch(cnn(), x[0], loss_fn=lambda out: out.square().mean(),
                        budget="8MiB", device="cpu")
    assert one.worst_case == "one example tensor of shape (3, 8, 8), repeated"


def test_no_what_if_checkpoints_a_parameter_free_module_alone():
    """"checkpoint 3 (ReLU) 569 predicted": nobody checkpoints an activation by itself."""
    from batchwidgets.demo import small_cnn as demo_cnn
    from batchwidgets.demo import synthetic_images

    report = bw.find_batch(demo_cnn(), synthetic_images, loss_fn=nn.functional.cross_entropy,
                           budget="96MiB", device="cpu")
    checkpoints = [row.name for row in report.what_if if row.name.startswith("checkpoint ")]
    assert checkpoints
    assert not [name for name in checkpoints
                if re.search(r"\((ReLU|MaxPool2d|Flatten|AdaptiveAvgPool2d)\)", name)]


# ---- what-ifs where the docs promise them -------------------------------------------------------

def tiny_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def tokens(batch_size):
    ids = torch.randint(0, 1000, (batch_size, 64))
    return {"input_ids": ids, "labels": ids}


def test_a_target_plan_has_the_per_op_models_rows_without_what_if():
    """docs/planning.md: the per-op model's predicted rows are in every report; a plan for an
    A10G returned what_if == () unless what_if=True."""
    report = bw.find_batch(tiny_llama(), tokens, target="A10G")
    assert report.what_if
    assert all(not row.measured for row in report.what_if)
    names = [row.name for row in report.what_if]
    assert "SGD without momentum (no optimizer state)" in names
    assert "bf16" not in names  # planned again only with what_if=True


# ---- the static text ---------------------------------------------------------------------------

def test_the_text_form_is_the_answer_and_the_summary_and_repr_keeps_every_field(probed):
    """text/plain was the whole dataclass repr (9,679 characters for a small probe)."""
    pretty = pytest.importorskip("IPython.lib.pretty")
    report = probed
    text = pretty.pretty(report)
    assert len(text) <= 1500
    assert text == str(report)
    assert report.summary() in text
    assert "repr(report)" in text
    assert repr(report).startswith("BatchSizeReport(max_batch_size=")
    assert "attempts=(Attempt(" in repr(report)
    noise = whole(81.4)
    assert len(str(noise)) <= 1500
    assert str(noise).startswith(f"NoiseReport: {noise.summary()}")


# ---- the notebooks' install cell --------------------------------------------------------------

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_the_install_cell_installs_from_the_repository_and_says_so(path):
    """`%pip install batchwidgets` fails: the package is not on the package index."""
    cells = json.loads(path.read_text())["cells"]
    install = "".join(cells[1]["source"])
    assert "%pip install batchwidgets" not in install
    assert '"batchwidgets @ git+https://github.com/batchwidgets/batchwidgets"' in install
    said = re.findall(r"print\((.*?)\)\n", install, re.DOTALL)
    assert len(said) == 1
    assert "not on PyPI yet" in said[0]
    assert cells[1]["outputs"] == []  # installed here: nothing to say, nothing for nbval
    intro = "".join(cells[0]["source"])
    assert "colab-badge" in intro
    assert "installs batchwidgets from this repository" in intro


# ---- docs/ says what each field means ---------------------------------------------------------

def test_docs_say_what_every_field_of_every_report_means():
    """docs/reports.md: under the heading that names each report (or part), a row per field,
    `field` | one line (parts listed together write `Class.field`)."""
    import dataclasses

    from batchwidgets import results

    page = (ROOT / "docs" / "reports.md").read_text()
    sections = re.split(r"^#{2,3} ", page, flags=re.MULTILINE)[1:]
    row = re.compile(r"^\| `([\w.]+)` \| (?:[^|\\]|\\.)+ \|$", re.MULTILINE)
    missing = []
    for name in results.__all__:
        cls = getattr(results, name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        rows = set()
        for section in sections:
            heading, _, body = section.partition("\n")
            found = set(row.findall(body))
            rows |= {r.removeprefix(f"{name}.") for r in found if r.startswith(f"{name}.")}
            if f"`{name}`" in heading:
                rows |= found
            for line in body.splitlines():  # a part named in a row, its fields in brackets
                if f"`{name}`" in line and "(" in line:
                    rows |= set(re.findall(r"`(\w+)`", line.partition(f"`{name}`")[2]))
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if f.name not in rows]
    assert missing == []
