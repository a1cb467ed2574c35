"""``%find_batch`` in a real IPython shell: parity with ``find_batch``, errors, display, loading."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import subprocess
import sys
import weakref

import pytest
import torch
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from torch import nn

import batchwidgets as bw
from batchwidgets.engine import declared
from batchwidgets.engine.probe import FindBatchRequest
from batchwidgets.results import BatchSizeReport

BUDGET = "256KiB"  # a few hundred samples of the tiny model: each probe takes a second or two


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def measured(report: BatchSizeReport) -> BatchSizeReport:
    """The report without step times: everything else is deterministic under a CPU budget."""
    attempts = tuple(dataclasses.replace(a, step_time_s=None) for a in report.attempts)
    return dataclasses.replace(report, attempts=attempts)


@pytest.fixture
def ip():
    start_ipython()  # the shared test shell; returns it only on the first call
    shell = get_ipython()
    model = tiny_model()
    shell.push({"model": model, "make_batch": make_batch, "loss_fn": nn.functional.cross_entropy,
                "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    shell.run_line_magic("load_ext", "batchwidgets")
    yield shell
    shell.run_line_magic("unload_ext", "batchwidgets")
    for name in ("model", "make_batch", "loss_fn", "opt", "steps", "boom", "report", "data",
                 "recording_batch", "X", "Y", "opt2", "sched", "acc_report", "torch"):
        shell.user_ns.pop(name, None)


PARITY_CASES = [
    ("model make_batch --optimizer opt --loss-fn loss_fn --budget 256KiB",
     {"optimizer": "opt", "loss_fn": "loss_fn", "budget": BUDGET}),
    ("model make_batch --optimizer opt --loss-fn loss_fn --budget 256KiB --max-batch-size 64 "
     "--multiple-of 8 --headroom 0.5 --steps-per-trial 1 --start 8 --device cpu",
     {"optimizer": "opt", "loss_fn": "loss_fn", "budget": BUDGET, "max_batch_size": 64,
      "multiple_of": 8, "headroom": 0.5, "steps_per_trial": 1, "start": 8, "device": "cpu"}),
    ("model make_batch --optimizer opt --loss-fn loss_fn --budget 256KiB --keep-output no",
     {"optimizer": "opt", "loss_fn": "loss_fn", "budget": BUDGET, "keep_output": False}),
]


@pytest.mark.parametrize(("line", "options"), PARITY_CASES)
def test_magic_and_function_give_equal_reports(ip, line, options):
    by_magic = ip.run_line_magic("find_batch", line)
    named = {k: ip.user_ns[v] if k in ("optimizer", "loss_fn") else v for k, v in options.items()}
    by_function = bw.find_batch(ip.user_ns["model"], make_batch, **named)
    assert measured(by_magic) == measured(by_function)
    assert by_magic.headroom == options.get("headroom", 0.9)


def sequences(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, seq_len, 16), torch.randint(0, 4, (batch_size, seq_len))


def per_token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def test_seq_len_target_and_what_if_flags_equal_the_function(ip):
    ip.push({"sequences": sequences, "per_token_loss": per_token_loss})
    by_magic = ip.run_line_magic(
        "find_batch", "model sequences --loss-fn per_token_loss --budget 256KiB --seq-len 4,8 -q")
    by_function = bw.find_batch(ip.user_ns["model"], sequences, loss_fn=per_token_loss,
                                budget=BUDGET, seq_len=[4, 8])
    assert by_magic.frontier == by_function.frontier
    assert by_magic.frontier[4] > by_magic.frontier[8]
    planned = ip.run_line_magic("find_batch", "model make_batch --loss-fn loss_fn --target T4 -q")
    assert planned.target == "T4"
    assert planned.max_batch_size == bw.find_batch(
        ip.user_ns["model"], make_batch, loss_fn=nn.functional.cross_entropy,
        target="T4").max_batch_size
    with_rows = ip.run_line_magic(
        "find_batch", "model make_batch --loss-fn loss_fn --budget 256KiB --what-if -q")
    assert any(row.measured for row in with_rows.what_if)
    for flags, fragment in [("--seq-len 0,4", "--seq-len"), ("--target TPU", "--target")]:
        with pytest.raises(UsageError, match=fragment):
            ip.run_line_magic("find_batch", f"model make_batch {flags} -q")
    with pytest.raises(UsageError) as error:  # flags in the words, the code sample as written
        ip.run_line_magic("find_batch", "model make_batch --seq-len 4,8 -q")
    assert "with --seq-len" in str(error.value)
    assert "def make_batch(batch_size, seq_len)." in str(error.value)
    ip.user_ns.pop("sequences")
    ip.user_ns.pop("per_token_loss")


@pytest.mark.parametrize("source", ["dataset", "loader", "tensor"])
def test_make_batch_may_name_a_dataset_a_dataloader_or_a_tensor(ip, source):
    dataset = torch.utils.data.TensorDataset(*make_batch(64))
    data = {"dataset": dataset, "loader": torch.utils.data.DataLoader(dataset, batch_size=8),
            "tensor": torch.randn(16)}[source]
    ip.push({"data": data})
    # (x, y) items need the loss that reads y (issue 13); an example tensor has no target
    loss = {} if source == "tensor" else {"loss_fn": ip.user_ns["loss_fn"]}
    by_magic = ip.run_line_magic("find_batch", "model data --optimizer opt --budget 256KiB"
                                 + (" --loss-fn loss_fn" if loss else ""))
    by_function = bw.find_batch(ip.user_ns["model"], data, optimizer=ip.user_ns["opt"],
                                budget=BUDGET, **loss)
    assert measured(by_magic) == measured(by_function)
    ip.user_ns.pop("data")


def test_input_shape_and_num_classes_probe_synthetic_classification_batches(ip):
    report = ip.run_line_magic("find_batch", "model --input-shape 16 --num-classes 4 "
                                             "--optimizer opt --budget 256KiB")
    reference = bw.find_batch(ip.user_ns["model"], make_batch, optimizer=ip.user_ns["opt"],
                              loss_fn=nn.functional.cross_entropy, budget=BUDGET)
    assert report.worst_case == ("random inputs of shape (16,) with labels of 4 classes "
                                 "(--input-shape)")
    assert measured(report) == dataclasses.replace(measured(reference),
                                                   worst_case=report.worst_case)


def test_a_step_function_needs_no_make_batch(ip):
    def steps(batch_size: int) -> None:
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
    ip.push({"steps": steps})
    report = ip.run_line_magic("find_batch", "steps --device cpu")
    assert (report.max_batch_size, report.first_oom_batch_size) == (40, 41)


def test_every_find_batch_option_is_a_flag(ip):
    manual = ip.find_line_magic("find_batch").__doc__
    callables = ("model", "make_batch", "on_step", "should_stop")
    options = [p for p in inspect.signature(bw.find_batch).parameters if p not in callables]
    assert [o for o in options if declared(FindBatchRequest, o).flag_name not in manual] == []
    assert "--no-cache" in manual  # cache=False
    assert "--refresh" in manual
    assert "batchwidgets.find_batch" in manual
    assert "--input-shape" in manual
    assert "--num-classes" in manual
    assert "-q, --quiet" in manual


def test_question_mark_shows_the_manual(ip, capsys):
    ip.run_cell("%find_batch?")
    out = capsys.readouterr().out
    assert "%find_batch [--loss-fn NAME]" in out
    assert "--budget SIZE" in out


@pytest.mark.parametrize(("line", "expected"), [
    ("modle make_batch", "name 'modle' is not defined in the notebook; did you mean 'model'? "
                         "models in the notebook: model."),
    ("model make_btch", "did you mean 'make_batch'?"),
    ("model", "MAKE_BATCH is needed with a model"),
    ("model make_batch --optimizer model", "--optimizer should be a torch.optim.Optimizer, but "
                                           "got --optimizer=model (a Sequential); optimizers "
                                           "in the notebook: opt."),
    ("model.encoder make_batch", "model (a Sequential) has no attribute 'encoder'"),
    ("model make_batch --bugdet 1MiB", "did you mean --budget?"),
    ("model make_batch --budget 12XB", "argument --budget: budget should be a size such as"),
    ("model make_batch --amp bf61", "invalid choice: 'bf61'"),
    ("model make_batch --device cuda:7", "available here: cpu"),
    ("model make_batch --headroom 1.5", "--headroom should be in (0, 1], but got --headroom "
                                        "1.5; use e.g. --headroom 0.9"),
    ("model make_batch --headroom x", "argument --headroom: should be a number, but got 'x'"),
    ("model make_batch --max-batch-size 0", "--max-batch-size should be an int >= "
                                            "--multiple-of (1), but got --max-batch-size 0"),
    ("model --input-shape 3,a", "should be the shape of one example such as 3,32,32"),
    ("model make_batch --input-shape 16", "give MAKE_BATCH or --input-shape, not both"),
    ("model make_batch --num-classes 4", "--num-classes goes with --input-shape"),
])
def test_mistakes_are_one_line_usage_errors(ip, line, expected):
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("find_batch", line)
    message = str(error.value)
    assert expected in message
    assert "\n" not in message


def test_errors_from_the_users_model_propagate_with_their_traceback(ip, capsys):
    class Broken(nn.Linear):
        def forward(self, x):
            raise ValueError("shapes do not match in my model")
    ip.push({"boom": Broken(16, 4)})
    with pytest.raises(ValueError, match="shapes do not match"):
        ip.run_line_magic("find_batch", "boom make_batch --loss-fn loss_fn --budget 256KiB")
    result = ip.run_cell("%find_batch boom make_batch --loss-fn loss_fn --budget 256KiB")
    assert isinstance(result.error_in_exec, ValueError)
    assert "def forward" in capsys.readouterr().out  # the full traceback, into the user's code


def test_the_report_is_the_value_and_is_kept_in_underscore(ip, capsys):
    result = ip.run_cell("%find_batch model make_batch --optimizer opt --loss-fn loss_fn "
                         "--budget 256KiB")
    assert isinstance(result.result, BatchSizeReport)
    assert ip.user_ns["_"] is result.result
    assert "BatchSizeReport: max_batch_size=" in capsys.readouterr().out  # a terminal: no widgets
    ip.run_cell("report = %find_batch model make_batch --optimizer opt --loss-fn loss_fn "
                "--budget 256KiB -q")
    assert measured(ip.user_ns["report"]) == measured(result.result)


def test_a_trailing_semicolon_silences_the_output_and_skips_the_parser(ip, capsys):
    result = ip.run_cell("%find_batch model make_batch --optimizer opt --loss-fn loss_fn "
                         "--budget 256KiB;")
    assert result.error_in_exec is None
    assert isinstance(result.result, BatchSizeReport)
    assert "BatchSizeReport" not in capsys.readouterr().out
    ip.run_cell("_")  # only that one display was skipped
    assert "BatchSizeReport: max_batch_size=" in capsys.readouterr().out


def test_after_ooms_nothing_the_probe_allocated_stays_alive(ip):
    created = []

    def recording_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = make_batch(batch_size)
        created.extend(weakref.ref(t) for t in batch)
        return batch
    ip.push({"recording_batch": recording_batch})
    report = ip.run_line_magic("find_batch", "model recording_batch --optimizer opt "
                                             "--loss-fn loss_fn --budget 256KiB")
    gc.collect()
    assert report.n_ooms >= 1
    assert [ref for ref in created if ref() is not None] == []
    ip.user_ns.pop("recording_batch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_real_ooms_the_gpu_has_its_memory_back(ip):
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    ip.push({"gpu_model": model, "gpu_opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    report = ip.run_line_magic("find_batch", "gpu_model --input-shape 4096 --num-classes 10 "
                                             "--optimizer gpu_opt --budget 1GiB")
    assert report.n_ooms >= 1
    assert torch.cuda.memory_allocated() == before
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(int(free * 0.8), dtype=torch.uint8, device="cuda")  # as before the probe
    del big
    ip.user_ns.pop("gpu_model")
    ip.user_ns.pop("gpu_opt")


def test_unload_and_reload_ext(ip):
    hooks = ip.events.callbacks["post_run_cell"]
    ip.run_line_magic("unload_ext", "batchwidgets")
    assert ip.find_line_magic("find_batch") is None
    assert "BatchMagics" not in ip.magics_manager.registry
    ip.run_line_magic("load_ext", "batchwidgets")
    ip.run_line_magic("reload_ext", "batchwidgets")
    assert ip.find_line_magic("find_batch") is not None
    assert len([h for h in hooks if getattr(h, "__qualname__", "") == "_HideOnce.disarm"]) == 1


def test_import_batchwidgets_loads_no_jupyter_and_no_torch():
    code = ("import sys, batchwidgets; "
            "print(sorted(m for m in ('torch', 'IPython', 'ipywidgets', 'matplotlib') "
            "if m in sys.modules)); "
            "print(callable(batchwidgets.load_ipython_extension))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


KERNEL_CELLS = [
    """import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def make_batch(n): return torch.randn(n, 16), torch.randint(0, 4, (n,))
