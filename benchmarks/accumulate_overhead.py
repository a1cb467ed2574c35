"""Overhead of ``bw.accumulate`` against hand-written gradient accumulation on the same loop.

Both loops run the same micro-batches through the same model; they alternate in rounds so
drift of the machine hits both alike, and the ratio of their median round times is reported.

Usage:
    python benchmarks/accumulate_overhead.py   # writes results/accumulate_overhead_<device>.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import batchwidgets as bw
from batchwidgets.demo import small_cnn

RESULTS = Path(__file__).parent / "results"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 10))


def batches(n: int, micro: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(micro, 3, 32, 32, generator=g).to(device),
             torch.randint(0, 10, (micro,), generator=g).to(device)) for _ in range(n)]


def by_hand(model, optimizer, data, steps):
    for j, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y) / steps
        loss.backward()
        if (j + 1) % steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def with_batchwidgets(model, optimizer, data, steps):
    with bw.accumulate(optimizer, steps=steps, model=model):
        for x, y in data:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def timed(fn, *args, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(name, make_model, device, micro, steps, n_micro, rounds):
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(n_micro, micro, device)
    times = {"by hand": [], "batchwidgets": []}
    by_hand(model, optimizer, data, steps)  # warm-up both paths
    with_batchwidgets(model, optimizer, data, steps)
    for r in range(rounds):
        order = [("by hand", by_hand), ("batchwidgets", with_batchwidgets)]
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            times[label].append(timed(fn, model, optimizer, data, steps, device=device))
    hand, ours = statistics.median(times["by hand"]), statistics.median(times["batchwidgets"])
    return {"model": name, "micro_batch": micro, "steps": steps, "micro_steps": n_micro,
            "rounds": rounds, "by_hand_s": hand, "batchwidgets_s": ours,
            "per_micro_step_ms_by_hand": 1e3 * hand / n_micro,
            "overhead": ours / hand - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    rows = [measure("demo CNN", small_cnn, device, 32, 4, 16, args.rounds),
            measure("MLP 3072-512-10", mlp, device, 64, 4, 32, args.rounds)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    lines = [
        "# accumulate overhead vs hand-written accumulation",
        "",
        f"{datetime.date.today()}, device: {name}, torch {torch.__version__}, AdamW, "
        f"median of {args.rounds} alternating rounds. Target: at most 1% overhead.",
        "",
        "| model | micro-batch | steps | ms per micro-step (by hand) | overhead |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['model']} | {r['micro_batch']} | {r['steps']} | "
              f"{r['per_micro_step_ms_by_hand']:.2f} | {r['overhead']:+.2%} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"accumulate_overhead_{device.type}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
