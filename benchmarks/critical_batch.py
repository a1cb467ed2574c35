"""The noise scale against a direct measurement of the critical batch size (issue 16).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11): training to a
given loss at batch size B takes S = S_min (1 + B_noise / B) steps, with B_noise the critical
batch size, which B_simple = tr(Sigma) / |G|^2 estimates. Here B_noise is measured directly:
small MLPs are trained with SGD to a target training loss at batch sizes 8 .. 1024, the learning
rate tuned per batch size on a grid (the model assumes the best learning rate at each B), over
several seeds, and S = S_min (1 + B_noise / B) is fitted to the steps (least squares in log S,
one fit per seed: the error bar is the spread of the seeds' fits). Beside it:
  * the tracker's B_simple: ``accumulate(steps=4, noise=NoiseTracker())`` on micro-batches of 8
    along a run at B = 32, read when that run reaches the target loss;
  * measure_noise's B_simple: exact per-example gradients over the whole training set, at the
    weights of that same run when it reaches the target.
Neither estimator is tuned to this benchmark: the tracker runs with its defaults (but
overhead_target=None: every update measured, as the run is short), measure_noise with its own.

Two tasks, both on the CPU in a few minutes with one thread: scikit-learn's digits (bundled, 1797
8x8 images, 10 classes) and a synthetic 4-class problem from ``make_classification`` with 10%
flipped labels (more gradient noise).

Usage:
    python benchmarks/critical_batch.py           # -> results/critical_batch_cpu.{md,json,png}
    python benchmarks/critical_batch.py --quick   # fewer seeds and sizes, to try it out
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _machine import commit, device_name

import batchwidgets as bw

RESULTS = Path(__file__).parent / "results"
BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
LEARNING_RATES = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # SGD, tuned per batch size on this grid
MICRO, STEPS = 8, 4  # the tracker's run: B = 32


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(y)


def noisy_classes() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=4000, n_features=20, n_informative=10, n_classes=4,
                               flip_y=0.1, class_sep=1.0, random_state=0)
    x = torch.tensor(x, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(y)


# name: (data, hidden units, target training loss)
TASKS = {"digits": (digits, 64, 0.10), "noisy 4-class": (noisy_classes, 64, 0.75)}


def make_model(inputs: int, hidden: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def eval_every(step: int) -> int:
    return 1 if step < 64 else max(1, step // 64)  # about 1.5% resolution on the step count


def train(task: str, batch_size: int, lr: float, seed: int, max_steps: int,
          tracker: bw.NoiseTracker | None = None) -> tuple[int | None, nn.Module]:
    """Steps to reach the task's target training loss (None: not within max_steps), and the
    model there; with ``tracker``, B = MICRO x STEPS through accumulate(noise=tracker)."""
    _, hidden, target = TASKS[task]
    x, y = DATA[task]
    model = make_model(x.shape[1], hidden, int(y.max()) + 1, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1000 + seed)
    n = len(x)
    micro = batch_size if tracker is None else MICRO
    accumulation = (bw.accumulate(optimizer, steps=STEPS, model=model, noise=tracker)
                    if tracker is not None else None)
    if accumulation is not None:
        accumulation.__enter__()
    try:
        step, next_eval = 0, 1
        while step < max_steps:
            micro_batches = 1 if tracker is None else STEPS
            batch = torch.randperm(n, generator=generator)[:micro * micro_batches]
            for j in range(micro_batches):
                part = batch[j * micro:(j + 1) * micro]
                nn.functional.cross_entropy(model(x[part]), y[part]).backward()
                optimizer.step()
                optimizer.zero_grad()
            step += 1
            if step >= next_eval:
                loss = full_loss(model, x, y)
                if loss <= target:
                    return step, model
                if not loss < 10:  # diverged (or nan): this learning rate is too large
                    return None, model
                next_eval = step + eval_every(step)
        return None, model
    finally:
        if accumulation is not None:
            accumulation.__exit__(None, None, None)


def fit_b_noise(sizes: list[int], steps: list[float]) -> tuple[float, float]:
    """(B_noise, S_min) of S = S_min (1 + B_noise / B), least squares in log S: for each B_noise
    on a fine log grid, log S_min is the mean residual; the best B_noise wins."""
    best = (math.inf, 0.0, 0.0)
    for i in range(-200, 801):
        b_noise = 10 ** (i / 200)  # 0.1 .. 10^4
        logs = [math.log(s) - math.log(1 + b_noise / b) for b, s in zip(sizes, steps)]
        log_min = sum(logs) / len(logs)
        error = sum((v - log_min) ** 2 for v in logs)
        if error < best[0]:
            best = (error, b_noise, math.exp(log_min))
    return best[1], best[2]


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error over the seeds."""
    if len(values) < 2:
        return values[0], math.nan
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def run_task(task: str, sizes: tuple[int, ...], seeds: int, max_steps: int) -> dict:
    started = time.perf_counter()
    best_lr: dict[int, float] = {}
    steps: dict[int, list[float]] = {}
    start = 0
    for b in sizes:  # the learning rate: the fewest steps on seed 0, searched upwards from
        reached: dict[float, int] = {}  # one below the last size's best (it grows with B)
        for lr in LEARNING_RATES[start:]:
            found = train(task, b, lr, 0, max_steps)[0]
            if found is None or (reached and found >= min(reached.values())):
                if reached:
                    break
                continue
            reached[lr] = found
        if not reached:
            continue
        best_lr[b] = min(reached, key=reached.get)
        start = max(LEARNING_RATES.index(best_lr[b]) - 1, 0)
        steps[b] = [reached[best_lr[b]]] + [
            s for seed in range(1, seeds)
            if (s := train(task, b, best_lr[b], seed, max_steps)[0]) is not None]
    fitted_sizes = [b for b in sizes if b in steps and len(steps[b]) == seeds]
    fits = [fit_b_noise(fitted_sizes, [steps[b][seed] for b in fitted_sizes])
            for seed in range(seeds)]
    pooled = fit_b_noise(fitted_sizes, [statistics.fmean(steps[b]) for b in fitted_sizes])
    tracker_b, tracker_err, exact_b = [], [], []
    tracker_measurable: list[bool] = []
    lr = best_lr.get(MICRO * STEPS, LEARNING_RATES[2])
    x, y = DATA[task]
    for seed in range(seeds):
        tracker = bw.NoiseTracker(overhead_target=None)
        reached, model = train(task, MICRO * STEPS, lr, seed, max_steps, tracker=tracker)
        report = tracker.report
        if reached is None or report.trace_cov is None:
            continue
        # B_simple, also where the tracker does not call it measurable yet (|G|^2 within two
        # standard errors of 0): the ratio of its moving averages, with the delta method's error
        ratio = report.trace_cov / report.grad_norm_sq
        tracker_b.append(ratio)
        tracker_err.append(report.b_simple_error if report.measurable else abs(ratio) * math.sqrt(
            (report.trace_cov_error / report.trace_cov) ** 2
            + (report.grad_norm_sq_error / report.grad_norm_sq) ** 2))
        tracker_measurable.append(report.measurable)
        noise = bw.measure_noise(model, torch.utils.data.TensorDataset(x, y),
                                 nn.functional.cross_entropy, max_examples=len(x))
        exact_b.append(noise.b_simple)
    return {
        "task": task, "n_examples": len(x), "target_loss": TASKS[task][2],
        "batch_sizes": fitted_sizes, "learning_rate": {b: best_lr[b] for b in fitted_sizes},
        "steps": {b: steps[b] for b in fitted_sizes},
        "b_noise_per_seed": [f[0] for f in fits], "s_min_per_seed": [f[1] for f in fits],
        "b_noise": mean_and_error([f[0] for f in fits]), "b_noise_pooled": pooled[0],
        "s_min_pooled": pooled[1],
        "tracker_b_simple_per_seed": tracker_b, "tracker_error_per_seed": tracker_err,
        "tracker_measurable_per_seed": tracker_measurable,
        "tracker_b_simple": mean_and_error(tracker_b) if tracker_b else None,
        "measure_noise_b_simple_per_seed": exact_b,
        "measure_noise_b_simple": mean_and_error(exact_b) if exact_b else None,
        "seconds": time.perf_counter() - started,
    }


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5 * len(results), 3.6))
    for ax, result in zip(figure.subplots(1, len(results), squeeze=False)[0], results):
        sizes = result["batch_sizes"]
        for seed in range(len(result["b_noise_per_seed"])):
            ax.plot(sizes, [result["steps"][b][seed] for b in sizes], "o", color="tab:blue",
                    alpha=0.5, label="steps to target (each seed)" if seed == 0 else None)
        grid = [2 ** (i / 8) for i in range(24, 81)]
        ax.plot(grid, [result["s_min_pooled"] * (1 + result["b_noise_pooled"] / b)
                       for b in grid], "-", color="tab:blue", label="fit S_min(1 + B_noise/B)")
        lines = [("B_noise (fit)", result["b_noise"], "tab:blue"),
                 ("tracker B_simple", result["tracker_b_simple"], "tab:orange"),
                 ("measure_noise B_simple", result["measure_noise_b_simple"], "tab:green")]
        for label, value, color in lines:
            if value is not None:
                ax.axvline(value[0], color=color, linestyle="--",
                           label=f"{label} {value[0]:.3g}")
        ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="SGD steps to target",
               title=f"{result['task']}: loss {result['target_loss']}")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def number(value: tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value[0]:.3g} ± {value[1]:.2g}" if math.isfinite(value[1]) else f"{value[0]:.3g}"


