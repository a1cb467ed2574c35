"""``live_loader(autotune=True)`` over a whole first epoch against every fixed setting, and what
a switch costs.

The dataset's items cost real CPU (a blur by FFT of a 3x96x96 image in numpy, about 2 ms each,
measured and reported) and the training step sleeps ``--step-ms`` (a GPU step leaves the CPU
free). One round times a whole epoch (worker start-up included) of a plain DataLoader for every
fixed setting of the grid (num_workers 0..max_workers x prefetch_factor 1, 2, 4) and of
``bw.live_loader(data, num_workers=0, autotune=True)`` (exploration included), in an order
rotated between rounds. Reported, as medians over the rounds of same-round ratios:

- autotune's epoch time over the best fixed setting's. Target: at most 1.10.
- autotune's samples/s over num_workers=0's. Target: at least 1.5.
- the path autotune took (each switch, at which batch, and its cost) and where it settled.

Then each switch's cost as ``report().switches[*].cost_s`` gives it (the loop's wait for its
first batch after the switch: the old workers stopped, the new ones started, one batch loaded),
for 0 -> 1, 0 -> 2 and 2 -> 1 workers, per start method (fork, forkserver, spawn), on a light
dataset so that loading a batch adds little, median of ``--switch-rounds``.

Usage:
    python benchmarks/live_loader.py                  # -> results/live_loader.{md,json}
    python benchmarks/live_loader.py --rounds 1 --items 3200 --out /tmp
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from _machine import commit
from torch.utils.data import DataLoader, Dataset, TensorDataset

import batchwidgets as bw
from batchwidgets.engine.loader import usable_cpus

RESULTS = Path(__file__).parent / "results"
PREFETCH = (1, 2, 4)


class Blurred(Dataset):
    """A 3x96x96 image blurred three times by FFT and normalised: real CPU work per item."""

    def __init__(self, n: int, size: int = 96, reps: int = 3) -> None:
        self.n, self.size, self.reps = n, size, reps
        r = np.arange(size) - size / 2
        self.kernel = np.fft.rfft2(np.exp(-(r[:, None] ** 2 + r[None] ** 2) / 8.0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = np.random.default_rng(i).random((3, self.size, self.size), dtype=np.float32)
        for _ in range(self.reps):
            image = np.fft.irfft2(np.fft.rfft2(image) * self.kernel, s=image.shape[1:])
        image = (image - image.mean()) / (image.std() + 1e-6)
        return torch.from_numpy(image.astype(np.float32)), i % 10


def item_ms(data: Dataset, n: int = 200) -> float:
    started = time.perf_counter()
    for i in range(n):
        data[i]
    return (time.perf_counter() - started) / n * 1e3


def epoch(loader, step_s: float) -> tuple[float, int]:
    """Wall time of one whole epoch of the loop (its first batch's worker start-up included)."""
    started, samples = time.perf_counter(), 0
    for x, _ in loader:
        samples += len(x)
        time.sleep(step_s)  # the step: the CPU is free, as while a GPU computes
    return time.perf_counter() - started, samples


def grid(max_workers: int) -> list[tuple[int, int | None]]:
    return [(0, None)] + [(w, p) for w in range(1, max_workers + 1) for p in PREFETCH]


def name(workers: int, prefetch: int | None) -> str:
    return "w=0" if not workers else f"w={workers} pf={prefetch}"


def one_round(data, batch_size, step_s, settings, rotate: int) -> dict:
    runs = [*settings, "autotune"]
    runs = runs[rotate % len(runs):] + runs[:rotate % len(runs)]
    out = {}
    for run in runs:
        if run == "autotune":
            live = bw.live_loader(data, batch_size=batch_size, shuffle=True, autotune=True)
            wall, samples = epoch(live, step_s)
            report = live.report
            out["autotune"] = {
                "epoch_s": wall, "samples_per_s": samples / wall, "status": live.autotune_status,
                "settled": report.settings, "switches": [
                    {"batch": s.batch, "old": name(s.old["num_workers"], s.old["prefetch_factor"]),
                     "new": name(s.new["num_workers"], s.new["prefetch_factor"]),
                     "cost_s": s.cost_s} for s in report.switches],
                "segments": [{"setting": name(s.settings["num_workers"],
                                              s.settings["prefetch_factor"]),
                              "batches": s.n_batches, "samples_per_s": s.samples_per_s,
                              "stall": s.stall_fraction} for s in report.segments]}
            live.close()
        else:
            workers, prefetch = run
            loader = DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers,
                                prefetch_factor=prefetch)
            wall, samples = epoch(loader, step_s)
            out[name(*run)] = {"epoch_s": wall, "samples_per_s": samples / wall}
        print(f"  {name(*run) if run != 'autotune' else 'autotune'}: "
              f"{out[name(*run) if run != 'autotune' else 'autotune']['epoch_s']:.2f} s",
              flush=True)
    fixed = {k: v for k, v in out.items() if k != "autotune"}
    best = min(fixed, key=lambda k: fixed[k]["epoch_s"])
    return {"runs": out, "best_fixed": best,
            "autotune_over_best": out["autotune"]["epoch_s"] / fixed[best]["epoch_s"],
            "speedup_over_w0": out["autotune"]["samples_per_s"] / fixed["w=0"]["samples_per_s"]}


