"""The global batch kept (issue 40, NOTE [ Keeping the global batch ]): ``split_batch``'s rule,
then ``fit_trainer`` on a real Hugging Face ``Trainer`` and ``BatchSizeCallback`` on a real
Lightning ``Trainer`` (a tiny GPT-2 from a config, on the CPU under a budget): per-device batch x
accumulation x world size is the global batch, the train dataloader yields the per-device
batch, training stays under the budget, and a second run in a new process gets the same numbers
from memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import _tiny_lm
import pytest
from _paths import TESTS

import batchwidgets as bw

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")


# -- split_batch ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("global_batch", "fits", "world", "expected"), [
    (64, 29, 1, (16, 4)),  # the largest divisor of 64 up to 29
    (64, 64, 1, (64, 1)),
    (64, 500, 1, (64, 1)),  # more fits than the global batch: no accumulation
    (512, 48, 4, (32, 4)),  # 128 per rank
    (96, 40, 2, (24, 2)),
    (7, 7, 1, (7, 1)),
    (1, 1, 1, (1, 1)),
])
def test_split_batch_keeps_the_global_batch_with_the_largest_divisor_that_fits(
        global_batch, fits, world, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these is below half of what fits
        per_device, steps = bw.split_batch(global_batch, fits, world_size=world)
    assert (per_device, steps) == expected
    assert per_device * steps * world == global_batch
    assert per_device <= fits
    assert all((global_batch // world) % d or d <= per_device or d > fits
               for d in range(1, fits + 1))  # no larger divisor fits


def test_split_batch_warns_once_when_few_divisors_waste_the_device():
    with pytest.warns(bw.BatchwidgetsWarning, match=r"per-device batch is 2 x 31 steps") as said:
        assert bw.split_batch(62, 29) == (2, 31)  # 62 = 2 x 31: 2 is all that divides
    assert len(said) == 1
    assert "A global batch of 87 (29 x 3 steps x 1) would use it all" in str(said[0].message)
    assert said[0].filename == __file__


@pytest.mark.parametrize(("arguments", "match"), [
    ((64, 0), "max_per_device should be a positive int"),
    ((0, 8), "global_batch_size should be a positive int"),
    ((64, 8, 3), r"global_batch_size should be a multiple of world_size \(3\).*63 or 66"),
    ((64.0, 8), "global_batch_size should be a positive int"),
])
def test_split_batch_refuses_what_cannot_be_split(arguments, match):
    with pytest.raises(ValueError, match=match):
        bw.split_batch(*arguments)


# -- Hugging Face Trainer -------------------------------------------------------------------------

def start(kind: str, out: Path, cache: Path, *extra: str, torchrun: bool = False,
          script: Path = TESTS / "_tiny_lm.py") -> list[dict]:
    """``_tiny_lm.py`` (or ``script``) in new processes (2 ranks under torchrun), sharing
    ``cache``; each process's JSON line."""
    env = {**os.environ, "BATCHWIDGETS_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}  # this checkout
    env.pop("PYTHONUNBUFFERED", None)  # fewer, larger writes; each rank's line is one write
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--standalone"] if torchrun else [sys.executable])
    done = subprocess.run([*launcher, str(script), kind, str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-6000:]}"
    return [json.loads(line.removeprefix(_tiny_lm.MARK)) for line in done.stdout.splitlines()
            if line.startswith(_tiny_lm.MARK)]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """A first run (fit_trainer, then train) and a second, each in a new process."""
    folder = tmp_path_factory.mktemp("hf")
    (first,) = start("hf", folder / "out", folder / "cache", "train")
    (second,) = start("hf", folder / "out", folder / "cache")
    return folder / "cache", first, second


def test_fit_trainer_keeps_the_global_batch_and_the_dataloader_yields_the_per_device_batch(
        hf_runs):
    _, first, _ = hf_runs
    assert first["global"] == 64  # the arguments' own: 64 per device x 1 step x 1 process
    assert first["per_device"] * first["steps"] * first["world_size"] == first["global"]
    assert first["per_device"] < 64
    assert first["steps"] > 1
    assert first["per_device"] <= first["max_per_device"] < 2 * first["per_device"]
    assert first["loader_batch"] == first["per_device"]  # not the 64 __init__ copied
    assert first["loop"] == "frees output"  # compute_loss drops the output before backward
    assert first["learning_rate"] == transformers.TrainingArguments("x").learning_rate
    assert not first["remembered"]


def test_the_trainer_trains_at_that_batch_under_the_budget(hf_runs):
    _, first, _ = hf_runs
    assert first["global_step"] == 2
    assert first["train_peak_bytes"] <= _tiny_lm.BUDGET


def test_a_second_run_in_a_new_process_gets_the_same_numbers_from_memory(hf_runs):
    _, first, second = hf_runs
    assert second["remembered"]
    assert [second[k] for k in ("per_device", "steps", "global", "max_per_device")] == [
        first[k] for k in ("per_device", "steps", "global", "max_per_device")]
    assert second["loader_batch"] == first["per_device"]


def test_a_global_batch_with_few_divisors_warns_and_the_trainer_still_gets_it(
        hf_runs, monkeypatch, tmp_path):
    cache, first, _ = hf_runs
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(cache))  # the runs' answer, remembered
    trainer = _tiny_lm.hf_trainer(str(tmp_path))
    prime = next(n for n in range(first["max_per_device"] + 1, 1000)
                 if all(n % d for d in range(2, n)))
    global_batch = 2 * prime  # the prime is above what fits: 2 is the largest divisor that does
    with pytest.warns(bw.BatchwidgetsWarning, match="under half of what the device holds") as said:
        report = bw.fit_trainer(trainer, global_batch_size=global_batch, budget=_tiny_lm.BUDGET)
    assert len(said) == 1
    assert said[0].filename == __file__  # the user's line
    assert report.remembered is not None
    assert report.max_per_device == first["max_per_device"]
    assert (trainer.args.per_device_train_batch_size,
            trainer.args.gradient_accumulation_steps) == (2, prime)
    assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape[0] == 2
    assert f"global_batch_size {global_batch}" in report.summary()
    assert "remembered" in report.summary()
    assert "accumulation_steps" in report._repr_html_()


