"""Remembered answers (issue 40, NOTE [ Remembered answers ] in engine/probe/_remember.py): an
identical find_batch gives back the first one's report at once, from a fresh process too;
whatever decides memory measures again; a broken or foreign file is ignored with one warning;
concurrent writers never leave a broken file; the magic and the panel follow."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
import warnings

import _cache_writer
import pytest
import torch
from _paths import ROOT
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine import options_of
from batchwidgets.engine.probe import FindBatchRequest, _cache, _remember
from batchwidgets.engine.probe._resolve import resolve

MIB = 2**20
BUDGET = 2 * MIB
FORWARDS: list[int] = []  # the batch sizes Counted's forward ran at (fake ones too)


class Counted(nn.Module):
    """An MLP that notes each forward in FORWARDS (outside itself: its settings are in the key)."""

    def __init__(self, width: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(16), nn.Flatten(),
                                  nn.Linear(3 * 16 * 16, width, dtype=dtype), nn.ReLU(),
                                  nn.Linear(width, 10, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS.append(x.shape[0])
        return self.body(x.to(self.body[2].weight.dtype))


def images(batch_size: int, side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, side, side), torch.randint(0, 10, (batch_size,))


def probe(model: nn.Module, **options) -> bw.BatchSizeReport:
    options = {"loss_fn": F.cross_entropy, "budget": BUDGET, **options}
    return bw.find_batch(model, options.pop("make_batch", images), **options)


def entry_files(folder) -> list:
    return sorted((folder / "find_batch").glob("*.json"))


# -- a repeat: at once, the same report, marked ---------------------------------------------------

def test_a_repeat_gives_back_the_same_report_at_once_without_a_step(fresh_cache):
    model = Counted()
    first = probe(model)
    assert first.remembered is None
    assert len(entry_files(fresh_cache)) == 1
    FORWARDS.clear()
    started = time.perf_counter()
    again = probe(model)
    elapsed = time.perf_counter() - started
    assert FORWARDS == []  # nothing ran, not even on fake tensors
    assert elapsed < 1.0
    assert again == first  # every field: attempts, memory model, split, timeline
    assert again.attempts == first.attempts
    assert again.memory_split == first.memory_split
    assert again.remembered is not None
    assert again.remembered.path == str(entry_files(fresh_cache)[0])
    assert again.remembered.host
    assert again.remembered.measured_at[:2] == "20"
    assert "remembered, measured" in again.summary()
    assert any(label == "remembered" for label, _ in again.rows())
    assert "remembered" in again._repr_html_()


def test_refresh_measures_again_and_cache_false_neither_reads_nor_writes(fresh_cache):
    model = Counted()
    probe(model)
    FORWARDS.clear()
    refreshed = probe(model, refresh=True)
    assert refreshed.remembered is None
    assert FORWARDS
    assert probe(model).remembered is not None  # and kept
    bw.forget()
    assert entry_files(fresh_cache) == []
    assert probe(model, cache=False).remembered is None
    assert entry_files(fresh_cache) == []  # not written
    probe(model)
    FORWARDS.clear()
    assert probe(model, cache=False).remembered is None
    assert FORWARDS
    assert bw.forget() == 1


def test_an_answer_that_is_not_kept(fresh_cache):
    """A stopped probe is not an answer: nothing is kept."""
    report = probe(Counted(), should_stop=lambda: True)
    assert report.stop_reason == "stopped"
    assert entry_files(fresh_cache) == []


SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, time
    import torch
    from torch import nn
    import batchwidgets as bw

    def images(batch_size):
        return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    # as a training script does; the first optimizer of a process costs torch a second or two
    # (it imports torch._dynamo), whoever makes it
    optimizer = torch.optim.AdamW(model.parameters())
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(len(args[0])))
    started = time.perf_counter()
    report = bw.find_batch(model, images, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget=2 * 2**20)
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed_s": elapsed, "forwards": len(forwards),
                      "max_batch_size": report.max_batch_size,
                      "attempts": [a.batch_size for a in report.attempts],
                      "remembered": None if report.remembered is None else str(report.remembered),
                      "repr": repr(dataclasses.replace(report, remembered=None))}))
""")


