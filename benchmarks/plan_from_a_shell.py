"""Planning from a shell: ``python -m batchwidgets plan`` on a Llama-3-8B config (bf16, 2048
tokens) for 8xA100-80GB under each strategy, timed from the shell (the whole process: Python,
torch and transformers imported, the model built on the meta device, traced, replayed), with
the process's own CPU time beside the wall time (the machine may be shared).

    python benchmarks/plan_from_a_shell.py          # -> results/plan_from_a_shell_cpu.*
    python benchmarks/plan_from_a_shell.py --quick  # ddp only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _machine
import torch

LLAMA_8B = ["LlamaConfig", "vocab_size=128256", "hidden_size=4096", "num_hidden_layers=32",
            "num_attention_heads=32", "num_key_value_heads=8", "intermediate_size=14336",
            "max_position_embeddings=8192"]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "compare"]


def run(parallel: str, gpu: str) -> dict:
    argv = [sys.executable, "-m", "batchwidgets", "plan", "--config", *LLAMA_8B, "--gpu", gpu,
            "--seq-len", "2048", "--dtype", "bfloat16", "--parallel", parallel, "--json",
            "--no-cache"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent)
    if result.returncode not in (0, 1):  # 1: no batch size fits, the plan still printed
        raise RuntimeError(result.stderr[-2000:])
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    data = json.loads(result.stdout)
    return {"parallel": parallel, "gpu": gpu, "max_batch_size": data["max_batch_size"],
            "plans": {p["parallel"]: p["max_batch_size"] for p in data["parallel_plans"]},
            "wall_s": seconds, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ddp only")
    parser.add_argument("--gpu", default="8xA100-80GB")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results, loads = [], [os.getloadavg()[0]]
    for parallel in ["ddp"] if args.quick else STRATEGIES:
        results.append(run(parallel, args.gpu))
        loads.append(os.getloadavg()[0])
        print(results[-1], flush=True)
    lines = [
        "# Planning from a shell: `python -m batchwidgets plan` on a Llama-3-8B config", "",
        f"- date: {time.strftime('%Y-%m-%d')}",
        f"- machine: {_machine.device_name(torch.device('cpu'))}",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"batchwidgets commit {_machine.commit()}",
        f"- command: `python -m batchwidgets plan --config {' '.join(LLAMA_8B)} --gpu "
        f"{args.gpu} --seq-len 2048 --dtype bfloat16 --parallel P --json --no-cache`",
        f"- time: wall time of the whole process, and its CPU time (user + system); the "
        f"machine is shared (1-minute load average {min(loads):.1f}-{max(loads):.1f} on its "
        f"{os.cpu_count()} cores during the rows), so wall time includes waiting for a core",
        "- regenerate: `python benchmarks/plan_from_a_shell.py`", "",
        "| --parallel | max batch per rank | each strategy | wall (s) | CPU (s) |",
        "|---|--:|---|--:|--:|",
        *(f"| {r['parallel']} | {r['max_batch_size']} | "
          f"{', '.join(f'{k} {v}' for k, v in r['plans'].items())} | {r['wall_s']:.1f} | "
          f"{r['cpu_s']:.1f} |" for r in results), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_from_a_shell_cpu.md").write_text("\n".join(lines))
    (args.out / "plan_from_a_shell_cpu.json").write_text(json.dumps(
        {"results": results, "load_average": loads}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
