"""``%%find_batch --var NAME`` (issue 38): the user's own training cell probed. In a real IPython
shell: the same answer as ``find_batch(model, step=...)`` over the same code, every object the
cell names as it was, a loop stopped after one step, the cell's errors as the cell raised them;
and in a real kernel through nbclient."""

from __future__ import annotations

import json
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from _paths import ROOT
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from torch import nn

import batchwidgets as bw

BUDGET = "4MiB"

# the user's cell: one step of a plain loop, its variables left bound as a cell leaves them
STEP = """
xb = torch.randn(bs, 64)
yb = torch.randint(0, 512, (bs,))
out = model(xb)
loss = F.cross_entropy(out, yb)
loss.backward()
optimizer.step()
scheduler.step()
optimizer.zero_grad()
print(f"loss {loss.item():.3f}")
"""


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512))
    optimizer = torch.optim.Adam(model.parameters())
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.fixture
def ip():
    start_ipython()
    shell = get_ipython()  # one shell per process: what earlier tests' cells bound goes first
    made = ["xb", "yb", "loss", "bs", "step", "ema", "loader", "steps_taken", "history"]
    for name in made:
        shell.user_ns.pop(name, None)
    model, optimizer, scheduler = model_and_optimizer()
    pushed = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "torch": torch,
              "F": F, "out": "the user's own out"}
    shell.push(pushed)
    shell.run_line_magic("load_ext", "batchwidgets")
    yield shell
    shell.run_line_magic("unload_ext", "batchwidgets")
    for name in [*pushed, *made]:
        shell.user_ns.pop(name, None)


def as_step(namespace: dict, body: str):
    """The cell's code as step(batch_size): the same lines in a function whose variables are
    the notebook's globals, so they stay bound from one call to the next as the cell's do."""
    names = ", ".join(["xb", "yb", "out", "loss"])
    source = "def step(bs):\n    global " + names + "\n" + "".join(
        f"    {line}\n" for line in body.strip().splitlines())
    exec(compile(source, "<step>", "exec"), namespace)
    return namespace["step"]


def state(shell) -> dict:
    model, optimizer, scheduler = (shell.user_ns[n] for n in ("model", "optimizer", "scheduler"))
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "optimizer": repr(optimizer.state_dict()), "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(), "modes": [m.training for m in model.modules()]}


def assert_same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]) if x is not None)
    assert (a["optimizer"], a["scheduler"], a["modes"]) == (b["optimizer"], b["scheduler"],
                                                            b["modes"])
    assert torch.equal(a["rng"], b["rng"])


def test_the_cell_gives_the_answer_of_find_batch_over_the_same_code_and_changes_nothing(ip):
    model, optimizer = ip.user_ns["model"], ip.user_ns["optimizer"]
    x = torch.randn(4, 64)
    F.cross_entropy(model(x), torch.randint(0, 512, (4,))).backward()
    optimizer.step()  # state, and gradients held, as after a cell of training
    before = state(ip)
    by_cell = ip.run_cell_magic("find_batch", f"--var bs --budget {BUDGET}", STEP)
    assert_same(state(ip), before)
    assert ip.user_ns["out"] == "the user's own out"  # rebound by the cell: put back
    assert not {"xb", "yb", "loss", "bs"} & set(ip.user_ns)  # made by the cell: gone
    by_step = bw.find_batch(model, step=as_step(ip.user_ns, STEP), optimizer=optimizer,
                            scheduler=ip.user_ns["scheduler"], budget=BUDGET)
    assert (by_cell.max_batch_size, by_cell.first_oom_batch_size) == (
        by_step.max_batch_size, by_step.first_oom_batch_size)
    assert by_cell.loop == "your cell"
    # loss.item() reads a value back: no fake trace first, the real steps search alone
    assert "No fake trace first: aten._local_scalar_dense" in by_cell.method


def test_a_training_loop_is_stopped_after_one_step_and_what_it_keeps_is_measured(ip):
    ip.user_ns["steps_taken"] = []
    loop = """
for i in range(1000):
    xb = torch.randn(bs, 64)
    yb = torch.randint(0, 512, (bs,))
    out = model(xb)
    loss = F.cross_entropy(out, yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    steps_taken.append(i)
"""
    report = ip.run_cell_magic("find_batch", f"--var bs --budget {BUDGET}", loop)
    one_step = ip.run_cell_magic("find_batch", f"--var bs --budget {BUDGET}", STEP)
    assert report.max_batch_size == one_step.max_batch_size
    assert set(ip.user_ns["steps_taken"]) == {0}  # each run of the loop: one step
    assert [a.batch_size for a in report.attempts if a.fake][:2] == [2, 4]  # traced first


