"""Planning without running: ``find_batch(model, make_batch, target=...)`` on Llama-shaped models
built on the meta device (125M, 1B and 8B shapes, bf16, 2048 tokens) traced on fake tensors,
with the time and the peak memory of each plan; and, where a real trace can run on this machine
(small shapes, short sequences), the same plan traced by real steps beside it: both must agree.

Each plan runs in a fresh process, so its peak RSS is its own.

    python benchmarks/plan_without_running.py          # -> results/plan_without_running_cpu.*
    python benchmarks/plan_without_running.py --quick  # the small rows only
    python benchmarks/plan_without_running.py --parallel  # the 8B plans for N GPUs, per strategy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _machine
import torch

# name: (hidden, layers, heads, kv heads, intermediate, vocabulary)
SHAPES = {
    "Llama 20M": (256, 4, 4, 2, 704, 32_000),
    "Llama 125M": (768, 12, 12, 4, 2048, 32_000),
    "Llama-3.2-1B shape": (2048, 16, 32, 8, 8192, 128_256),
    "Llama-3-8B shape": (4096, 32, 32, 8, 14_336, 128_256),
}
# (shape, tokens, target, trace, frozen base, dtype); the real rows are what runs here: a real
# trace of the 1B shape fits this machine's RAM with its base frozen, in bf16, at 256 tokens
ROWS = [
    ("Llama 20M", 256, "T4", "real", False, "float32"),
    ("Llama 20M", 256, "T4", "fake", False, "float32"),
    ("Llama 125M", 256, "T4", "real", False, "float32"),
    ("Llama 125M", 256, "T4", "fake", False, "float32"),
    ("Llama-3.2-1B shape", 256, "T4", "real", True, "bfloat16"),
    ("Llama-3.2-1B shape", 256, "T4", "fake", True, "bfloat16"),
    ("Llama 125M", 2048, "A100-80GB", "fake", True, "bfloat16"),
    ("Llama 125M", 2048, "A100-80GB", "fake", False, "bfloat16"),
    ("Llama-3.2-1B shape", 2048, "A100-80GB", "fake", True, "bfloat16"),
    ("Llama-3.2-1B shape", 2048, "A100-80GB", "fake", False, "bfloat16"),
    ("Llama-3-8B shape", 2048, "A100-80GB", "fake", True, "bfloat16"),
    ("Llama-3-8B shape", 2048, "A100-80GB", "fake", False, "bfloat16"),
]
QUICK = ROWS[:4]
# plans for N GPUs: (shape, tokens, target, dtype), every strategy planned ("compare"), full
# fine-tuning with AdamW; the per-rank order ddp <= zero1 <= zero2 <= zero3, zero2 <= fsdp
PARALLEL_ROWS = [("Llama-3-8B shape", 2048, "8xA100-80GB", "float32"),
                 ("Llama-3-8B shape", 2048, "2xA100-80GB", "float32")]
ORDER = (("ddp", "zero1"), ("zero1", "zero2"), ("zero2", "zero3"), ("zero2", "fsdp"))

CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, transformers
import batchwidgets as bw
shape, tokens, target, trace, frozen, dtype = json.loads(sys.argv[1])
hidden, layers, heads, kv, inter, vocab = json.loads(sys.argv[2])
config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv,
                                  intermediate_size=inter, max_position_embeddings=max(tokens, 256))
torch.manual_seed(0)
device = "meta" if trace == "fake" else "cpu"
with torch.device(device):
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
if frozen:
    for name, param in model.named_parameters():
        param.requires_grad_("lm_head" in name or f"layers.{layers - 1}." in name)

def make_batch(batch_size):
    ids = torch.randint(0, vocab, (batch_size, tokens))
    return {"input_ids": ids, "labels": ids}

started, cpu_started = time.perf_counter(), time.process_time()
try:
    report = bw.find_batch(model, make_batch, target=target, trace=trace, cache=False)
    answer, band, error = report.max_batch_size, list(report.target_band), ""
    states = report.memory_split
    states = (states.parameters_bytes, states.gradients_bytes, states.optimizer_bytes)
except bw.NoBatchSizeFits as caught:
    answer, band, error, states = 0, [0, 0], str(caught), None
seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
print(json.dumps({"max_batch_size": answer, "band": band, "plan_s": seconds,
                  "plan_cpu_s": cpu_seconds, "error": error,
                  "states_bytes": states,
                  "params": sum(p.numel() for p in model.parameters()),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


PARALLEL_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, transformers
import batchwidgets as bw
shape, tokens, target, dtype = json.loads(sys.argv[1])
hidden, layers, heads, kv, inter, vocab = json.loads(sys.argv[2])
config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv,
                                  intermediate_size=inter, max_position_embeddings=max(tokens, 256))
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))

def make_batch(batch_size):
    ids = torch.randint(0, vocab, (batch_size, tokens))
    return {"input_ids": ids, "labels": ids}

started, cpu_started = time.perf_counter(), time.process_time()
try:
    report = bw.find_batch(model, make_batch, target=target, parallel="compare", cache=False)
    per_rank = {row.parallel: row.max_batch_size for row in report.parallel_plans}
    order, wrapping = report.parallel_order, report.wrapping
except bw.NoBatchSizeFits as caught:
    per_rank = {row.parallel: row.max_batch_size for row in caught.report.parallel_plans}
    order, wrapping = caught.report.parallel_order, caught.report.wrapping
print(json.dumps({"per_rank": per_rank, "parallel_order": order, "wrapping": wrapping,
                  "plan_s": time.perf_counter() - started,
                  "plan_cpu_s": time.process_time() - cpu_started,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_parallel(row: tuple) -> dict:
    shape, tokens, target, dtype = row
    result = subprocess.run(
        [sys.executable, "-c", PARALLEL_CHILD, json.dumps(row), json.dumps(SHAPES[shape])],
        capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return {"shape": shape, "tokens": tokens, "target": target, "dtype": dtype, **measured}


def parallel_table(results: list[dict]) -> list[str]:
    lines = ["| model | tokens | dtype | target | ddp | zero1 | zero2 | zero3 | fsdp | order "
             "holds | plan (s) | CPU (s) | peak RSS |",
             "|---|--:|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in results:
        found = r["per_rank"]
        holds = all(found[low] <= found[high] for low, high in ORDER)
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['dtype']} | {r['target']} | "
                     + " | ".join(str(found[name]) for name in
                                  ("ddp", "zero1", "zero2", "zero3", "fsdp"))
                     + f" | {'yes' if holds else 'no: ' + r['parallel_order']} | "
                     f"{r['plan_s']:.1f} | {r['plan_cpu_s']:.1f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB |")
    return lines


def main_parallel(out: Path) -> None:
    results, loads = [], [os.getloadavg()[0]]
    for row in PARALLEL_ROWS:  # written after each row: the 8B rows take minutes under load
        results.append(run_parallel(row))
        loads.append(os.getloadavg()[0])
        print(parallel_table(results)[-1], flush=True)
        _write_parallel(out, results, loads)


def _write_parallel(out: Path, results: list[dict], loads: list[float]) -> None:
    lines = [
        "# Plans for N GPUs on fake tensors: every strategy's per-rank batch", "",
        f"- date: {time.strftime('%Y-%m-%d')}",
        f"- machine: {_machine.device_name(torch.device('cpu'))}",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"batchwidgets commit {_machine.commit()}",
        "- step: full fine-tuning in fp32 with AdamW (find_batch's default), the model's own "
        "loss on labels = input_ids; the model built on the meta device; "
        "find_batch(model, make_batch, target=..., parallel='compare'), one fresh process each",
        f"- wrapping assumed: {results[0]['wrapping']}",
        "- order: per rank ddp <= zero1 <= zero2 <= zero3 and zero2 <= fsdp",
        f"- time: wall and the process's CPU time; the machine is shared (1-minute load "
        f"average {min(loads):.1f}-{max(loads):.1f} on its {os.cpu_count()} cores), so wall "
        f"time includes waiting for a core",
        "- regenerate: `python benchmarks/plan_without_running.py --parallel`", "",
        *parallel_table(results), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_without_running_parallel_cpu.md").write_text("\n".join(lines))
    (out / "plan_without_running_parallel_cpu.json").write_text(
        json.dumps({"header": lines[:10], "results": results}, indent=1))


def run(row: tuple) -> dict:
    shape, tokens, target, trace, frozen, dtype = row
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(row), json.dumps(SHAPES[shape])],
        capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return {"shape": shape, "tokens": tokens, "target": target, "trace": trace,
            "frozen_base": frozen, "dtype": dtype, **measured}


def table(results: list[dict]) -> list[str]:
    lines = ["| model | params | tokens | dtype | base | target | trace | max batch | plan (s) "
             "| CPU (s) | peak RSS |", "|---|--:|--:|---|---|---|---|--:|--:|--:|--:|"]
    for r in results:
        lines.append(f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['tokens']} | {r['dtype']} | "
                     f"{'frozen' if r['frozen_base'] else 'trained'} | {r['target']} | "
                     f"{r['trace']} | {r['max_batch_size']} | {r['plan_s']:.1f} | "
                     f"{r['plan_cpu_s']:.1f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB |")
    return lines


def agreement(results: list[dict]) -> list[str]:
    pairs = {}
    for r in results:
        key = (r["shape"], r["tokens"], r["target"], r["dtype"], r["frozen_base"])
        pairs.setdefault(key, {})[r["trace"]] = r
    lines = []
    for (shape, tokens, target, dtype, frozen), both in pairs.items():
        if {"real", "fake"} <= set(both):
            real, fake = both["real"], both["fake"]
            ratio = fake["max_batch_size"] / real["max_batch_size"]
            base = "frozen base" if frozen else "trained"
            lines.append(f"- {shape}, {tokens} tokens, {dtype}, {base}, {target}: fake "
                         f"{fake['max_batch_size']} vs real {real['max_batch_size']} "
                         f"({ratio:.3f}x, "
                         f"{'within' if abs(ratio - 1) <= 0.01 else 'NOT within'} 1%); plan "
                         f"{fake['plan_s']:.1f} s vs {real['plan_s']:.1f} s (fake "
                         f"{real['plan_s'] / fake['plan_s']:.1f}x faster), peak RSS "
                         f"{fake['peak_rss_bytes'] / 2**30:.2f} vs "
                         f"{real['peak_rss_bytes'] / 2**30:.2f} GiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small rows only")
    parser.add_argument("--parallel", action="store_true",
                        help="the plans for N GPUs only (every strategy's per-rank batch)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.parallel:
        main_parallel(args.out)
        return
    results, loads = [], [os.getloadavg()[0]]
    for row in QUICK if args.quick else ROWS:
        results.append(run(row))
        loads.append(os.getloadavg()[0])
        print(table(results)[-1], flush=True)
    header = [
        "# Planning without running: fake-tensor traces of Llama shapes on this CPU", "",
        f"- date: {time.strftime('%Y-%m-%d')}",
        f"- machine: {_machine.device_name(torch.device('cpu'))}",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"batchwidgets commit {_machine.commit()}",
        "- step: forward, the model's own loss on labels = input_ids, backward, AdamW (default "
        "for find_batch), zero_grad; a fake plan's model is built on the meta device, a real "
        "plan's on the CPU; each plan in a fresh process (peak RSS is its own)",
        "- frozen base: every weight but the last layer and lm_head has requires_grad=False",
        f"- time: plan (s) is wall time, CPU (s) the plan process's own user + system time; the "
        f"machine is shared (1-minute load average {min(loads):.1f}-{max(loads):.1f} on its "
        f"{os.cpu_count()} cores during the rows), so wall time includes waiting for a core",
        "- regenerate: `python benchmarks/plan_without_running.py`", "",
    ]
    lines = [*header, *table(results), "", "Fake against real traces (same target):", "",
             *agreement(results), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_without_running_cpu.md").write_text("\n".join(lines))
    (args.out / "plan_without_running_cpu.json").write_text(
        json.dumps({"header": header, "results": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
