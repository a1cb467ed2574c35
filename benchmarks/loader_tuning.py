"""``tune_loader``'s search against measuring the whole grid of DataLoader settings.

For each synthetic dataset (CPU-heavy samples, light samples, large tensors) one round measures
every setting of the full grid with ``measure_loader`` and runs ``tune_loader`` on the same data,
the order alternating between rounds. Reported per dataset, as medians over the rounds:

- time ratio: wall time of the search / wall time of the full grid (warm-ups and worker
  shutdowns included in both). Target: at most 40%.
- quality: samples/s of the setting the search picked, as the grid measured it in the same
  round, over the grid's best (1.0 when it picked the grid's best). Target: at least 95%.
- paired: the two settings re-measured back to back, alternating, when they differ (the
  grid's best can win by timing noise alone), median of 5 pairs.
- noise: how much one setting's samples/s moves between rounds (median over the grid's
  settings of max/min - 1): differences smaller than this are not resolved on that machine.

On a GPU (``--device cuda``) batches are copied to the device, the grid doubles with
pin_memory, and the host-to-device bandwidth of pinned vs pageable memory is measured too.

Usage:
    python benchmarks/loader_tuning.py --threads 1        # -> results/loader_tuning_cpu.{md,json}
    python benchmarks/loader_tuning.py --device cuda --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset

import batchwidgets as bw
from batchwidgets.engine.loader import _search as _loader_search
from batchwidgets.engine.loader import usable_cpus

RESULTS = Path(__file__).parent / "results"
SETTINGS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


class CpuHeavy(Dataset):
    """About 1 ms of pure-Python work per 3x32x32 sample (decoding, augmenting)."""

    def __init__(self, n: int = 4096, work: int = 20000) -> None:
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        acc = 0
        for k in range(self.work):
            acc += (k * i) % 7
        return torch.full((3, 32, 32), float(acc % 255)), i % 10


class Light(Dataset):
    """Indexing a tensor already in memory: microseconds per sample."""

    def __init__(self, n: int = 65536) -> None:
        self.x = torch.randn(n, 64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i % 10


class LargeTensors(Dataset):
    """3x224x224 float32 samples (588 KiB each), a fresh tensor per sample."""

    def __init__(self, n: int = 2048) -> None:
        self.n = n
        self.base = torch.randn(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.base * (1 + i % 3), i % 10


DATASETS = {"cpu-heavy (1 ms/sample)": (CpuHeavy, 32), "light (in-memory tensor)": (Light, 256),
            "large tensors (588 KiB/sample)": (LargeTensors, 32)}


def key(trial_or_settings) -> tuple:
    settings = trial_or_settings if isinstance(trial_or_settings, dict) \
        else trial_or_settings.settings
    return tuple(settings[name] for name in SETTINGS)


def full_grid(data, batch_size, device, max_workers, duration_s) -> tuple[dict, float]:
    accelerator = device.type == "cuda"
    started = time.perf_counter()
    speeds = {}
    for settings in _loader_search.full_grid(max_workers, accelerator):
        trial = bw.measure_loader(data, **settings, batch_size=batch_size, device=device,
                                  duration_s=duration_s)
        speeds[key(settings)] = trial.samples_per_s
    return speeds, time.perf_counter() - started


def search(data, batch_size, device, max_workers, duration_s):
    started = time.perf_counter()
    report = bw.tune_loader(data, device, batch_size=batch_size, max_workers=max_workers,
                            duration_s=duration_s)
    return report, time.perf_counter() - started


def paired(data, batch_size, device, a: tuple, b: tuple, duration_s, rounds=5) -> float:
    """Median over back-to-back pairs of samples/s(a) / samples/s(b)."""
    ratios = []
    for r in range(rounds):
        speed = {}
        for which in ((a, b) if r % 2 == 0 else (b, a)):
            speed[which] = bw.measure_loader(data, **dict(zip(SETTINGS, which)),
                                             batch_size=batch_size, device=device,
                                             duration_s=duration_s).samples_per_s
        ratios.append(speed[a] / speed[b])
    return statistics.median(ratios)


def measure(name, device, max_workers, duration_s, rounds) -> dict:
    make, batch_size = DATASETS[name]
    data = make()
    # one untimed pass first: a fresh process's first large allocations and thread-pool start
    # would otherwise land on whichever setting is measured first
    bw.measure_loader(data, batch_size=batch_size, device=device, duration_s=duration_s)
    rows, grids = [], []
    for r in range(rounds):
        if r % 2 == 0:
            grid, grid_s = full_grid(data, batch_size, device, max_workers, duration_s)
            report, search_s = search(data, batch_size, device, max_workers, duration_s)
        else:
            report, search_s = search(data, batch_size, device, max_workers, duration_s)
            grid, grid_s = full_grid(data, batch_size, device, max_workers, duration_s)
        grid_best = max(grid, key=grid.get)
        pick = key(report.best)
        grids.append(grid)
        rows.append({"grid_s": grid_s, "search_s": search_s, "time_ratio": search_s / grid_s,
                     "quality": grid[pick] / grid[grid_best],
                     "search_measured_vs_grid_best": report.best.samples_per_s / grid[grid_best],
                     "trials": len(report.trials), "grid_size": len(grid),
                     "grid_best": dict(zip(SETTINGS, grid_best)), "grid_best_samples_per_s":
                     grid[grid_best], "pick": dict(zip(SETTINGS, pick)),
                     "pick_samples_per_s_in_grid": grid[pick],
                     "no_workers_samples_per_s": grid[key(_loader_search.setting(0, False))],
                     "search_order": [t.label for t in report.trials]})
    last = rows[-1]
    same = key(last["pick"]) == key(last["grid_best"])
    return {"dataset": name, "batch_size": batch_size, "rounds": rows,
            "time_ratio": statistics.median(r["time_ratio"] for r in rows),
            "quality": statistics.median(r["quality"] for r in rows),
            "noise": statistics.median(max(g[k] for g in grids) / min(g[k] for g in grids) - 1
                                       for k in grids[0]) if rounds > 1 else None,
            "paired_pick_over_grid_best": 1.0 if same else paired(
                data, batch_size, device, key(last["pick"]), key(last["grid_best"]), duration_s)}


def copy_bandwidth(device: torch.device, n_bytes: int = 256 * 2**20, reps: int = 10) -> dict:
    """Host-to-device GB/s from pageable and from pinned memory (CUDA events, median)."""
    results = {}
    for pinned in (False, True):
        host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pinned)
        target = torch.empty(n_bytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=pinned)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        results["pinned" if pinned else "pageable"] = n_bytes / statistics.median(times[1:]) / 1e9
    return results


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {usable_cpus()} CPUs"
    return f"{platform.processor() or platform.machine()} CPU, {usable_cpus()} usable cores"


def write(rows, bandwidth, device, args, max_workers) -> str:
    lines = [
        "# tune_loader search vs the full grid of DataLoader settings", "",
        f"{datetime.date.today()}, device: {describe(device)}, torch {torch.__version__}, "
        f"max_workers={max_workers}, {torch.get_num_threads()} torch thread(s) in the main "
        f"process, {args.duration} s of timing per setting, median of "
        f"{args.rounds} rounds (grid and search alternating which goes first). Targets: best "
        f"within 5% of the grid's best, in at most 40% of the grid's time.", "",
        "| dataset | grid settings | search tried | time ratio | quality (pick / grid best, "
        "same round) | paired re-measure | noise between rounds | search picked | grid best |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        last = r["rounds"][-1]
        lines.append(
            f"| {r['dataset']} | {last['grid_size']} | {last['trials']} | {r['time_ratio']:.0%} "
            f"| {r['quality']:.1%} | {r['paired_pick_over_grid_best']:.1%} | "
            f"{'-' if r['noise'] is None else format(r['noise'], '.0%')} | "
            f"{_short(last['pick'])} | {_short(last['grid_best'])} |")
    if bandwidth:
        lines += ["", f"Host-to-device copy of 256 MiB: pageable {bandwidth['pageable']:.1f} GB/s, "
                      f"pinned {bandwidth['pinned']:.1f} GB/s (CUDA events, median of 10)."]
    return "\n".join(lines) + "\n"


def _short(settings: dict) -> str:
    parts = [f"w={settings['num_workers']}"]
    if settings["pin_memory"]:
        parts.append("pin")
    if settings["num_workers"]:
        parts.append(f"pf={settings['prefetch_factor']}")
        if settings["persistent_workers"]:
            parts.append("persistent")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per setting")
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a line added to the results (the machine)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the main process (workers use 1 each); 1 keeps "
                             "times steady when other jobs share the cores")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    max_workers = args.max_workers or usable_cpus()
    warnings.simplefilter("ignore", bw.BatchwidgetsWarning)
    rows = [measure(name, device, max_workers, args.duration, args.rounds) for name in DATASETS]
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    text = write(rows, bandwidth, device, args, max_workers)
    if args.note:
        text += f"\n{args.note}\n"
    print(text)
    args.out.mkdir(exist_ok=True, parents=True)
    stem = args.out / f"loader_tuning_{device.type}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": describe(device), "torch": torch.__version__, "max_workers": max_workers,
         "torch_threads": torch.get_num_threads(),
         "duration_s": args.duration, "rounds": args.rounds, "datasets": rows,
         "copy_bandwidth_gb_per_s": bandwidth}, indent=2) + "\n")


if __name__ == "__main__":
    main()
