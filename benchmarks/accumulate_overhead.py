"""Overhead of ``bw.accumulate`` against hand-written gradient accumulation on the same loop.

Both loops run the same micro-batches through the same model, in paired rounds that alternate
which goes first, so drift of the machine hits both alike; the overhead is the median of the
per-round ratios, with its quartiles (the spread is the measurement's own noise).

Usage:
    python benchmarks/accumulate_overhead.py   # writes results/accumulate_overhead_<device>.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from _machine import device_name
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
    """CPU time of the process (less disturbed by other load than wall time) on the CPU; wall
    time with synchronisation on a GPU."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = clock()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - started


def measure(name, make_model, device, micro, steps, n_micro, rounds):
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(n_micro, micro, device)
    by_hand(model, optimizer, data, steps)  # warm-up both paths
    with_batchwidgets(model, optimizer, data, steps)
    hand, ours, ratios = [], [], []
    for r in range(rounds):  # paired rounds, alternating which goes first
        pair = {}
        order = [("hand", by_hand), ("ours", with_batchwidgets)]
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            pair[label] = timed(fn, model, optimizer, data, steps, device=device)
        hand.append(pair["hand"])
        ours.append(pair["ours"])
        ratios.append(pair["ours"] / pair["hand"])
    quartiles = statistics.quantiles(ratios, n=4)
    return {"model": name, "micro_batch": micro, "steps": steps, "micro_steps": n_micro,
            "rounds": rounds, "by_hand_s": statistics.median(hand),
            "batchwidgets_s": statistics.median(ours),
            "per_micro_step_ms_by_hand": 1e3 * statistics.median(hand) / n_micro,
            "overhead": statistics.median(ratios) - 1,
            "overhead_q1": quartiles[0] - 1, "overhead_q3": quartiles[2] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    rows = [measure("demo CNN", small_cnn, device, 32, 4, 16, args.rounds),
            measure("MLP 3072-512-10", mlp, device, 64, 4, 32, args.rounds)]
    name = device_name(device)
    lines = [
        "# accumulate overhead vs hand-written accumulation",
        "",
        f"{datetime.date.today()}, device: {name}, torch {torch.__version__}, AdamW, "
        f"{'wall' if device.type == 'cuda' else 'process CPU'} time, median of {args.rounds} "
        f"paired rounds. Target: at most 1% overhead.",
        "",
        "| model | micro-batch | steps | ms per micro-step (by hand) | overhead (median) "
        "| quartiles |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['model']} | {r['micro_batch']} | {r['steps']} | "
              f"{r['per_micro_step_ms_by_hand']:.2f} | {r['overhead']:+.2%} | "
              f"{r['overhead_q1']:+.2%} .. {r['overhead_q3']:+.2%} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"accumulate_overhead_{device.type}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
