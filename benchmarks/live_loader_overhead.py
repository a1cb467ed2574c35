"""What a live loader adds to each batch of a training loop, against the plain DataLoader it wraps.

Both loaders yield the same batches from an in-memory dataset with no workers (the case where a
per-batch cost shows most): rounds alternate which goes first, and the overhead per batch is the
median over rounds of (live - plain) seconds per batch, also as a share of a 10 ms step. The live
loader's per-batch work: two clock reads, the bookkeeping of the index batch, the segment's
counters under a lock, and the widget poll (nothing outside a kernel).

Usage:
    python benchmarks/live_loader_overhead.py   # writes results/live_loader_overhead_cpu.md
"""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import torch
from _machine import commit, device_name
from torch.utils.data import DataLoader, TensorDataset

import batchwidgets as bw

RESULTS = Path(__file__).parent / "results"
STEP_S = 0.010


def per_batch(loader: DataLoader) -> float:
    started, n = time.perf_counter(), 0
    for _ in loader:
        n += 1
    return (time.perf_counter() - started) / n


def main(rounds: int = 7) -> None:
    data = TensorDataset(torch.randn(20_000, 8))
    plain, live = DataLoader(data, batch_size=4), bw.live_loader(data, batch_size=4)
    diffs, plains = [], []
    for i in range(rounds):
        pair = [(plain, "plain"), (live, "live")]
        times = {name: per_batch(loader) for loader, name in (pair if i % 2 else pair[::-1])}
        diffs.append(times["live"] - times["plain"])
        plains.append(times["plain"])
    overhead = statistics.median(diffs)
    quartiles = statistics.quantiles(diffs, n=4)
    lines = [
        "# A live loader's overhead per batch",
        "",
        f"{datetime.date.today()}, commit {commit()}, {device_name(torch.device('cpu'))}, "
        f"torch {torch.__version__}, outside a kernel (the widget poll does nothing).",
        "",
        "| loader | seconds per batch (median) |",
        "|---|--:|",
        f"| plain DataLoader, no workers | {statistics.median(plains) * 1e6:.1f} µs |",
        f"| live_loader over it | {(statistics.median(plains) + overhead) * 1e6:.1f} µs |",
        "",
        f"Overhead: {overhead * 1e6:.1f} µs per batch (quartiles {quartiles[0] * 1e6:.1f} to "
        f"{quartiles[2] * 1e6:.1f} µs over {rounds} rounds of {len(plain)} batches), "
        f"{overhead / STEP_S:.2%} of a {STEP_S * 1e3:.0f} ms step.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "live_loader_overhead_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