def test_fit_trainer_says_what_it_takes(tmp_path):
    with pytest.raises(TypeError, match=r"trainer should be a transformers\.Trainer"):
        bw.fit_trainer(object())
    trainer = _tiny_lm.hf_trainer(str(tmp_path))
    with pytest.raises(TypeError, match=r"option 'budgte', but find_batch has no such option"):
        bw.fit_trainer(trainer, budgte="8MB")
    with pytest.raises(TypeError, match=r"option 'step', but the trainer decides it"):
        bw.fit_trainer(trainer, step=print)
    with pytest.raises(ValueError, match="global_batch_size should be a positive int or None"):
        bw.fit_trainer(trainer, global_batch_size=0)
    assert trainer.args.per_device_train_batch_size == 64  # nothing was set


# Every rank of a torchrun job: fit_trainer on a new trainer, then again on another, which finds
# the first call's answer in the cache folder (a new process's second run is hf_runs'); one line
# per rank, one write, as _tiny_lm.py's own
TWICE = textwrap.dedent("""
    import json, os, sys
    import _tiny_lm

    out = sys.argv[2]
    found = {"first": _tiny_lm.run_hf(out, False), "second": _tiny_lm.run_hf(out, False)}
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\\n{_tiny_lm.MARK}{json.dumps(found)}\\n".encode())
""")


@pytest.mark.slow
def test_fit_trainer_gives_every_rank_of_a_torchrun_job_one_answer(tmp_path):
    script = tmp_path / "twice.py"
    script.write_text(TWICE)
    ranks = start("hf", tmp_path / "out", tmp_path / "cache", torchrun=True, script=script)
    first, second = [r["first"] for r in ranks], [r["second"] for r in ranks]
    assert len(first) == len(second) == 2
    numbers = {(r["per_device"], r["steps"], r["world_size"], r["global"]) for r in first}
    assert len(numbers) == 1  # one answer, all ranks
    ((per_device, steps, world, global_batch),) = numbers
    assert world == 2
    assert global_batch == 128
    assert per_device * steps * world == global_batch
    assert all(r["loader_batch"] == per_device for r in first)
    assert not any(r["remembered"] for r in first)
    assert all(r["remembered"] for r in second)  # every rank remembered, the same numbers
    assert {(r["per_device"], r["steps"]) for r in second} == {(per_device, steps)}


# -- Lightning ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning")
    (first,) = start("lightning", folder / "out", folder / "cache", "train")
    (second,) = start("lightning", folder / "out", folder / "cache")
    return first, second


def test_lightning_callback_keeps_the_global_batch_and_trains_at_the_per_device_batch(
        lightning_runs):
    first, _ = lightning_runs
    assert first["per_device"] * first["steps"] * first["world_size"] == first["global"] == 64
    assert first["per_device"] < 64
    assert first["steps"] > 1
    assert first["global_step"] == 2  # two updates of `steps` micro-batches each
    assert first["seen"] == [first["per_device"]] * (2 * first["steps"])
    assert not first["remembered"]


def test_lightning_second_run_in_a_new_process_gets_the_same_numbers_from_memory(
        lightning_runs):
    first, second = lightning_runs
    assert second["remembered"]
    assert (second["per_device"], second["steps"]) == (first["per_device"], first["steps"])
    assert second["seen"] == [first["per_device"]] * first["steps"]


def test_lightning_callback_says_what_it_takes():
    from batchwidgets.integrations.lightning import BatchSizeCallback

    with pytest.raises(TypeError, match="option 'target', but the trainer decides it"):
        BatchSizeCallback(64, target="T4")
    with pytest.raises(ValueError, match="headroom should be in"):
        BatchSizeCallback(64, headroom=2)