def test_a_fresh_process_gets_the_answer_without_probing_again(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "BATCHWIDGETS_CACHE_DIR": str(tmp_path / "cache"),  # this checkout:
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def run() -> dict:
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["remembered"] is None
    assert second["remembered"] is not None
    assert second["remembered"].startswith("measured ")
    # no step ran, whatever the clock says (a loaded 2-core machine took 1.02 s, the first
    # process's probe 2.2 s)
    assert first["forwards"] > 0
    assert second["forwards"] == 0, second
    assert (second["max_batch_size"], second["attempts"]) == (first["max_batch_size"],
                                                               first["attempts"])
    assert second["repr"] == first["repr"]  # the whole report, but where it was remembered


# -- what decides memory is in the key ------------------------------------------------------------

def longer(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return images(batch_size, side=20)


CHANGES = {
    # what the user changes -> the probe's arguments after the change
    "the optimizer": lambda model: {"optimizer": torch.optim.SGD(model.parameters())},
    "a layer's width": lambda model: {"model": Counted(width=80)},
    "the dtype": lambda model: {"model": Counted(dtype=torch.bfloat16)},
    "the input's length": lambda model: {"make_batch": longer},
    "the budget": lambda model: {"budget": 3 * MIB},
    "requires_grad": lambda model: {"model": _frozen_first(Counted())},
    "amp": lambda model: {"amp": "bf16"},
}


def _frozen_first(model: Counted) -> Counted:
    model.body[2].requires_grad_(False)
    return model


def test_what_decides_memory_measures_again(fresh_cache):
    model = Counted()
    base = probe(model)
    assert probe(model).remembered is not None  # the base is remembered
    for change, arguments in CHANGES.items():
        options = arguments(model)
        changed = probe(options.pop("model", model), **options)
        assert changed.remembered is None, f"changing {change} gave a remembered answer"
        options = arguments(model)  # the changed call again (a new model built alike)
        assert probe(options.pop("model", model), **options).remembered is not None, change
    assert probe(model) == base
    assert probe(model).remembered is not None


CHECKPOINT = False  # a script's flag, read by the model's forward


class FlagReading(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 32),
                                        torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                        torch.nn.Tanh(), torch.nn.Linear(32, 10))

    def forward(self, x):
        if CHECKPOINT:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


def test_a_plain_global_the_models_forward_reads_is_in_the_key(fresh_cache, monkeypatch):
    # a torchrun script set the flag from its arguments: the second run, checkpointing, got the
    # first run's answer (473 where it fits 1,692)
    plain = probe(FlagReading())
    assert probe(FlagReading()).remembered is not None
    monkeypatch.setattr(sys.modules[__name__], "CHECKPOINT", True)
    assert probe(FlagReading()).remembered is None  # measured, not the flag-off answer
    assert probe(FlagReading()).remembered is not None
    monkeypatch.setattr(sys.modules[__name__], "CHECKPOINT", False)
    again = probe(FlagReading())
    assert again.remembered is not None
    assert again.max_batch_size == plain.max_batch_size


def test_a_function_the_model_keeps_is_in_the_key(fresh_cache):
    """A module may keep what it calls as a plain attribute (``self.act = F.gelu``, a dropout
    given as a function): two models alike but for it are two answers."""
    def keeping(function) -> Counted:
        model = Counted()
        model.body[3].act = function  # the ReLU's slot: what a block would call
        return model

    kinds = [torch.tanh, torch.sigmoid, lambda x: x * 2, lambda x: x * x]
    for kind in kinds:
        assert probe(keeping(kind)).remembered is None, kind
    assert all(probe(keeping(kind)).remembered is not None for kind in kinds)


def test_an_edited_step_or_a_global_it_reads_measures_again(fresh_cache):
    """The loop modelled is its code: a step= (or a %%find_batch cell) edited, or a value it
    reads from the notebook changed, is another key."""
    model = Counted()
    optimizer = torch.optim.AdamW(model.parameters())
    namespace = {"model": model, "optimizer": optimizer, "images": images, "F": F, "PASSES": 1}
    source = textwrap.dedent("""
        def step(batch_size):
            x, y = images(batch_size)
            loss = sum(F.cross_entropy(model(x), y) for _ in range(PASSES))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """)
    exec(source, namespace)  # a notebook cell
    first = bw.find_batch(model, step=namespace["step"], optimizer=optimizer, budget=BUDGET)
    assert first.remembered is None
    exec(source, namespace)  # the same cell run again: a new function, the same code
    assert bw.find_batch(model, step=namespace["step"], optimizer=optimizer,
                         budget=BUDGET).remembered is not None
    namespace["PASSES"] = 2  # two forwards' activations held
    twice = bw.find_batch(model, step=namespace["step"], optimizer=optimizer, budget=BUDGET)
    assert twice.remembered is None
    exec(source.replace("zero_grad()", "zero_grad(set_to_none=False)"), namespace)
    assert bw.find_batch(model, step=namespace["step"], optimizer=optimizer,
                         budget=BUDGET).remembered is None


def make_by_length(batch_size: int, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return images(batch_size, length)


def other_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target) * 2


def user_step(batch_size: int) -> None:
    pass


# Each keyed option of find_batch, changed: a new option must be added here, and so be thought
# about (in the key by default: NOTE [ Remembered answers ]).
CHANGED_OPTION = {
    "loss_fn": {"loss_fn": other_loss},
    "optimizer": {"optimizer": "SGD"},
    "device": {"device": "cpu"},
    "budget": {"budget": 3 * MIB},
    "amp": {"amp": "bf16"},
    "max_batch_size": {"max_batch_size": 64},
    "multiple_of": {"multiple_of": 2},
    "headroom": {"headroom": 0.8},
    "scaler": {"scaler": "GradScaler"},
    "scheduler": {"scheduler": "StepLR"},
    "steps_per_trial": {"steps_per_trial": 3},
    "start": {"start": 4},
    "seq_len": {"seq_len": [16, 20]},
    "what_if": {"what_if": True},
    "target": {"target": "T4"},
    "trace": {"trace": "real"},
    "step": {"step": user_step},
    "parallel": {"target": "2xT4", "parallel": "zero1"},
    "keep_output": {"keep_output": False},
}


def _key(model: nn.Module, **given) -> str:
    optimizer = torch.optim.AdamW(model.parameters())
    if given.get("optimizer") == "SGD":
        given["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    if given.get("scaler") == "GradScaler":
        given["scaler"] = torch.amp.GradScaler("cpu")
    if given.get("scheduler") == "StepLR":
        given["optimizer"] = optimizer
        given["scheduler"] = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    make_batch = None if "step" in given else make_by_length
    request = FindBatchRequest(**{"loss_fn": F.cross_entropy, "budget": BUDGET, **given})
    key, _limit = _remember._key(resolve(model, make_batch, request))
    return key


def test_every_option_that_decides_the_answer_is_in_the_key():
    keyed = [o.name for o in options_of(FindBatchRequest) if o.keyed]
    assert sorted(CHANGED_OPTION) == sorted(keyed)  # a new option: add it above
    model = Counted()
    base = _key(model)
    assert _key(model) == base  # the same call, the same key
    parallel_base = _key(model, target="2xT4")
    for name, change in CHANGED_OPTION.items():
        against = parallel_base if name == "parallel" else base
        assert _key(model, **change) != against, f"{name} is not in the key"


# -- files that cannot be used; writers at once ---------------------------------------------------

BROKEN = {
    "garbage": lambda text: "\x00\xff not json",
    "truncated": lambda text: text[: len(text) // 2],
    "a foreign format": lambda text: json.dumps({**json.loads(text), "format": 99}),
    "a report of another version": lambda text: json.dumps(
        {**json.loads(text), "report": {**json.loads(text)["report"], "new_field": 1}}),
    "empty": lambda text: "",
}


@pytest.mark.parametrize("damage", list(BROKEN), ids=list(BROKEN))
def test_a_broken_file_is_ignored_with_one_warning_and_measured_again(fresh_cache, damage):
    model = Counted()
    first = probe(model)
    (path,) = entry_files(fresh_cache)
    path.write_bytes(BROKEN[damage](path.read_text()).encode("utf-8", "surrogateescape"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = probe(model)
    said = [w for w in caught if issubclass(w.category, bw.BatchwidgetsWarning)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "ignored a remembered answer" in str(said[0].message)
    assert str(path) in str(said[0].message)
    assert said[0].filename == __file__  # it points at the user's line
    assert again.remembered is None
    assert again.max_batch_size == first.max_batch_size
    assert probe(model).remembered is not None  # the new answer replaced the file


def test_an_unwritable_cache_warns_once_and_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(blocker / "cache"))  # under a file
    with pytest.warns(bw.BatchwidgetsWarning, match="could not remember") as caught:
        report = probe(Counted())
    assert len(caught) == 1
    assert report.max_batch_size > 0


class Unreadable:
    """A loss whose settings cannot be read: a key that cannot be taken."""

    @property
    def __dict__(self):
        raise RuntimeError("no settings here")

    def __call__(self, output, target):
        return F.cross_entropy(output, target)


def test_a_key_that_cannot_be_taken_warns_and_measures_without_remembering(fresh_cache):
    with pytest.warns(bw.BatchwidgetsWarning, match="could not take the key") as said:
        report = probe(Counted(), loss_fn=Unreadable())
    assert said[0].filename == __file__
    assert report.max_batch_size > 0
    assert report.remembered is None
    assert entry_files(fresh_cache) == []


def test_concurrent_writers_never_leave_a_broken_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(tmp_path))
    key = "0" * 64
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_cache_writer.write_many,
                               args=(str(tmp_path), key, writer, 40)) for writer in range(3)]
    for writer in writers:
        writer.start()
    seen = set()
    while any(writer.is_alive() for writer in writers):
        entry = _cache.read("find_batch", key)  # Unreadable would fail the test
        if entry is not None:
            assert len(entry["padding"]) == (entry["writer"] + 1) * 200_000
            seen.add(entry["writer"])
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    entry = _cache.read("find_batch", key)
    assert entry is not None
    assert entry["i"] == 39
    assert list(tmp_path.glob("find_batch/.*.tmp")) == []  # no half-written file left
    assert len(seen) >= 2  # the reads met several writers' files


def test_the_cache_folder_follows_the_platform(monkeypatch, tmp_path):
    monkeypatch.delenv("BATCHWIDGETS_CACHE_DIR")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache.cache_dir() == tmp_path / "xdg" / "batchwidgets"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _cache.cache_dir() == _cache.Path.home() / ".cache" / "batchwidgets"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _cache.cache_dir() == _cache.Path.home() / "Library" / "Caches" / "batchwidgets"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert _cache.cache_dir() == tmp_path / "local" / "batchwidgets" / "Cache"
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(tmp_path / "mine"))
    assert _cache.cache_dir() == tmp_path / "mine"


def test_the_tests_never_read_the_users_cache(fresh_cache, session_cache):
    assert os.environ["BATCHWIDGETS_CACHE_DIR"] == str(fresh_cache)
    assert _cache.cache_dir() == fresh_cache
    assert fresh_cache != session_cache
    # what a server started for the session remembered, for the next test to find (it doesn't)
    (session_cache / "find_batch").mkdir(exist_ok=True)
    (session_cache / "find_batch" / f"{'0' * 64}.json").write_text("{}")


def test_a_server_started_for_the_session_finds_nothing_remembered(session_cache):
    """Jupyter servers and kernels started by session- or module-scoped fixtures keep the
    session's folder: every test empties it (the test above left an entry there)."""
    assert session_cache.is_dir()
    assert list(session_cache.iterdir()) == []


# -- the magic and the panel ----------------------------------------------------------------------

@pytest.fixture
def shell():
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "batchwidgets")
    yield ip
    ip.run_line_magic("unload_ext", "batchwidgets")


