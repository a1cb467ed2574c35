"""``%critical_batch`` in a real IPython shell: the same report as ``critical_batch``, the
optimizer found in the notebook, a tracker that follows the result, and one-line errors."""

from __future__ import annotations

import pytest
import torch
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from torch import nn
from torch.utils.data import TensorDataset

import batchwidgets as bw


def regression() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=generator)
    w = torch.randn(16, 1, generator=generator)
    return TensorDataset(x, x @ w + torch.randn(4096, 1, generator=generator))


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)


NAMES = ("model", "data", "opt", "mse", "tracker", "report", "other", "model2")


@pytest.fixture
def ip():
    start_ipython()
    shell = get_ipython()
    model, optimizer = model_and_optimizer()
    shell.push({"model": model, "data": regression(), "opt": optimizer,
                "mse": nn.functional.mse_loss})
    shell.run_line_magic("load_ext", "batchwidgets")
    yield shell
    shell.run_line_magic("unload_ext", "batchwidgets")
    for name in NAMES:
        shell.user_ns.pop(name, None)


def test_the_magic_gives_the_functions_report_and_feeds_a_tracker(ip):
    ip.push({"tracker": bw.NoiseTracker()})
    report = ip.run_line_magic(
        "critical_batch", "model data --loss-fn mse --base-batch-size 4 --seeds 2 "
                          "--criterion loss --noise tracker")
    model, optimizer = model_and_optimizer()
    expected = bw.critical_batch(model, regression(), optimizer=optimizer,
                                 loss_fn=nn.functional.mse_loss, base_batch_size=4, seeds=2,
                                 criterion="loss")
    assert report == expected  # the optimizer found in the notebook: the only one training it
    assert ip.user_ns["tracker"].critical is report
    assert ip.user_ns["tracker"].report.schedule.source in ("critical_batch", "none")
    assert report.loss_criterion_batch_size is not None
    assert ip.run_line_magic("critical_batch", "model data --loss-fn mse --base-batch-size 4 "
                                               "--seeds 1;") is None


@pytest.mark.parametrize(("line", "expected"), [
    ("model", "the following arguments are required: DATA"),
    ("mse data --loss-fn mse", "MODEL should be a torch.nn.Module"),
    ("model dataa --loss-fn mse", "did you mean 'data'"),
    ("model data --loss-fn mse --seeds 0", "--seeds"),
    ("model data --loss-fn mse --criterion tokens", "invalid choice: 'tokens'"),
    ("model data --loss-fn mse --batch-sizes 4,8,200000", "--batch-sizes should be at most"),
    ("model data --loss-fn mse --noise opt", "--noise should be a batchwidgets.NoiseTracker"),
])
def test_mistakes_are_one_line_usage_errors(ip, line, expected):
    with pytest.raises(UsageError, match=expected) as caught:
        ip.run_line_magic("critical_batch", line)
    assert "\n" not in str(caught.value)


def test_an_optimizer_is_found_or_asked_for(ip):
    other, _ = model_and_optimizer()
    ip.push({"model2": other})
    with pytest.raises(UsageError, match="--optimizer is needed"):
        ip.run_line_magic("critical_batch", "model2 data --loss-fn mse")
    ip.push({"other": torch.optim.SGD(ip.user_ns["model"].parameters(), lr=0.05)})
    with pytest.raises(UsageError, match="2 optimizers in the notebook could be meant"):
        ip.run_line_magic("critical_batch", "model data --loss-fn mse")
