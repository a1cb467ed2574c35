"""A batch ramp from critical batches measured at checkpoints, against fixed batches, on steps
and examples to the same loss (issue 27, item 2).

McCandlish et al. 2018: the critical batch B_noise grows as the loss falls, so the batch that
balances steps and examples grows during training; following it (a batch warm-up) should take
fewer steps than the small batch for a comparable number of examples (Merrill et al. 2025).
Here the ramp follows the critical batch MEASURED by ``bw.critical_batch`` (branched runs from
the current weights), not the noise scale B_simple. Per task, from the same initial weights (one
per seed) to the same target loss on a fixed held-out evaluation set:

  (a) a fixed small batch (16), its SGD learning rate tuned on the grid task lr x 2^k;
  (b) fixed batches 64 and 256, each with its learning rate tuned likewise (the grid searched
      from lr(a) x sqrt(B / 16) up to the stability edge and down while the lowest rate wins);
  (c) the ramp: micro-batches of 8 in ``bw.accumulate(optimizer, steps="auto", model=model,
      noise=tracker)``, which starts at 2 micro-batches (batch 16, the batch of (a)) with (a)'s
      learning rate; at the start and each time the held-out loss has covered half, then three
      quarters, of the way from the initial loss to the target, ``bw.critical_batch`` runs from
      the current weights (base batch: the ramp's current batch, at its current learning rate;
      every other argument its default but noise=False) and ``tracker.critical = report``;
      accumulate ramps the batch up to the measured critical batch (rounded to 8 x a power of
      two, at most 1024) and scales the learning rate by the schedule's factor. The examples
      critical_batch spent (``report.examples``: its branches' training and evaluation) are
      counted apart from the training examples.

Steps are optimizer updates; the held-out loss is evaluated at every update up to 32, then every
update // 32 (about 3%), the steps and examples to the target interpolated between the last two
evaluations. Wall times include those evaluations, for every arm.

Tasks (CPU, one thread, SGD without momentum): scikit-learn's digits (an MLP 64-64-10, tanh;
every 6th image held out), a noisy 4-class problem (make_classification with 10% flipped labels,
an MLP 20-64-4; 2000 of its 6000 examples held out) and a noisy, badly conditioned linear
regression (feature scales 0.1 .. 3, label noise 1; 2048 fresh examples held out).

Usage:
    python benchmarks/batch_ramp.py            # -> results/batch_ramp_cpu.{md,json,png}
    python benchmarks/batch_ramp.py --quick    # 1 seed, 2 tasks: a try-out, writes nothing
    python benchmarks/batch_ramp.py --rewrite  # the .md and .png again from the .json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _machine import commit, device_name

import batchwidgets as bw

RESULTS = Path(__file__).parent / "results"
MICRO = 8  # the ramp's micro-batch
SMALL = 2 * MICRO  # arm (a): accumulate(steps="auto") starts at 2 micro-batches
LARGE = (64, 256)  # arm (b)
MAX_BATCH = 1024  # the ramp's bound (NoiseTracker(max_batch_size=...))
CHECKPOINTS = (0, 32, 128, 512, 2048)  # the ramp measures the critical batch at these updates
# the ramp's critical_batch arguments beyond model, data, optimizer, loss_fn, base_batch_size:
# the defaults (2 seeds, losses on 256 examples), and a lighter measurement (1 seed, 64)
RAMPS = {"ramp": {"noise": False},
         "ramp, light": {"noise": False, "seeds": 1, "eval_examples": 64}}
EVAL_EVERY = 32  # evaluations per doubling of the updates, after the first 32
BLOWUP = 2.0  # a run whose held-out loss passes 2x its start has diverged
LADDER = 4  # critical_batch needs 3 rungs: base x 1, 2, 4 within the data


# ---------------------------------------------------------------------------------- the tasks

Split = tuple[TensorDataset, tuple[torch.Tensor, torch.Tensor]]


def digits_data() -> Split:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x, y = (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(y)
    held = torch.arange(len(x)) % 6 == 0
    return TensorDataset(x[~held], y[~held]), (x[held], y[held])


def noisy_classes_data() -> Split:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=6000, n_features=20, n_informative=10, n_classes=4,
                               flip_y=0.1, class_sep=1.0, random_state=0)
    x = torch.tensor(x, dtype=torch.float32)
    x, y = (x - x.mean(0)) / x.std(0), torch.tensor(y)
    return TensorDataset(x[:4000], y[:4000]), (x[4000:], y[4000:])


def regression_data(n: int = 8192, held: int = 2048, dim: int = 32) -> Split:
    """y = x.w + noise: feature scales log-spaced 0.1 .. 3, label noise of standard deviation 1
    (the best held-out loss is about 1.0)."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(math.log10(0.1), math.log10(3.0), dim)
    w = torch.randn(dim, 1, generator=generator)
    x = torch.randn(n + held, dim, generator=generator) * scales
    y = x @ w + torch.randn(n + held, 1, generator=generator)
    return TensorDataset(x[:n], y[:n]), (x[n:], y[n:])


