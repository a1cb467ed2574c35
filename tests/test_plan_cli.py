"""``python -m batchwidgets plan``: a model from a Hugging Face config or a factory, planned for
a GPU that is not here, with the same answers as ``find_batch(target=...)`` (the engine is the
oracle: the CLI only builds what find_batch is handed); bad flags are one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _paths import TESTS

import batchwidgets as bw
from batchwidgets import _plan_cli

transformers = pytest.importorskip("transformers")

LLAMA = ["LlamaConfig", "vocab_size=1000", "hidden_size=64", "num_hidden_layers=2",
         "num_attention_heads=4", "num_key_value_heads=2", "intermediate_size=128"]
BERT = ["BertConfig", "vocab_size=1000", "hidden_size=64", "num_hidden_layers=2",
        "num_attention_heads=4", "intermediate_size=128"]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = _plan_cli.main([*argv, "--no-cache"])
    out, err = capsys.readouterr()
    return code, out, err


def planned(capsys, *argv: str) -> dict:
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def meta(build):
    with torch.device("meta"):
        return build().train()


def token_batches(vocab: int):
    def make_batch(batch_size: int, seq_len: int):
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": ids, "labels": ids}
    return make_batch


def test_a_llama_config_plans_as_find_batch_does_at_each_length(capsys):
    data = planned(capsys, "--config", *LLAMA, "--gpu", "T4@256MiB", "--seq-len", "64", "128")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128)
    model = meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
    report = bw.find_batch(model, token_batches(1000), target="T4@256MiB", seq_len=[64, 128],
                           optimizer=torch.optim.AdamW(model.parameters()), cache=False)
    assert data["max_batch_size"] == report.max_batch_size > 0
    assert {int(k): v for k, v in data["frontier"].items()} == report.frontier
    assert data["target"] == "T4@256MiB"
    assert data["trace"] == "fake"


def test_a_bert_config_at_three_lengths_plans_as_find_batch_does(capsys, tmp_path):
    config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128)
    config.save_pretrained(tmp_path)  # a config.json, as a user downloads it
    data = planned(capsys, "--config", str(tmp_path / "config.json"), "--gpu", "T4@256MiB",
                   "--seq-len", "32", "64", "128", "--optimizer", "sgd")
    model = meta(lambda: transformers.AutoModelForMaskedLM.from_config(config))
    report = bw.find_batch(model, token_batches(1000), target="T4@256MiB",
                           seq_len=[32, 64, 128], cache=False,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    assert {int(k): v for k, v in data["frontier"].items()} == report.frontier
    assert len(report.frontier) == 3
    assert data["max_batch_size"] == report.max_batch_size


def test_a_factory_built_cnn_plans_as_find_batch_does(capsys):
    code, out, err = cli(capsys, "--factory", f"{TESTS / '_plan_factories.py'}:small_cnn",
                         "--input-shape", "3,32,32", "--num-classes", "10",
                         "--gpu", "T4@64MiB")
    assert code == 0, err
    from batchwidgets.engine._batches import SyntheticBatches
    from tests._plan_factories import small_cnn
    model = meta(small_cnn)
    report = bw.find_batch(model, SyntheticBatches((3, 32, 32), 10), target="T4@64MiB",
                           loss_fn=torch.nn.functional.cross_entropy, cache=False,
                           optimizer=torch.optim.AdamW(model.parameters()))
    first = out.splitlines()[0]
    assert first == report.summary()  # the answer first, in the report's own words
    assert "memory at the peak" in out
    assert "one step larger" in out
    assert "built Sequential" in err
    assert "traced batch size" in err  # progress: stderr


def test_a_parallel_plan_compares_every_strategy_as_find_batch_does(capsys):
    data = planned(capsys, "--factory", f"{TESTS / '_plan_factories.py'}:cnn_with_batches",
                   "--gpu", "2xT4@64MiB", "--parallel", "compare", "--global-batch", "4096")
    from tests._plan_factories import cnn_with_batches
    with torch.device("meta"):
        model, make_batch, loss_fn = cnn_with_batches()
    report = bw.find_batch(model, make_batch, loss_fn=loss_fn, target="2xT4@64MiB",
                           parallel="compare", cache=False,
                           optimizer=torch.optim.AdamW(model.parameters()))
    assert [(p["parallel"], p["max_batch_size"]) for p in data["parallel_plans"]] == [
        (p.parallel, p.max_batch_size) for p in report.parallel_plans]
    assert {p["parallel"] for p in data["parallel_plans"]} == {
        "ddp", "zero1", "zero2", "zero3", "fsdp"}
    assert data["max_batch_size"] == report.max_batch_size
    assert data["world_size"] == 2
    per_device, steps = bw.split_batch(4096, report.recommended_batch_size, 2)
    assert data["global_batch"] == {"global_batch_size": 4096, "per_device": per_device,
                                    "accumulation_steps": steps}


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    return subprocess.run([sys.executable, "-m", "batchwidgets", "plan", *argv],
                          capture_output=True, text=True, timeout=600, env=env)


def test_from_a_shell_the_answer_goes_to_stdout_and_a_snapshot_to_its_file(tmp_path):
    snapshot = tmp_path / "step.pickle"
    result = run_cli("--config", *LLAMA, "--gpu", "T4@256MiB", "--seq-len", "64",
                     "--frozen-base", "--snapshot", str(snapshot), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("max_batch_size=")
    assert "snapshot written to" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot.read_bytes()[:1] == b"\x80"  # a pickle


@pytest.mark.parametrize(("argv", "says"), [
    (["--gpu", "T4@256MiB"], "give --config"),
    (["--config", "LlamaConfg", "--gpu", "T4"], "did you mean LlamaConfig"),
    (["--config", "LlamaConfig", "hiden_size=64", "--gpu", "T4"], "did you mean hidden_size"),
    (["--config", "LlamaConfig"], "--gpu should name the GPU"),
    (["--config", "LlamaConfig", "--gpu", "T5"], "--gpu"),
    (["--config", "LlamaConfig", "--gpu", "T4", "--lora", "8"], "--lora 8 needs peft"),
    (["--factory", "nowhere:model", "--gpu", "T4"], "--factory nowhere:model"),
    (["--config", "LlamaConfig", "--gpu", "T4", "--optimiser", "sgd"], "did you mean --optimizer"),
    (["--config", "LlamaConfig", "--gpu", "T4", "--dtype", "fp8"], "--dtype"),
    (["--config", "LlamaConfig", "num_hidden_layers=abc", "--gpu", "T4"],
     "--config LlamaConfig refuses its values"),
    (["--config", "GPT2Config", "n_embd=64", "n_head=3", "--gpu", "T4"],
     "cannot be built from these values"),
    (["--config", "LlamaConfig", "--gpu", "T4", "--seq-len", "128,256"],
     "give several separated by spaces: 128 256"),
    (["--factory", f"{TESTS / '_plan_factories.py'}:needs_weights", "--gpu", "T4"],
     "needs_weights raised RuntimeError: Tensor.item() cannot be called on meta"),
])
def test_a_bad_flag_is_one_line_naming_it_with_exit_code_2(argv, says, capsys):
    if "--lora" in argv and _has_peft():
        pytest.skip("peft is installed here")
    try:
        code = _plan_cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert says in err, err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "names"), [
    # BERT's position ids stop at 8: the model the flags built cannot take 16 tokens
    (["--config", *BERT, "max_position_embeddings=8", "--gpu", "T4", "--seq-len", "16"],
     ("--config BertConfig", "--seq-len", "must match")),
    # the CNN's first convolution takes 3 channels; --input-shape gives it 5
    (["--factory", f"{TESTS / '_plan_factories.py'}:small_cnn", "--input-shape", "5,32,32",
      "--num-classes", "10", "--gpu", "T4"],
     ("--factory", "--input-shape", "small_cnn")),
])
def test_a_model_that_raises_in_its_step_is_one_line_naming_its_flags(argv, names, capsys):
    code = _plan_cli.main([*argv, "--no-cache"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("batchwidgets plan: the model from ")
    for name in names:
        assert name in err[-1], err[-1]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_global_batch_the_gpus_cannot_share_is_one_line_in_every_form(as_json, capsys):
    code = _plan_cli.main(["--factory", f"{TESTS / '_plan_factories.py'}:cnn_with_batches",
                           "--gpu", "4xT4@64MiB", "--parallel", "zero2", "--global-batch", "6",
                           "--no-cache", *(["--json"] if as_json else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == ("batchwidgets plan: --global-batch 6 should be a multiple of the 4 GPUs "
                       "of --gpu, so every rank takes the same share; e.g. --global-batch 4 "
                       "or 8.")


@pytest.mark.parametrize("config", [["GPT2Config", "n_embd=64", "n_layer=2", "n_head=2",
                                     "vocab_size=500"],
                                    [*LLAMA, "tie_word_embeddings=true"]])
def test_a_frozen_base_trains_a_head_tied_to_the_embedding(config, capsys):
    from batchwidgets._plan_model import build
    built = build(config=config, frozen_base=True)
    head = built.model.get_output_embeddings().weight
    assert head is built.model.get_input_embeddings().weight  # tied
    trains = [p for p in built.model.parameters() if p.requires_grad]
    assert len(trains) == 1  # the head alone, as --help says
    assert trains[0] is head
    data = planned(capsys, "--config", *config, "--gpu", "T4@256MiB", "--seq-len", "32",
                   "--frozen-base")
    assert data["max_batch_size"] > 0


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_shell_gets_exit_code_2_and_one_line_for_an_unknown_flag():
    result = run_cli("--config", "LlamaConfig", "--gpu", "T4", "--seqlen", "64")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "--seq-len" in result.stderr


def test_the_flags_that_are_find_batch_options_take_its_defaults_and_help():
    from batchwidgets.engine.probe import OPTIONS

    passed = [flag for flag in _plan_cli.flags() if flag.keyword in vars(OPTIONS)]
    assert {flag.keyword for flag in passed} >= {"target", "amp", "parallel", "seq_len",
                                                  "max_batch_size", "multiple_of", "headroom",
                                                  "keep_output", "cache"}
    for flag in passed:
        if not flag.switch:
            assert flag.default == getattr(OPTIONS, flag.keyword), flag
    names = [flag.flag for flag in _plan_cli.flags()]
    assert len(names) == len(set(names))