def switch_costs(method: str, rounds: int) -> dict:
    """cost_s of 0 -> 1, 0 -> 2, 2 -> 1 workers on a light dataset, median over ``rounds``."""
    pairs = {"0->1": (0, 1), "0->2": (0, 2), "2->1": (2, 1)}
    costs: dict[str, list[float]] = {k: [] for k in pairs}
    shutdowns: dict[str, list[float]] = {k: [] for k in pairs}
    data = TensorDataset(torch.randn(256, 16))
    for _ in range(rounds):
        for label, (old, new) in pairs.items():
            live = bw.live_loader(data, batch_size=8, num_workers=old,
                                  multiprocessing_context=method)
            for i, _ in enumerate(live):
                if i == 4:
                    live.set(num_workers=new)
                if i == 8:
                    break
            live.close()
            switch = next(s for s in live.report.switches if s.new["num_workers"] == new)
            costs[label].append(switch.cost_s)
            shutdowns[label].append(switch.shutdown_s)
    return {label: {"cost_s": statistics.median(costs[label]),
                    "shutdown_s": statistics.median(shutdowns[label]),
                    "max_cost_s": max(costs[label])} for label in pairs}


def medians(rounds) -> dict:
    """Each run's median epoch time over the rounds; the best fixed setting by those medians,
    and autotune's ratios to it and to num_workers=0 (less biased than same-round ratios: the
    fastest of 7 noisy settings in a round is lucky more often than not)."""
    epoch_s = {k: statistics.median(r["runs"][k]["epoch_s"] for r in rounds)
               for k in rounds[0]["runs"]}
    fixed = {k: v for k, v in epoch_s.items() if k != "autotune"}
    best = min(fixed, key=fixed.get)
    return {"epoch_s": epoch_s, "best_fixed": best,
            "autotune_over_best": epoch_s["autotune"] / fixed[best],
            "speedup_over_w0": fixed["w=0"] / epoch_s["autotune"]}