def mlp(inputs: int, classes: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


@dataclasses.dataclass
class Task:
    name: str
    data: Callable[[], Split]
    model: Callable[[], nn.Module]
    loss_fn: Callable
    lr: float  # the first rate of (a)'s grid
    target: float  # the held-out loss every arm runs to
    max_updates: int  # a run's cap
    describe: str


CE, MSE = nn.functional.cross_entropy, nn.functional.mse_loss
# Targets fixed before any ramp ran, from a pilot of batch 16 (lr 0.1 .. 0.8): a loss it reaches
# in some hundreds to a few thousand updates, above the held-out loss's floor (digits ~0.08,
# 4-class ~0.69, regression 1.0).
TASKS = [
    Task("digits", digits_data, lambda: mlp(64, 10), CE, 0.2, 0.09, 4000,
         "1497 training images, 300 held out (every 6th), MLP 64-64-10 (tanh)"),
    Task("noisy 4-class", noisy_classes_data, lambda: mlp(20, 4), CE, 0.1, 0.75, 6000,
         "4000 training examples, 2000 held out, 10% flipped labels, MLP 20-64-4 (tanh)"),
    Task("noisy regression", regression_data, lambda: nn.Linear(32, 1), MSE, 0.01, 1.10, 6000,
         "8192 training examples, 2048 held out, 32 features of scales 0.1 .. 3, label noise 1,"
         " linear"),
]


# ------------------------------------------------------------------------------------- runs

def model_for(task: Task, seed: int) -> nn.Module:
    torch.manual_seed(1000 + seed)  # the same initial weights for every arm of a seed
    return task.model()


def held_out_loss(task: Task, model: nn.Module, held: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(task.loss_fn(model(held[0]), held[1]))


def due(update: int) -> bool:
    return update % max(1, update // EVAL_EVERY) == 0


class Curve:
    """Held-out losses against updates, training examples (and measurement examples, for the
    ramp), and where the loss crossed the target (interpolated between two evaluations)."""

    def __init__(self, start: float, target: float):
        self.start, self.target = start, target
        self.points: list[list[float]] = [[0, 0, float(f"{start:.4g}"), 0]]
        self.before = (0, 0, start)  # the last evaluation, unrounded
        self.steps: float | None = None
        self.examples: float | None = None
        self.status = "running"

    def add(self, update: int, examples: int, loss: float, measured: int = 0) -> bool:
        """Record an evaluation (update, training examples, loss to 4 digits, measurement
        examples); True when the run is over (reached or diverged)."""
        self.points.append([update, examples, float(f"{loss:.4g}"), measured])
        if not math.isfinite(loss) or loss > BLOWUP * self.start:
            self.status = "diverged"
            return True
        if loss <= self.target:
            u, e, before = self.before
            share = (before - self.target) / (before - loss) if before > loss else 1.0
            self.steps = round(u + share * (update - u), 2)
            self.examples = round(e + share * (examples - e), 1)
            self.status = "reached"
            return True
        self.before = (update, examples, loss)
        return False

    def result(self, seconds: float) -> dict:
        return {"status": self.status if self.status != "running" else "not reached",
                "steps": self.steps, "examples": self.examples, "seconds": round(seconds, 3),
                "curve": self.points}


def batches(n: int, size: int, generator: torch.Generator):
    """Batches of ``size`` indices from successive random permutations of range(n)."""
    order = torch.empty(0, dtype=torch.long)
    while True:
        if len(order) < size:
            order = torch.cat([order, torch.randperm(n, generator=generator)])
        picked, order = order[:size], order[size:]
        yield picked


def run_fixed(task: Task, split: Split, seed: int, batch: int, lr: float,
              max_updates: int) -> dict:
    train, held = split
    x, y = train.tensors
    model = model_for(task, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    draw = batches(len(x), batch, torch.Generator().manual_seed(seed))
    started = time.perf_counter()
    curve = Curve(held_out_loss(task, model, held), task.target)
    for update in range(1, max_updates + 1):
        picked = next(draw)
        optimizer.zero_grad()
        task.loss_fn(model(x[picked]), y[picked]).backward()
        optimizer.step()
        if (due(update) or update == max_updates) and curve.add(
                update, update * batch, held_out_loss(task, model, held)):
            break
    return curve.result(time.perf_counter() - started)


def run_ramp(task: Task, split: Split, seed: int, lr: float, max_updates: int,
             measuring: dict) -> dict:
    train, held = split
    x, y = train.tensors
    model = model_for(task, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tracker = bw.NoiseTracker(overhead_target=None, max_batch_size=MAX_BATCH)
    draw = batches(len(x), MICRO, torch.Generator().manual_seed(seed))
    measurements: list[dict] = []
    spent = [0, 0.0]  # measurement examples, seconds

    def measure(update: int, examples: int, loss: float, acc) -> None:
        report_now = acc.report
        batch, factor = MICRO * report_now.steps, report_now.lr_factor
        row = {"update": update, "examples": examples, "loss": loss, "base_batch": batch,
               "lr": lr * factor}
        if batch * LADDER > len(train):
            measurements.append({**row, "skipped": f"a ladder from {batch} needs "
                                 f"{batch * LADDER} examples, the data has {len(train)}"})
            return
        for group in optimizer.param_groups:  # the loop's rate: the block scales it per update
            group["lr"] = lr * factor
        began = time.perf_counter()
        try:
            report = bw.critical_batch(model, train, optimizer=optimizer,
                                       loss_fn=task.loss_fn, base_batch_size=batch,
                                       **measuring)
        finally:
            for group in optimizer.param_groups:
                group["lr"] = lr
        seconds = time.perf_counter() - began
        tracker.critical = report
        spent[0] += report.examples
        spent[1] += seconds
        measurements.append({
            **row, "critical_batch": report.critical_batch_size,
            "critical_batch_error": report.critical_batch_size_error,
            "reason": report.reason, "examples_spent": report.examples,
            "seconds": round(seconds, 3), "target_loss": report.target_loss,
            "start_loss": report.start_loss,
            "ladder": [[b.batch_size, round(b.lr, 6), b.steps_to_target, b.diverged]
                       for b in report.ladder]})

    started = time.perf_counter()
    start = held_out_loss(task, model, held)
    curve = Curve(start, task.target)
    update = examples = 0
    batch_per_update: list[int] = []
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker) as acc:
        measure(0, 0, start, acc)
        in_update = 0
        while update < max_updates:
            picked = next(draw)
            real = acc.is_sync_step
            task.loss_fn(model(x[picked]), y[picked]).backward()
            optimizer.step()
            optimizer.zero_grad()
            examples += MICRO
            in_update += 1
            if not real:
                continue
            update += 1
            batch_per_update.append(in_update * MICRO)
            in_update = 0
            checkpoint = update in CHECKPOINTS
            if not (due(update) or checkpoint or update == max_updates):
                continue
            loss = held_out_loss(task, model, held)
            if curve.add(update, examples, loss, spent[0]):
                break
            if checkpoint:
                measure(update, examples, loss, acc)
        changes = acc.report.schedule_changes
    result = curve.result(time.perf_counter() - started)
    result.update(
        measurement_examples=spent[0], measurement_seconds=round(spent[1], 3),
        measurements=measurements, final_batch=batch_per_update[-1] if batch_per_update else None,
        changes=[{"update": c.update, "batch_size": c.batch_size, "lr_factor": c.lr_factor,
                  "source": c.source, "critical_batch": c.critical_batch_size,
                  "b_simple": c.b_simple} for c in changes])
    return result


# ------------------------------------------------------------------------------- the tuning

def mean_steps(runs: list[dict], seeds: int) -> float:
    if len(runs) < seeds or any(r["status"] != "reached" for r in runs):
        return math.inf
    return statistics.fmean(r["steps"] for r in runs)


def tune(task: Task, split: Split, batch: int, lr0: float, k0: int, seeds: int) -> dict:
    """The rate lr0 x 2^k with the fewest mean steps to the target over the seeds, searched up
    from k0 until a rate diverges or two in a row do not improve, then down while the lowest
    tried wins; runs capped at twice the best mean so far."""
    tried: dict[int, list[dict]] = {}

    def best() -> float:
        return min((mean_steps(r, seeds) for r in tried.values()), default=math.inf)

    def trial(k: int) -> None:
        cap = task.max_updates if best() == math.inf else min(task.max_updates,
                                                               int(2 * best()) + 1)
        runs = []
        for seed in range(seeds):
            runs.append(run_fixed(task, split, seed, batch, lr0 * 2.0**k, cap))
            if runs[-1]["status"] != "reached":
                break
        tried[k] = runs

    def winner() -> int:
        return min(tried, key=lambda j: (mean_steps(tried[j], seeds), -j))

    k, worse = k0, 0
    while k <= k0 + 6:  # up, to the stability edge
        trial(k)
        if any(r["status"] == "diverged" for r in tried[k]):
            break
        worse = 0 if winner() == k else worse + 1
        if worse >= 2:
            break
        k += 1
    k = min(tried)
    while winner() == k and k > k0 - 6:  # down, while the lowest wins (or none reached)
        k -= 1
        trial(k)
    k = winner()
    return {"batch": batch, "lr": lr0 * 2.0**k, "runs": tried[k],
            "grid": {f"{lr0 * 2.0**j:.4g}": [r["steps"] if r["status"] == "reached"
                                             else r["status"] for r in tried[j]]
                     for j in sorted(tried)},
            "tuning_examples": sum(r["curve"][-1][1] for runs in tried.values() for r in runs)}


def run_task(task: Task, seeds: int) -> dict:
    split = task.data()
    began = time.perf_counter()
    arms = {}
    small = tune(task, split, SMALL, task.lr, 0, seeds)
    arms[f"fixed {SMALL}"] = small
    print(f"{task.name}: batch {SMALL}: lr {small['lr']:.4g} {small['grid']}", flush=True)
    for batch in LARGE:
        arms[f"fixed {batch}"] = tune(task, split, batch, small["lr"],
                                      round(0.5 * math.log2(batch / SMALL)), seeds)
        print(f"{task.name}: batch {batch}: lr {arms[f'fixed {batch}']['lr']:.4g} "
              f"{arms[f'fixed {batch}']['grid']}", flush=True)
    for name, measuring in RAMPS.items():
        ramp = [run_ramp(task, split, seed, small["lr"], task.max_updates, measuring)
                for seed in range(seeds)]
        arms[name] = {"batch": None, "lr": small["lr"], "runs": ramp, "measuring": measuring}
        for seed, r in enumerate(ramp):
            print(f"{task.name}: {name} seed {seed}: {r['status']} steps {r['steps']} examples "
                  f"{r['examples']} + {r['measurement_examples']} measuring; batches "
                  f"{[(c['update'], c['batch_size'], c['source']) for c in r['changes']]}; "
                  f"critical {[m.get('critical_batch') for m in r['measurements']]}", flush=True)
    train, held = split
    return {"task": task.name, "describe": task.describe, "target": task.target,
            "train_examples": len(train), "held_out_examples": len(held[0]),
            "start_loss": ramp[0]["curve"][0][2], "seconds": time.perf_counter() - began,
            "arms": arms}


# ------------------------------------------------------------------------------ the writing

def stat(values: list[float | None]) -> tuple[float, float]:
    if not values or any(v is None for v in values):
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], math.nan
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def number(value: float, error: float = math.nan, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    text = f"{value:,.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"
    return text if not math.isfinite(error) else f"{text} ± {error:.2g}"


def summary(arm: dict) -> dict:
    runs = arm["runs"]
    reached = all(r["status"] == "reached" for r in runs)
    measuring = [r.get("measurement_examples", 0) for r in runs]
    return {
        "reached": reached, "statuses": [r["status"] for r in runs],
        "steps": stat([r["steps"] for r in runs]) if reached else (math.nan, math.nan),
        "examples": stat([r["examples"] for r in runs]) if reached else (math.nan, math.nan),
        "measuring": stat(measuring),
        "total": stat([r["examples"] + m for r, m in zip(runs, measuring)])
        if reached else (math.nan, math.nan),
        "seconds": stat([r["seconds"] for r in runs]),
        "measuring_seconds": stat([r.get("measurement_seconds", 0.0) for r in runs])}


def verdict(result: dict, name: str) -> str:
    small = summary(result["arms"][f"fixed {SMALL}"])
    ramp = summary(result["arms"][name])
    if not ramp["reached"]:
        runs = result["arms"][name]["runs"]
        done = [r for r in runs if r["status"] == "reached"]
        text = (f"{name}: {len(runs) - len(done)} of {len(runs)} seeds did not reach the "
                f"target ({', '.join(ramp['statuses'])})")
        if done and small["reached"]:
            steps = statistics.fmean(r["steps"] for r in done) / small["steps"][0]
            training = statistics.fmean(r["examples"] for r in done) / small["examples"][0]
            text += (f"; the seeds that did: {steps:.2f}x the steps of batch {SMALL} for "
                     f"{training:.2f}x its training examples")
        return text
    if not small["reached"]:
        return f"batch {SMALL} did not reach the target"
    steps = ramp["steps"][0] / small["steps"][0]
    training = ramp["examples"][0] / small["examples"][0]
    total = ramp["total"][0] / small["examples"][0]
    better = [arm for arm, value in result["arms"].items() if arm.startswith("fixed")
              and summary(value)["reached"] and summary(value)["steps"][0] <= ramp["steps"][0]
              and summary(value)["examples"][0] <= ramp["examples"][0]]
    return (f"{name}: {steps:.2f}x the steps of batch {SMALL} "
            f"({'fewer' if steps < 1 else 'more'}) for {training:.2f}x its training examples; "
            f"with the measurements {total:.1f}x its examples (the measurements: "
            f"{ramp['measuring'][0] / ramp['examples'][0]:.1f}x the ramp's own training "
            f"examples); a fixed batch with no more steps and no more training examples: "
            f"{', '.join(better) or 'none'}")


def edge(run: dict, lr: float) -> str:
    """The ramp's last batch and rate against the rates critical_batch's own branches tried at
    that batch in the measurement before the change: the largest that did not diverge, the
    smallest that did."""
    if not run["changes"]:
        return ""
    last = run["changes"][-1]
    before = [m for m in run["measurements"] if "ladder" in m and m["update"] < last["update"]]
    tried = [(b_lr, diverged) for b, b_lr, _, diverged in (before[-1]["ladder"] if before
                                                          else []) if b == last["batch_size"]]
    calm = max((v for v, d in tried if not d), default=None)
    blown = min((v for v, d in tried if d), default=None)
    text = f"; its last batch {last['batch_size']} ran at lr {lr * last['lr_factor']:.3g}"
    if tried:
        text += (f" (the measurement before it, at batch {last['batch_size']}: "
                 f"{'no rate' if calm is None else f'{calm:.3g}'} did not diverge, "
                 f"{'none' if blown is None else f'{blown:.3g}'} diverged)")
    return text


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 3.6 * len(results)))
    axes = figure.subplots(len(results), 2, squeeze=False)
    colors = {f"fixed {SMALL}": "tab:blue", f"fixed {LARGE[0]}": "tab:green",
              f"fixed {LARGE[1]}": "tab:orange", "ramp": "tab:red",
              "ramp, light": "tab:purple"}
    for (by_steps, by_examples), result in zip(axes, results):
        for name, arm in result["arms"].items():
            for seed, run in enumerate(arm["runs"]):
                points = run["curve"]
                label = (f"{name} (lr {arm['lr']:.3g})" if "ramp" not in name else
                         f"{name} (lr {arm['lr']:.3g} x factor)") if seed == 0 else None
                steps = [max(p[0], 0.5) for p in points]
                by_steps.plot(steps, [p[2] for p in points], color=colors[name], alpha=0.7,
                              lw=1, label=label)
                by_examples.plot([max(p[1], 1) for p in points], [p[2] for p in points],
                                 color=colors[name], alpha=0.7, lw=1, label=label)
                if "ramp" in name:
                    by_examples.plot([max(p[1] + p[3], 1) for p in points],
                                     [p[2] for p in points], color=colors[name], alpha=0.7,
                                     lw=1, ls=":", label=f"{name}, with measurement examples"
                                     if seed == 0 else None)
        for ax, xlabel in ((by_steps, "optimizer updates"),
                           (by_examples, "examples (training; dotted: + measurement)")):
            ax.axhline(result["target"], color="gray", lw=0.8, ls="--")
            ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="held-out loss",
                   title=f"{result['task']}: to held-out loss {result['target']:g}")
        by_steps.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def markdown(data: dict) -> str:
    results = data["results"]
    lines = [
        "# A batch ramp from measured critical batches against fixed batches (CPU)",
        "",
        f"`python benchmarks/batch_ramp.py`, commit {data['commit']}, {data['date']}, "
        f"{data['device']}, {data['seeds']} seeds, {data['seconds'] / 60:.1f} minutes in all.",
        "",
        "Every arm trains from the same initial weights (one per seed) with SGD (no momentum) "
        "until the loss on a fixed held-out set (below) reaches the task's target, evaluated at "
        f"every update up to {EVAL_EVERY} and then every update // {EVAL_EVERY}; steps "
        "(optimizer updates) and training examples to the target are interpolated between the "
        "last two evaluations. Mean ± standard error over the seeds.",
        "",
        f"- **fixed {SMALL}** (a): the learning rate tuned on the grid task lr x 2^k: up from "
        "the task lr until a rate diverges or two in a row do not lower the mean steps over the "
        "seeds, down while the lowest tried wins; runs capped at twice the best mean so far.",
        f"- **fixed {LARGE[0]}, {LARGE[1]}** (b): the same search from (a)'s rate x "
        "sqrt(B / 16) on (a)'s rate x 2^k.",
        f'- **ramp** (c): micro-batches of {MICRO} in `bw.accumulate(optimizer, steps="auto", '
        f"model=model, noise=bw.NoiseTracker(overhead_target=None, max_batch_size={MAX_BATCH}))`"
        f", which starts at 2 micro-batches (batch {SMALL}) with (a)'s tuned rate and looks at "
        "the schedule every 16 updates. Checkpoints at updates "
        f"{', '.join(str(c) for c in CHECKPOINTS)} (fixed in updates, chosen before any run): "
        "`bw.critical_batch(model, train_set, optimizer=optimizer, loss_fn=..., "
        "base_batch_size=<the ramp's current batch>, noise=False)` from the current weights at "
        "the ramp's current learning rate (the block's factor put on the optimizer for the "
        "measurement), inside the block (its branches are not the block's micro-steps), then "
        "`tracker.critical = report`; accumulate ramps up to the measured critical batch "
        f"rounded to {MICRO} x a power of two and multiplies the rate by the schedule's factor, "
        "capped by the rate critical_batch found fastest at that batch (where a report is not "
        "measurable, the schedule follows the tracker's B_simple, held to the side of a bound). "
        "Measurement examples: `report.examples` summed (critical_batch's branches: training and "
        "its own loss evaluations, which it counts as examples too); a checkpoint whose ladder "
        "(base x 1, 2, 4) would not fit in the training set is skipped.",
        "- **ramp, light**: the same with a lighter measurement, `seeds=1, eval_examples=64` "
        "(critical_batch's defaults: 2 seeds, losses on 256 examples, which are most of its "
        "examples).",
        "",
        "| task | arm | batch | lr | steps to target | training examples | measurement examples "
        "| training + measurement | wall s (of which measuring) | steps / fixed 16 | "
        "examples / fixed 16 (with measurement) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        base = summary(result["arms"][f"fixed {SMALL}"])
        for name, arm in result["arms"].items():
            s = summary(arm)
            is_ramp = "ramp" in name
            if is_ramp:
                finals = sorted({r["final_batch"] for r in arm["runs"]})
                batch = f"{SMALL} -> {'/'.join(str(b) for b in finals)}"
            else:
                batch = str(arm["batch"])
            steps = (number(*s["steps"]) if s["reached"] else " / ".join(
                number(r["steps"]) if r["status"] == "reached" else
                f"{r['status']} at {r['curve'][-1][0]}" for r in arm["runs"]))
            ratio_steps = (f"{s['steps'][0] / base['steps'][0]:.2f}" if s["reached"]
                           and base["reached"] else "-")
            ratio_examples = (f"{s['examples'][0] / base['examples'][0]:.2f}"
                              + (f" ({s['total'][0] / base['examples'][0]:.1f})" if is_ramp
                                 else "") if s["reached"] and base["reached"] else "-")
            examples = (number(*s["examples"]) if s["reached"] else " / ".join(
                number(r["examples"]) if r["status"] == "reached" else "-"
                for r in arm["runs"]))
            lines.append(
                f"| {result['task']} | {name} | {batch} | {arm['lr']:.3g}"
                f"{' x factor' if is_ramp else ''} | {steps} | {examples} | "
                f"{number(*s['measuring']) if is_ramp else '-'} | "
                f"{number(*s['total']) if is_ramp else '-'} | {number(*s['seconds'])}"
                f"{' (' + number(*s['measuring_seconds']) + ')' if is_ramp else ''} | "
                f"{ratio_steps} | {ratio_examples} |")
    lines += ["", "Verdicts (means over the seeds):", ""]
    lines += [f"- **{r['task']}**, {verdict(r, name)}." for r in results for name in RAMPS
              if name in r["arms"]]
    lines += ["", "Tasks (target fixed from a pilot of batch 16 before any ramp ran):", ""]
    for r in results:
        lines.append(f"- **{r['task']}**: {r['describe']}; held-out loss {r['start_loss']:.4g} "
                     f"at the initial weights (seed 0) -> target {r['target']:g}.")
    lines += ["", "The ramps' runs, per seed: measurements (update, base batch @ lr: critical "
              "batch, examples spent) and the batch changes accumulate made (update: batch, "
              "learning-rate factor, source):", ""]
    for r, name in ((r, name) for r in results for name in RAMPS if name in r["arms"]):
        for seed, run in enumerate(r["arms"][name]["runs"]):
            measured = "; ".join(
                f"@{m['update']} {m['base_batch']}@{m['lr']:.3g}: skipped ({m['skipped']})"
                if "skipped" in m else
                f"@{m['update']} {m['base_batch']}@{m['lr']:.3g}: "
                f"{number(m['critical_batch'], m['critical_batch_error'] or math.nan)}"
                f"{' (' + m['reason'] + ')' if m['reason'] else ''}, "
                f"{m['examples_spent']:,} ex"
                for m in run["measurements"])
            changes = ", ".join(f"{c['update']}: {c['batch_size']} x{c['lr_factor']:.3g} "
                                f"({c['source']})" for c in run["changes"]) or "none"
            changes += edge(run, r["arms"][name]["lr"])
            where = (f" at update {run['curve'][-1][0]}" if run["status"] != "reached"
                     else f" in {run['steps']:.4g} updates")
            lines.append(f"- {r['task']}, {name}, seed {seed} ({run['status']}{where}): "
                         f"measured {measured}. "
                         f"Batch changes: {changes}.")
    lines += ["", "The learning-rate grids (rate: steps to target per seed; a search stops a "
              "rate at its first seed that does not reach the target):", ""]
    for r in results:
        for name, arm in r["arms"].items():
            if "grid" in arm:
                lines.append(f"- {r['task']}, {name}: " + "; ".join(
                    f"{lr}: {v}" for lr, v in arm["grid"].items())
                    + f" (tuning: {arm['tuning_examples']:,} training examples)")
    lines += ["", "![held-out loss against steps and examples](batch_ramp_cpu.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, digits and regression, writes nothing: a try-out")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="*", help="names of the tasks to run (default: all)")
    parser.add_argument("--rewrite", action="store_true",
                        help="write the .md and .png again from the .json, without training")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rewrite:
        data = json.loads((RESULTS / "batch_ramp_cpu.json").read_text())
        (RESULTS / "batch_ramp_cpu.md").write_text(markdown(data))
        plot(data["results"], RESULTS / "batch_ramp_cpu.png")
        return
    seeds = 1 if args.quick else args.seeds
    names = args.tasks or (["digits", "noisy regression"] if args.quick
                           else [t.name for t in TASKS])
    began = time.perf_counter()
    results = [run_task(task, seeds) for task in TASKS if task.name in names]
    data = {"seeds": seeds, "seconds": time.perf_counter() - began, "commit": commit(),
            "date": datetime.date.today().isoformat(),
            "device": device_name(torch.device("cpu")), "results": results}
    text = markdown(data)
    if args.quick:
        print(text)
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_ramp_cpu.json").write_text(json.dumps(data, separators=(",", ":")))
    (RESULTS / "batch_ramp_cpu.md").write_text(text)
    plot(results, RESULTS / "batch_ramp_cpu.png")
    print(text)


if __name__ == "__main__":
    main()