%load_ext batchwidgets""",
    "%find_batch model make_batch --optimizer opt --loss-fn nn.functional.cross_entropy "
    "--budget 256KiB",
    "type(_).__name__, _.max_batch_size",
    "%find_batch model make_batch --optimizer opt --loss-fn nn.functional.cross_entropy "
    "--budget 256KiB -q",
    "%find_batch model make_batch --optimizer opt --loss-fn nn.functional.cross_entropy "
    "--budget 256KiB;",
    "report = %find_batch model make_batch --optimizer opt --loss-fn "
    "nn.functional.cross_entropy --budget 256KiB\nreport.max_batch_size == _.max_batch_size",
]


@pytest.mark.slow
def test_in_a_kernel_the_panel_shows_the_report_and_the_line_returns_it():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in KERNEL_CELLS])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    setup, shown, value, quiet, silenced, assigned = (cell.outputs for cell in notebook.cells)
    assert setup == []
    assert [o.output_type for o in shown] == ["display_data"]  # the panel, no second copy
    assert "application/vnd.jupyter.widget-view+json" in shown[0].data
    assert "<td>recommended_batch_size</td>" in shown[0].data["text/html"]  # final state
    assert value[0].data["text/plain"].startswith("('BatchSizeReport', ")
    assert [o.output_type for o in quiet] == ["execute_result"]
    assert "application/vnd.jupyter.widget-view+json" not in quiet[0].data
    assert '<img alt="batchwidgets plot" src="data:image/png;base64,' in quiet[0].data["text/html"]
    assert silenced == []
    assert [o.output_type for o in assigned] == ["display_data", "execute_result"]
    assert "application/vnd.jupyter.widget-view+json" in assigned[0].data
    assert assigned[1].data["text/plain"] == "True"


# ---- %%accumulate -------------------------------------------------------------------------------

LOOP = """
for i in range(0, 48, 4):
    loss = loss_fn(model(X[i:i + 4]), Y[i:i + 4])
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture
def data(ip):
    generator = torch.Generator().manual_seed(3)
    ip.push({"torch": torch, "X": torch.randn(48, 16, generator=generator),
             "Y": torch.randint(0, 4, (48,), generator=generator)})
    return ip.user_ns["X"], ip.user_ns["Y"]