def write(results: list[dict], seeds: int, elapsed: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "critical_batch_cpu.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "critical_batch_cpu.png")
    lines = [
        "# Critical batch size: direct measurement against the noise scale (CPU)",
        "",
        f"`python benchmarks/critical_batch.py`, commit {commit()}, "
        f"{datetime.date.today().isoformat()}, {device_name(torch.device('cpu'))}, "
        f"{seeds} seeds, {elapsed / 60:.1f} minutes in all. SGD, learning rate tuned per batch "
        f"size on {list(LEARNING_RATES)}; each step a fresh random batch; steps counted to the "
        f"first full-training-set loss at or below the target. B_noise: fit of "
        f"S = S_min(1 + B_noise/B), one per seed (mean ± standard error of the seeds' fits). "
        f"Tracker: `accumulate(steps={STEPS}, noise=NoiseTracker(overhead_target=None))` on "
        f"micro-batches of {MICRO} (B = {MICRO * STEPS}), read when that run reaches the target; "
        f"measure_noise: exact per-example gradients over the training set at those weights.",
        "",
        "| task | examples | target loss | B_noise (fit) | tracker B_simple | tracker's own "
        "error bars (measurable) | measure_noise B_simple | tracker / fit | "
        "measure_noise / fit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fit = r["b_noise"][0]

        def ratio(value: tuple[float, float] | None, fit: float = fit) -> str:
            return f"{value[0] / fit:.2g}" if value else "-"

        lines.append(
            f"| {r['task']} | {r['n_examples']} | {r['target_loss']} | {number(r['b_noise'])} "
            f"| {number(r['tracker_b_simple'])} | "
            + ", ".join(f"±{e:.2g}" for e in r.get("tracker_error_per_seed", []))
            + f" ({sum(r.get('tracker_measurable_per_seed', []))} of "
            f"{len(r.get('tracker_measurable_per_seed', []))} seeds) "
            f"| {number(r['measure_noise_b_simple'])} "
            f"| {ratio(r['tracker_b_simple'])} | {ratio(r['measure_noise_b_simple'])} |")
    lines += ["", "Steps to target at each batch size (per seed) and the learning rate used:", ""]
    for r in results:
        lines.append(f"- {r['task']}: " + "; ".join(
            f"B={b}: {r['steps'][b]} (lr {r['learning_rate'][b]})" for b in r["batch_sizes"]))
    lines += ["", "![steps to target against the batch size](critical_batch_cpu.png)", ""]
    (RESULTS / "critical_batch_cpu.md").write_text("\n".join(lines))


DATA: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 5 sizes: a try-out")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--rewrite", action="store_true",
                        help="write the .md and .png again from the .json, without training")
    args = parser.parse_args()
    if args.rewrite:
        results = json.loads((RESULTS / "critical_batch_cpu.json").read_text())
        for r in results:  # JSON keeps the batch sizes of these maps as strings
            r["steps"] = {int(b): v for b, v in r["steps"].items()}
            r["learning_rate"] = {int(b): v for b, v in r["learning_rate"].items()}
        write(results, len(results[0]["b_noise_per_seed"]), sum(r["seconds"] for r in results))
        return
    torch.set_num_threads(1)
    seeds = 2 if args.quick else args.seeds
    sizes = (8, 32, 128, 512, 1024) if args.quick else BATCH_SIZES
    started = time.perf_counter()
    results = []
    for task, (make_data, _, _) in TASKS.items():
        DATA[task] = make_data()
        results.append(run_task(task, sizes, seeds, args.max_steps))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "steps"}), flush=True)
    if not args.quick:
        write(results, seeds, time.perf_counter() - started)


if __name__ == "__main__":
    main()