def test_an_ema_copy_and_the_rngs_the_cell_uses_come_back(ip):
    model = ip.user_ns["model"]
    ip.user_ns["ema"] = torch.optim.swa_utils.AveragedModel(model)
    ema = {k: v.clone() for k, v in ip.user_ns["ema"].state_dict().items()}
    cell = STEP + "ema.update_parameters(model)\n"
    rng = torch.get_rng_state()
    with_ema = ip.run_cell_magic("find_batch", f"--var bs --budget {BUDGET}", cell)
    after = ip.user_ns["ema"].state_dict()
    assert all(torch.equal(ema[k], after[k]) for k in ema)
    assert torch.equal(torch.get_rng_state(), rng)
    without = ip.run_cell_magic("find_batch", f"--var bs --budget {BUDGET}", STEP)
    assert with_ema.max_batch_size < without.max_batch_size  # its weights count


def test_an_error_in_the_cell_is_the_cells_own_with_the_batch_size_it_ran_at(ip):
    result = ip.run_cell("%%find_batch --var bs --budget 4MiB\n"
                         "xb = torch.randn(bs, 32)\n"
                         "out = model(xb)\n")
    error = result.error_in_exec
    assert isinstance(error, RuntimeError)
    assert str(error) == "mat1 and mat2 shapes cannot be multiplied (2x32 and 64x256)"
    assert error.__notes__ == ["find_batch called the cell with bs = 2 (real tensors)"]
    frames = traceback.extract_tb(error.__traceback__)
    assert not [f for f in frames if "batchwidgets/engine" in f.filename]
    assert not [f for f in frames if "_python_dispatch" in f.filename or "_compile" in f.filename]
    assert "out = model(xb)" in [f.line for f in frames]  # the cell's own line
    assert ip.user_ns["out"] == "the user's own out"


@pytest.mark.parametrize(("line", "cell", "message"), [
    ("--budget 4MiB", STEP, "%%find_batch needs --var NAME"),
    ("--var batch --budget 4MiB", STEP, "the cell never reads batch"),
    ("--var bs", "x = torch.randn(bs, 3)\n", "names no torch.nn.Module"),
    ("model --var bs", STEP, "leave MODEL, MAKE_BATCH and --input-shape out"),
    ("--var bs --keep-output no", STEP, "--keep-output should be left out with a step"),
])
def test_a_cell_magic_mistake_is_one_usage_error(ip, line, cell, message):
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("find_batch", line, cell)


def test_var_is_for_the_cell_and_model_for_the_line(ip):
    with pytest.raises(UsageError, match="--var goes with %%find_batch"):
        ip.run_line_magic("find_batch", "model --var bs")
    with pytest.raises(UsageError, match="MODEL is needed"):
        ip.run_line_magic("find_batch", "--budget 4MiB")


KERNEL_NOTEBOOK = [
    """
import json, torch, torch.nn.functional as F
import batchwidgets as bw
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 512))
optimizer = torch.optim.Adam(model.parameters())
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
ema = torch.optim.swa_utils.AveragedModel(model)
out = "the user's own out"

def snapshot():
    return repr([model.state_dict(), [p.grad for p in model.parameters()],
                 optimizer.state_dict(), scheduler.state_dict(), ema.state_dict(),
                 torch.get_rng_state().sum().item(), [m.training for m in model.modules()]])

before = snapshot()
%load_ext batchwidgets
""",
    "%%find_batch --var bs --budget 4MiB\n" + STEP.strip() + "\nema.update_parameters(model)\n",
    """
after = snapshot()
names = sorted(n for n in ("xb", "yb", "loss", "bs") if n in globals())
out_after = out
""",
    "%%find_batch --var bs --budget 4MiB\n" + STEP.strip() + "\n",
    """
by_cell = _

def step(bs):
    global xb, yb, out, loss
""" + "".join(f"    {line}\n" for line in STEP.strip().splitlines()) + """
by_step = bw.find_batch(model, step=step, optimizer=optimizer, scheduler=scheduler,
                        budget="4MiB")
print(json.dumps({"cell": by_cell.max_batch_size, "step": by_step.max_batch_size,
                  "same": before == after, "out": out_after, "names": names,
                  "loop": by_cell.loop}))
""",
]


@pytest.mark.slow
def test_in_a_real_kernel_the_cell_gives_find_batchs_answer_and_leaves_everything_as_it_was(
        monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports this checkout
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source.strip())
                                               for source in KERNEL_NOTEBOOK])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
    found = json.loads(printed.strip().splitlines()[-1])
    assert found == {"cell": found["step"], "step": found["step"], "same": True,
                     "out": "the user's own out", "names": [], "loop": "your cell"}
    assert found["step"] > 0