def test_accumulate_cell_equals_the_accumulate_function(ip, data):
    X, Y = data
    report = ip.run_cell_magic("accumulate", "4", LOOP)
    reference = tiny_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps=4, model=reference) as acc:
        for i in range(0, 48, 4):
            nn.functional.cross_entropy(reference(X[i:i + 4]), Y[i:i + 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert report == acc.report
    assert (report.steps, report.micro_steps, report.real_steps) == (4, 12, 3)
    for ours, theirs in zip(ip.user_ns["model"].parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    assert "step" not in vars(ip.user_ns["opt"])  # the optimizer is itself again


def test_accumulate_finds_the_scheduler_of_the_optimizer(ip, data):
    ip.run_cell("sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)")
    ip.run_cell_magic("accumulate", "4", LOOP + "    sched.step()\n")
    assert ip.user_ns["sched"].get_last_lr() == pytest.approx([0.1 / 2**3])  # 3 updates


def test_accumulate_with_several_optimizers_is_a_usage_error_listing_them(ip, data):
    ip.run_cell("opt2 = torch.optim.Adam(model.parameters())")
    with pytest.raises(UsageError, match="opt, opt2") as error:
        ip.run_cell_magic("accumulate", "4", LOOP)
    assert "--optimizer NAME" in str(error.value)
    report = ip.run_cell_magic("accumulate", "4 --optimizer opt2", "pass")
    assert report.micro_steps == 0


def test_accumulate_without_an_optimizer_says_so(ip):
    ip.user_ns.pop("opt")
    with pytest.raises(UsageError, match=r"no optimizers in the notebook"):
        ip.run_cell_magic("accumulate", "4", "pass")


@pytest.mark.filterwarnings("ignore::batchwidgets._warnings.BatchwidgetsWarning")
def test_accumulate_batch_size_takes_the_micro_batch_from_the_probe(ip, data):
    ip.run_cell("report = %find_batch model make_batch --optimizer opt --loss-fn loss_fn "
                "--budget 256KiB -q")
    recommended = ip.user_ns["report"].recommended_batch_size
    acc_report = ip.run_cell_magic("accumulate", "--batch-size 1024 --probe report", "pass")
    assert acc_report.target_batch_size == 1024
    assert acc_report.micro_batch_size == recommended
    assert acc_report.steps == -(-1024 // recommended)


def test_accumulate_errors_from_the_cell_propagate_and_restore(ip, data):
    with pytest.raises(ZeroDivisionError):
        ip.run_cell_magic("accumulate", "4", "loss_fn(model(X), Y).backward()\nopt.step()\n1/0")
    assert "step" not in vars(ip.user_ns["opt"])


def test_accumulate_manual_names_the_function(ip, capsys):
    ip.run_cell("%%accumulate?")
    shown = capsys.readouterr().out
    assert "batchwidgets.accumulate" in shown
    assert "--batch-size" in shown


# ---- %%accumulate --noise ------------------------------------------------------------------------

NOISE_LOOP = "for epoch in range(3):\n" + "".join(f"    {line}\n" for line in LOOP.splitlines())


@pytest.fixture
def noise_ip(ip, data):
    made = ("noise_tracker", "tracker", "accumulated")
    for name in made:  # one shell per process: what another file's cells bound goes first
        ip.user_ns.pop(name, None)
    yield ip
    for name in made:
        ip.user_ns.pop(name, None)


def test_accumulate_noise_tracks_the_same_numbers_as_the_function(noise_ip):
    X, Y = noise_ip.user_ns["X"], noise_ip.user_ns["Y"]
    report = noise_ip.run_cell_magic("accumulate", "4 --noise", NOISE_LOOP)
    tracked = noise_ip.user_ns["noise_tracker"].report
    reference = tiny_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tracker = bw.NoiseTracker()
    with bw.accumulate(optimizer, steps=4, model=reference, noise=tracker) as acc:
        for _ in range(3):
            for i in range(0, 48, 4):
                nn.functional.cross_entropy(reference(X[i:i + 4]), Y[i:i + 4]).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert report == acc.report  # the magic still returns the accumulation report
    assert tracked == tracker.report
    assert (tracked.n_updates, tracked.micro_batch_size, len(tracked.losses)) == (9, 4, 36)
    assert tracked.trace_cov is not None  # estimated (48 examples are too few for B_simple)


def test_accumulate_noise_name_goes_on_with_that_tracker(noise_ip):
    tracker = bw.NoiseTracker()
    noise_ip.push({"tracker": tracker})
    noise_ip.run_cell_magic("accumulate", "4 --noise tracker", LOOP)
    noise_ip.run_cell_magic("accumulate", "4 --noise tracker", LOOP)
    assert tracker.report.n_updates == 6
    assert "noise_tracker" not in noise_ip.user_ns
    noise_ip.run_cell_magic("accumulate", "4 --noise", LOOP)  # a bare --noise starts afresh
    assert noise_ip.user_ns["noise_tracker"].report.n_updates == 3
    assert noise_ip.user_ns["noise_tracker"] is not tracker


@pytest.mark.parametrize(("line", "expected"), [
    ("4 --noise trackr", "--noise: name 'trackr' is not defined in the notebook; did you mean "
                         "'tracker'? noise trackers in the notebook: tracker."),
    ("4 --noise X", "--noise should be a batchwidgets.NoiseTracker, but got --noise=X (a Tensor)"),
    ("--noise 4", "--noise takes the name of a NoiseTracker, but got --noise 4; give N first: "
                  "%%accumulate 4 --noise."),
    ("4 --noise 3", "--noise takes the name of a NoiseTracker, but got --noise 3; leave 3 out "
                    "(%%accumulate 4 --noise) or name a tracker."),
])
def test_accumulate_noise_mistakes_are_one_line_usage_errors(noise_ip, line, expected):
    noise_ip.push({"tracker": bw.NoiseTracker()})
    with pytest.raises(UsageError) as error:
        noise_ip.run_cell_magic("accumulate", line, "raise AssertionError('the cell ran')")
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_accumulate_manual_explains_noise(ip, capsys):
    ip.run_cell("%%accumulate?")
    shown = capsys.readouterr().out
    assert "--noise [NAME]" in shown
    assert "noise_tracker" in shown


# ---- one-line errors, panels closed, a stale _ refused (issue 12) ----------------------------

@pytest.mark.parametrize(("line", "expected"), [
    ("model make_batch --max-batch-size 4 --multiple-of 8",
     "--max-batch-size should be an int >= --multiple-of (8), but got --max-batch-size 4; "
     "raise it or lower --multiple-of."),
    ("model make_batch --start 3 --multiple-of 2",
     "--start should be a positive multiple of --multiple-of (2), but got --start 3."),
    ("model make_batch --budget 'unterminated", "the line should be valid shell words"),
    ("model make_batch --optimizer make_batch", "--optimizer should be a torch.optim.Optimizer"),
])
def test_argument_mistakes_caught_by_find_batch_are_one_line_usage_errors(ip, line, expected):
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("find_batch", line)
    assert str(error.value).startswith(expected)
    assert "\n" not in str(error.value)


def test_repeated_find_batch_panels_do_not_leave_widgets_open(ip):
    ipywidgets = pytest.importorskip("ipywidgets")
    from ipywidgets.widgets import widget
    ip.kernel = object()  # a front end that shows widgets
    try:
        line = ("model make_batch --optimizer opt --loss-fn loss_fn --budget 64KiB "
                "--max-batch-size 8")
        for _ in range(3):
            ip.run_line_magic("find_batch", line)
        open_after_3 = len(widget._instances)
        for _ in range(6):
            ip.run_line_magic("find_batch", line)
        assert len(widget._instances) == open_after_3  # 31 more per call before
    finally:
        del ip.kernel
        ip.run_line_magic("unload_ext", "batchwidgets")
        ip.run_line_magic("load_ext", "batchwidgets")
    assert isinstance(ipywidgets.Widget, type)


def test_accumulate_batch_size_refuses_a_report_made_for_another_model(ip, data):
    other = nn.Linear(16, 4)
    ip.push({"other": other, "other_data": make_batch})
    ip.user_ns["_"] = ip.run_line_magic("find_batch", "other other_data --loss-fn loss_fn "
                                                     "--budget 256KiB -q")
    with pytest.raises(UsageError, match="was not made by %find_batch for this cell's model"):
        ip.run_cell_magic("accumulate", "--batch-size 64", LOOP)
    ip.user_ns["_"] = ip.run_line_magic("find_batch", "model make_batch --optimizer opt "
                                                     "--loss-fn loss_fn --budget 256KiB -q")
    report = ip.run_cell_magic("accumulate", "--batch-size 64", LOOP)
    assert report is not None
    for name in ("other", "other_data"):
        ip.user_ns.pop(name)


def test_target_with_a_count_and_parallel_flags_equal_the_function(ip):
    with torch.device("meta"):
        ip.push({"meta_mlp": nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]),
                 "one_example": torch.zeros(2048)})
    by_magic = ip.run_line_magic(
        "find_batch", "meta_mlp one_example --target 4x1GiB --parallel fsdp "
                      "--max-batch-size 4096 -q")
    by_function = bw.find_batch(ip.user_ns["meta_mlp"], torch.zeros(2048), target="4x1GiB",
                                parallel="fsdp", max_batch_size=4096)
    assert (by_magic.world_size, by_magic.parallel) == (4, "fsdp")
    assert by_magic.max_batch_size == by_function.max_batch_size > 0
    assert by_magic.global_batch_size == 4 * by_magic.max_batch_size
    for flags in ("--target 4x1GiB --parallel tp", "--target 1GiB --parallel fsdp"):
        with pytest.raises(UsageError, match="--parallel") as error:
            ip.run_line_magic("find_batch", f"meta_mlp one_example {flags} -q")
        assert "\n" not in str(error.value)