def test_the_magic_remembers_and_refresh_measures_again(shell):
    model = Counted()
    shell.push({"model": model, "images": images, "F": F})
    line = f"model images --loss-fn F.cross_entropy --budget {BUDGET} -q"
    first = shell.run_line_magic("find_batch", line)
    again = shell.run_line_magic("find_batch", line)
    assert first.remembered is None
    assert again.remembered is not None
    assert again == first
    refreshed = shell.run_line_magic("find_batch", line + " --refresh")
    assert refreshed.remembered is None
    assert shell.run_line_magic("find_batch", line + " --no-cache").remembered is None
    function = probe(model, budget=str(BUDGET))  # find_batch called as the line calls it
    assert function.remembered is not None
    assert function == refreshed  # the answer --refresh kept


def test_the_panels_probe_button_measures_again():
    import functools

    model = Counted()
    panel = bw.ProbePanel(probe=functools.partial(bw.find_batch, model, images,
                                                  loss_fn=F.cross_entropy, budget=BUDGET))
    first = panel.run()
    assert panel.run().remembered is not None  # the same call from code: remembered
    panel.probe_button.click()  # the user asks again: measured
    again = panel.wait(timeout=300)
    assert again.remembered is None
    assert again.max_batch_size == first.max_batch_size
    panel.close()