def write(args, machine, rounds, costs) -> str:
    last = rounds[-1]
    fixed = sorted(k for k in last["runs"] if k != "autotune")  # w=0, w=1 pf=1, ...
    over_best = statistics.median(r["autotune_over_best"] for r in rounds)
    speedup = statistics.median(r["speedup_over_w0"] for r in rounds)
    med = medians(rounds)
    lines = [
        "# live_loader(autotune=True): a whole first epoch against every fixed setting", "",
        f"{datetime.date.today()}, commit {machine['commit']}, {machine['cpu']}, torch "
        f"{torch.__version__}, start method {machine['start_method']}, "
        f"{args.threads} torch thread(s) in the main process. Dataset: "
        f"{args.items} items of {machine['item_ms']:.2f} ms of CPU each (numpy FFT blur of a "
        f"3x96x96 image), batch size {args.batch_size}, shuffled; the step sleeps "
        f"{args.step_ms:g} ms. {len(rounds)} round(s), the order of the runs rotated; load "
        f"average {machine['load_before']} before, {machine['load_after']} after.", "",
        f"**autotune epoch / best fixed epoch: {med['autotune_over_best']:.3f}** (target <= "
        f"1.10; the best fixed setting by its median epoch, {med['best_fixed']}); **autotune "
        f"samples/s / num_workers=0's: {med['speedup_over_w0']:.2f}x** (target >= 1.5); "
        f"ratios of the runs' median epoch times over the rounds. Medians of same-round ratios "
        f"(against the fastest fixed setting of each round): {over_best:.3f} and "
        f"{speedup:.2f}x.", "",
        "| round | " + " | ".join(fixed) + " | autotune | best fixed | autotune / best | "
        "autotune / w=0 samples/s |",
        "|---" * (len(fixed) + 6) + "|"]
    for i, r in enumerate(rounds):
        cells = [f"{r['runs'][k]['epoch_s']:.2f} s" for k in fixed]
        lines.append(f"| {i + 1} | " + " | ".join(cells) +
                     f" | {r['runs']['autotune']['epoch_s']:.2f} s | {r['best_fixed']} | "
                     f"{r['autotune_over_best']:.3f} | {r['speedup_over_w0']:.2f}x |")
    cells = [f"{med['epoch_s'][k]:.2f} s" for k in fixed]
    lines.append("| median | " + " | ".join(cells) + f" | {med['epoch_s']['autotune']:.2f} s | "
                 f"{med['best_fixed']} | {med['autotune_over_best']:.3f} | "
                 f"{med['speedup_over_w0']:.2f}x |")
    lines += ["", "Autotune's path in each round (switch at batch: old -> new, the loop's wait "
              "for the next batch):", ""]
    for i, r in enumerate(rounds):
        run = r["runs"]["autotune"]
        path = "; ".join(f"{s['batch']}: {s['old']} -> {s['new']} ({s['cost_s'] * 1e3:.0f} ms)"
                         for s in run["switches"])
        lines.append(f"- round {i + 1}: {path or 'no switch'}. {run['status']}.")
    lines += ["", "## What a switch costs", "",
              "`report().switches[*].cost_s`: the loop's wait for its first batch after the "
              "switch (the old workers stopped, the new ones started, one batch of a light "
              f"dataset loaded), median of {args.switch_rounds}, max in brackets:", "",
              "| start method | 0 -> 1 | 0 -> 2 | 2 -> 1 (of which stopping the 2) |",
              "|---|---|---|---|"]
    for method, c in costs.items():
        cell = [f"{c[k]['cost_s'] * 1e3:.0f} ms ({c[k]['max_cost_s'] * 1e3:.0f})"
                for k in ("0->1", "0->2", "2->1")]
        cell[2] += f" ({c['2->1']['shutdown_s'] * 1e3:.0f} ms)"
        lines.append(f"| {method} | " + " | ".join(cell) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=9600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--switch-rounds", type=int, default=5)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, main process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a line added to the results (the machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", bw.BatchwidgetsWarning)
    max_workers = args.max_workers or usable_cpus()
    data = Blurred(args.items)
    machine = {"commit": commit(), "cpu": f"{usable_cpus()}-core CPU", "item_ms": item_ms(data),
               "start_method": multiprocessing.get_start_method(),
               "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        rounds.append(one_round(data, args.batch_size, args.step_ms / 1e3, grid(max_workers),
                                rotate=r * 3))
    costs = {method: switch_costs(method, args.switch_rounds)
             for method in ("fork", "forkserver", "spawn")
             if method in multiprocessing.get_all_start_methods()}
    machine["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = write(args, machine, rounds, costs)
    if args.note:
        text += f"\n{args.note}\n"
    print(text)
    args.out.mkdir(exist_ok=True, parents=True)
    (args.out / "live_loader.md").write_text(text)
    (args.out / "live_loader.json").write_text(json.dumps(
        {"machine": machine, "torch": torch.__version__, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "rounds": rounds, "medians": medians(rounds), "switch_costs": costs}, indent=2)
        + "\n")


if __name__ == "__main__":
    main()