# -- inside a job: every rank the same remembered answer, or none ---------------------------------

JOB = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    import batchwidgets as bw

    rank, init_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                         world_size=2)

    def probe():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        make_batch = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))
        return bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                             budget=(192 if rank == 0 else 96) * 2**10, trace="real")

    try:
        first, second = probe(), probe()
        torch.distributed.barrier()
        if rank == 1:  # this rank's answer is gone: rank 0 alone remembers
            os.remove(second.remembered.path)
        torch.distributed.barrier()
        third = probe()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump([[r.max_batch_size, r.remembered is not None] for r in (first, second, third)],
                  f)
""")


@pytest.mark.slow
def test_every_rank_of_a_job_gets_the_same_remembered_answer_or_none(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(JOB)
    outputs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BATCHWIDGETS_CACHE_DIR": str(tmp_path / "c"),
           "PYTHONPATH": str(ROOT)}  # processes started import this checkout
    workers = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "init"),
                                 str(outputs[rank])], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], logs
    (first0, second0, third0), (first1, second1, third1) = (
        json.loads(path.read_text()) for path in outputs)
    assert first0 == first1 == [first0[0], False]  # measured, one answer
    assert second0 == second1 == [first0[0], True]  # both remembered it
    assert third0 == third1 == [first0[0], False]  # rank 1 had none: both measured
