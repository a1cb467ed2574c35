"""The measured critical batch (``bw.critical_batch``) against full steps-to-target curves (issue
27, item 4), beside the noise scale B_simple (issue 16).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11): training to a
given loss at batch size B takes S = S_min (1 + B_noise / B) steps and E = E_min (1 + B /
B_noise) examples, B_noise the critical batch size. For each task, from one checkpoint (the
weights after a short warm-up at a small batch, and the optimizer's state there):

  * ``bw.critical_batch`` with its defaults (base batch and the learning rate a user would train
    with, stated per task): its critical batch, target loss, examples spent and wall time;
  * the reference: steps to THE SAME target loss (``report.target_loss``, evaluated the same way:
    the mean loss on the same evenly spaced examples (critical_batch's eval_examples), every
    step up to 64 and then every step // 64, about 1.5%) FROM THE SAME checkpoint, at batch
    sizes well below to well above
    B_noise, the learning rate tuned per batch on a factor-2 grid that goes up until a rate
    diverges (any seed) or two rates in a row do not lower the mean steps over the seeds (the
    stability edge), 3 seeds; S = S_min (1 + B_noise / B) fitted by least squares in log S per
    seed and on the seeds' mean; every example the curves spent is counted (every grid rate and
    seed, training and evaluation);
  * B_simple at the checkpoint: measure_noise's (exact per-example gradients, the one
    critical_batch reports), and the tracker's, ``accumulate(steps=4, noise=NoiseTracker())`` on
    micro-batches of the base batch over a short run from the checkpoint.

Goal (issue 27): the measured critical batch within 2x of the fitted B_noise on each task, at a
tenth of the curves' examples or less.

Tasks (CPU, one thread): scikit-learn's digits (bundled, 1797 8x8 images, an MLP, SGD); a noisy,
badly conditioned linear regression (Gaussian inputs with feature scales 0.1 .. 3, label noise,
SGD); a small causal transformer LM (2 layers, d_model 64) on synthetic text from a random sparse
bigram table (vocabulary 64, sequences of 32 tokens, AdamW); and the noisy 4-class problem of the
first version (make_classification with 10% flipped labels, an MLP, SGD).

Usage:
    python benchmarks/critical_batch.py            # -> results/critical_batch_cpu.{md,json,png}
    python benchmarks/critical_batch.py --quick    # 2 seeds, fewer sizes: a try-out, writes nothing
    python benchmarks/critical_batch.py --rewrite  # the .md and .png again from the .json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import inspect
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
# critical_batch's default evaluation sample, used by the curves too
EVAL_EXAMPLES = inspect.signature(bw.critical_batch).parameters["eval_examples"].default
BLOWUP = 2.0  # as critical_batch: a run whose loss passes 2x the starting loss has diverged
TRACKER_STEPS, TRACKER_UPDATES = 4, 64  # the tracker's run: 64 updates of 4 micro-batches


# ---------------------------------------------------------------------------------- the tasks

def digits_data() -> TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    return TensorDataset((x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(y))


def noisy_classes_data() -> TensorDataset:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=4000, n_features=20, n_informative=10, n_classes=4,
                               flip_y=0.1, class_sep=1.0, random_state=0)
    x = torch.tensor(x, dtype=torch.float32)
    return TensorDataset((x - x.mean(0)) / x.std(0), torch.tensor(y))


def regression_data(n: int = 8192, dim: int = 32) -> TensorDataset:
    """y = x.w + noise: feature scales log-spaced 0.1 .. 3 (Hessian condition number 900),
    label noise of standard deviation 1 (the best loss is 1.0)."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(math.log10(0.1), math.log10(3.0), dim)
    x = torch.randn(n, dim, generator=generator) * scales
    w = torch.randn(dim, 1, generator=generator)
    return TensorDataset(x, x @ w + torch.randn(n, 1, generator=generator))


VOCAB, CONTEXT, SUCCESSORS = 64, 32, 4


def text_data(n: int = 4096) -> TensorDataset:
    """Sequences from a random sparse bigram table: each token has 4 possible successors with
    Dirichlet(1) probabilities (about 1 nat of entropy per token); (tokens, next tokens)."""
    generator = torch.Generator().manual_seed(0)
    table = torch.zeros(VOCAB, VOCAB)
    for token in range(VOCAB):
        successors = torch.randperm(VOCAB, generator=generator)[:SUCCESSORS]
        weights = -torch.log(torch.rand(SUCCESSORS, generator=generator))  # Dirichlet(1)
        table[token, successors] = weights / weights.sum()
    tokens = torch.empty(n, CONTEXT + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
    for t in range(CONTEXT):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=generator)[:, 0]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class TinyLM(nn.Module):
    """A causal transformer: token and position embeddings, 2 pre-norm encoder layers with a
    causal mask (d_model 64, 4 heads, no dropout), a linear head."""

    def __init__(self, d_model: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(CONTEXT, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, 2 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[:tokens.shape[1]]
        return self.head(self.body(h, mask=self.mask, is_causal=True))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def mlp(inputs: int, classes: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


@dataclasses.dataclass
class Task:
    name: str
    data: Callable[[], TensorDataset]
    model: Callable[[], nn.Module]
    optimizer: Callable  # (params, lr) -> Optimizer
    loss_fn: Callable
    lr: float  # the user's learning rate at the base batch: critical_batch's and the warm-up's
    base: int  # critical_batch's base batch (and the warm-up's batch)
    warmup: int  # steps from the initial weights to the checkpoint, at the base batch and lr
    sizes: tuple[int, ...]  # the curves' batch sizes
    max_steps: int  # the curves' cap on the steps of a run
    describe: str


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


CE, MSE = nn.functional.cross_entropy, nn.functional.mse_loss
BASE_TASKS = [
    Task("digits", digits_data, lambda: mlp(64, 10), sgd, CE, 0.3, 8, 0,
         (4, 8, 16, 32, 64, 128, 256, 512, 1024), 1500,
         "1797 images, MLP 64-64-10 (tanh), SGD"),
    Task("noisy regression", regression_data, lambda: nn.Linear(32, 1), sgd, MSE, 0.02, 8, 0,
         (4, 8, 16, 32, 64, 128, 256, 512, 1024), 1500,
         "8192 examples, 32 Gaussian features of scales 0.1 .. 3, label noise 1, linear, SGD"),
    Task("bigram LM", text_data, TinyLM, adamw, token_loss, 1e-3, 8, 0,
         (2, 4, 8, 16, 32, 64, 128, 256), 600,
         "4096 sequences of 32 tokens (vocabulary 64, sparse bigram), transformer 2x64, AdamW"),
    Task("noisy 4-class", noisy_classes_data, lambda: mlp(20, 4), sgd, CE, 0.1, 8, 0,
         (4, 8, 16, 32, 64, 128, 256, 512, 1024), 1500,
         "4000 examples, 10% flipped labels, MLP 20-64-4 (tanh), SGD"),
]
WARMUPS = (32, 300)  # two checkpoints per task: early in the descent, and later
TASKS = [dataclasses.replace(task, warmup=steps) for task in BASE_TASKS for steps in WARMUPS]


# --------------------------------------------------------------------------- runs and curves

class Runs:
    """Runs from one checkpoint (weights and optimizer state) to a target loss, counting every
    example spent (training and evaluation)."""

    def __init__(self, task: Task, data: TensorDataset, model: nn.Module, optimizer):
        self.task, self.data, self.model, self.optimizer = task, data, model, optimizer
        self.weights = copy.deepcopy(model.state_dict())
        self.state = copy.deepcopy(optimizer.state_dict())
        n = len(data)
        m = min(EVAL_EXAMPLES, n)  # critical_batch's evaluation sample: evenly spaced items
        index = torch.tensor([i * n // m for i in range(m)])
        self.eval_x, self.eval_y = data.tensors[0][index], data.tensors[1][index]
        self.examples = self.train_examples = 0
        self.start = self.loss()

    def loss(self) -> float:
        self.examples += len(self.eval_x)
        with torch.no_grad():
            return float(self.task.loss_fn(self.model(self.eval_x), self.eval_y))

    def restore(self) -> None:
        self.model.load_state_dict(self.weights)
        self.optimizer.load_state_dict(copy.deepcopy(self.state))

    def run(self, batch_size: int, lr: float, seed: int, max_steps: int,
            target: float) -> tuple[float | None, bool]:
        """(steps to the target or None, diverged): the steps interpolated between the last two
        evaluations where the loss crossed the target (as critical_batch counts them)."""
        self.restore()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.data.tensors
        generator = torch.Generator().manual_seed(1000 + seed)
        order = torch.empty(0, dtype=torch.long)
        step, next_eval, before = 0, 1, (0, self.start)
        while step < max_steps:
            if len(order) < batch_size:
                order = torch.cat([order, torch.randperm(len(x), generator=generator)])
            picked, order = order[:batch_size], order[batch_size:]
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task.loss_fn(self.model(x[picked]), y[picked])
            if not torch.isfinite(loss):
                return None, True
            loss.backward()
            self.optimizer.step()
            self.examples += batch_size
            self.train_examples += batch_size
            step += 1
            if step >= next_eval:
                value = self.loss()
                if not math.isfinite(value) or value > BLOWUP * self.start:
                    return None, True
                if value <= target:
                    (p, loss_p), drop = before, before[1] - value
                    at = p + (step - p) * (loss_p - target) / drop if drop > 0 else step
                    return round(at, 3), False
                before = (step, value)
                next_eval = step + (1 if step < 64 else step // 64)
        return None, False


def curves(runs: Runs, target: float, seeds: int, lr0: float) -> dict:
    """Steps to the target per batch size and seed, the learning rate tuned per batch size on the
    grid lr0 x 2^k: the rate with the fewest mean steps over the seeds, searched upwards until a
    rate diverges or two in a row do not improve (and downwards while the lowest tried wins)."""
    task = runs.task
    tried: dict[int, dict[int, list[float] | str]] = {}
    best_k: dict[int, int] = {}
    steps: dict[int, list[float]] = {}
    k_start = -3  # the first batch: from lr0 / 8 up
    for b in task.sizes:
        results: dict[int, list[float] | str] = {}

        def mean_steps(k: int, results: dict = results) -> float:
            outcome = results[k]
            return statistics.fmean(outcome) if isinstance(outcome, list) else math.inf

        def trial(k: int, b: int = b, results: dict = results) -> None:
            reached = [mean_steps(j) for j in results]
            cap = min(task.max_steps, int(2 * min(reached)) + 1) if reached and min(
                reached) < math.inf else task.max_steps
            outcome: list[float] = []
            for seed in range(seeds):
                found, diverged = runs.run(b, lr0 * 2.0**k, seed, cap, target)
                if diverged:
                    results[k] = "diverged"
                    return
                if found is None:
                    results[k] = "slow"
                    return
                outcome.append(found)
            results[k] = outcome

        k, worse = k_start, 0
        while True:  # upwards to the stability edge
            trial(k)
            if results[k] == "diverged":
                break
            best = min(results, key=mean_steps)
            worse = 0 if best == k else worse + 1
            if worse >= 2:
                break
            k += 1
        k = min(results)
        while min(results, key=mean_steps) == k and mean_steps(k) < math.inf:  # downwards
            k -= 1
            trial(k)
        if min(mean_steps(j) for j in results) == math.inf:
            tried[b] = results
            continue
        best_k[b] = min(results, key=mean_steps)
        steps[b] = results[best_k[b]]
        tried[b] = results
        k_start = best_k[b] - 1  # the best rate grows with the batch: start one below the last
    return {"steps": steps, "lr": {b: lr0 * 2.0**k for b, k in best_k.items()},
            "edge": {b: lr0 * 2.0**max((j for j, r in results.items() if r != "diverged"),
                                       default=0) for b, results in tried.items()},
            "tried": {b: {f"{lr0 * 2.0**j:.4g}": r for j, r in sorted(results.items())}
                      for b, results in tried.items()}}


def fit_log(sizes: list[int], steps: list[float]) -> tuple[float, float]:
    """(B_noise, S_min) of S = S_min (1 + B_noise / B), least squares in log S: for each B_noise
    on a fine log grid, log S_min is the mean residual; the best B_noise wins."""
    best = (math.inf, 0.0, 0.0)
    for i in range(-200, 1001):
        b_noise = 10 ** (i / 200)  # 0.1 .. 10^5
        logs = [math.log(s) - math.log(1 + b_noise / b) for b, s in zip(sizes, steps)]
        log_min = sum(logs) / len(logs)
        error = sum((v - log_min) ** 2 for v in logs)
        if error < best[0]:
            best = (error, b_noise, math.exp(log_min))
    return best[1], best[2]


def mean_and_error(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], math.nan) if values else (math.nan, math.nan)
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


# ------------------------------------------------------------------------------- one task

def checkpoint(task: Task, data: TensorDataset) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The weights the comparison starts from: ``task.warmup`` steps from the initial weights
    (seed 0) at the base batch and the user's learning rate, with the optimizer's state there."""
    torch.manual_seed(0)
    model = task.model()
    optimizer = task.optimizer(model.parameters(), task.lr)
    x, y = data.tensors
    generator = torch.Generator().manual_seed(123)
    for _ in range(task.warmup):
        picked = torch.randint(len(x), (task.base,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        task.loss_fn(model(x[picked]), y[picked]).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def tracker_b_simple(task: Task, data: TensorDataset, runs: Runs) -> dict:
    """The tracker's B_simple over TRACKER_UPDATES updates from the checkpoint:
    accumulate(steps=4, noise=NoiseTracker(overhead_target=None)) on micro-batches of the base
    batch, at the user's learning rate (batch 4 x base)."""
    runs.restore()
    for group in runs.optimizer.param_groups:
        group["lr"] = task.lr
    tracker = bw.NoiseTracker(overhead_target=None)
    x, y = data.tensors
    generator = torch.Generator().manual_seed(7)
    with bw.accumulate(runs.optimizer, steps=TRACKER_STEPS, model=runs.model, noise=tracker):
        for _ in range(TRACKER_UPDATES * TRACKER_STEPS):
            picked = torch.randint(len(x), (task.base,), generator=generator)
            task.loss_fn(runs.model(x[picked]), y[picked]).backward()
            runs.optimizer.step()
            runs.optimizer.zero_grad()
    report = tracker.report
    runs.restore()
    if report.trace_cov is None or not report.grad_norm_sq:
        return {"b_simple": None, "error": None, "measurable": False}
    ratio = report.trace_cov / report.grad_norm_sq
    error = report.b_simple_error if report.measurable else abs(ratio) * math.sqrt(
        (report.trace_cov_error / report.trace_cov) ** 2
        + (report.grad_norm_sq_error / report.grad_norm_sq) ** 2)
    return {"b_simple": ratio, "error": error, "measurable": bool(report.measurable),
            "examples": TRACKER_UPDATES * TRACKER_STEPS * task.base}


def run_task(task: Task, seeds: int, quick: bool) -> dict:
    data = task.data()
    model, optimizer = checkpoint(task, data)
    runs = Runs(task, data, model, optimizer)

    # (a) critical_batch with its defaults, from the checkpoint
    started = time.perf_counter()
    report = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=task.loss_fn,
                               base_batch_size=task.base)
    critical_s = time.perf_counter() - started
    print(f"{task.name}: {report.summary()} in {critical_s:.1f} s", flush=True)
    target = report.target_loss
    ladder = [dataclasses.asdict(b) for b in report.ladder]

    # (b) the reference curves, from the same checkpoint to the same target
    started = time.perf_counter()
    runs.examples = runs.train_examples = 0
    runs.start = runs.loss()
    sizes = task.sizes[1::2] if quick else task.sizes
    task_for_curves = dataclasses.replace(task, sizes=sizes)
    runs.task = task_for_curves
    reference = curves(runs, target, seeds, task.lr) if math.isfinite(target) else {
        "steps": {}, "lr": {}, "edge": {}, "tried": {}}
    runs.task = task
    fitted = [b for b in sizes if b in reference["steps"]]
    per_seed = [fit_log(fitted, [reference["steps"][b][s] for b in fitted])
                for s in range(seeds)] if len(fitted) >= 2 else []
    pooled = fit_log(fitted, [statistics.fmean(reference["steps"][b]) for b in fitted]) if len(
        fitted) >= 2 else (math.nan, math.nan)
    curves_s = time.perf_counter() - started
    curve_examples, curve_train_examples = runs.examples, runs.train_examples
    b_noise = mean_and_error([f[0] for f in per_seed])
    print(f"{task.name}: fitted B_noise {b_noise[0]:.3g} ± {b_noise[1]:.2g} (pooled "
          f"{pooled[0]:.3g}) from {curve_examples} examples in {curves_s:.0f} s", flush=True)

    # (c) the tracker's B_simple from the checkpoint (measure_noise's: report.b_simple)
    started = time.perf_counter()
    tracker = tracker_b_simple(task, data, runs)
    tracker_s = time.perf_counter() - started
    return {
        "task": f"{task.name} @{task.warmup}", "describe": task.describe, "n_examples": len(data),
        "optimizer": type(optimizer).__name__, "user_lr": task.lr, "base_batch": task.base,
        "warmup_steps": task.warmup, "start_loss": report.start_loss, "target_loss": target,
        "critical_batch": report.critical_batch_size,
        "critical_batch_error": report.critical_batch_size_error,
        "critical_reason": report.reason, "critical_seeds_fitted": report.seeds_fitted,
        "critical_examples": report.examples, "critical_s": critical_s,
        "critical_examples_noise": report.examples_noise,
        "critical_examples_train": report.examples - report.examples_eval - report.examples_noise,
        "critical_s_min": report.s_min, "critical_ladder": ladder,
        "measure_noise_b_simple": report.b_simple,
        "measure_noise_b_simple_error": report.b_simple_error,
        "tracker_b_simple": tracker["b_simple"], "tracker_error": tracker["error"],
        "tracker_measurable": tracker["measurable"], "tracker_s": tracker_s,
        "batch_sizes": fitted, "steps": {b: reference["steps"][b] for b in fitted},
        "learning_rate": {b: reference["lr"][b] for b in fitted},
        "lr_edge": reference["edge"], "tried": reference["tried"],
        "b_noise_per_seed": [f[0] for f in per_seed], "s_min_per_seed": [f[1] for f in per_seed],
        "b_noise": b_noise, "b_noise_pooled": pooled[0], "s_min_pooled": pooled[1],
        "curve_examples": curve_examples, "curve_train_examples": curve_train_examples,
        "curves_s": curves_s,
    }


# ------------------------------------------------------------------------------- the results

def verdict(r: dict) -> tuple[str, float | None, float]:
    fit = r["b_noise"][0]
    measured = r["critical_batch"]
    ratio = measured / fit if measured and fit and math.isfinite(fit) else None
    spent = r["critical_examples"] / r["curve_examples"] if r["curve_examples"] else math.nan
    within = ratio is not None and 0.5 <= ratio <= 2
    cheap = spent <= 0.1
    text = ("meets both" if within and cheap else
            "within 2x, too costly" if within else
            "cheap, off by more than 2x" if cheap else "misses both")
    if ratio is None:
        text = "not measured: " + (r["critical_reason"] or "no fit").split(":")[0]
    return text, ratio, spent


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    columns = 2
    rows = math.ceil(len(results) / columns)
    figure = Figure(figsize=(5.5 * columns, 4.0 * rows))
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, r in zip(axes, results):
        sizes = r["batch_sizes"]
        if not sizes and not r["critical_ladder"]:  # nothing measured: say so, draw nothing
            ax.text(0.5, 0.5, f"{r['task']}: not measured\n{r['critical_reason'][:60]}",
                    ha="center", va="center", fontsize=8, transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for seed in range(len(r["b_noise_per_seed"])):
            ax.plot(sizes, [r["steps"][b][seed] for b in sizes], "o", color="tab:blue",
                    alpha=0.5, label="curves: steps to target (each seed)" if seed == 0 else None)
        if sizes and math.isfinite(r["b_noise_pooled"]):
            grid = [min(sizes) * 2 ** (i / 8) for i in range(8 * int(math.log2(
                max(sizes) / min(sizes))) + 1)]
            ax.plot(grid, [r["s_min_pooled"] * (1 + r["b_noise_pooled"] / b) for b in grid],
                    "-", color="tab:blue", label="fit S_min(1 + B_noise/B)")
        ladder = [b for b in r["critical_ladder"] if b["steps"] is not None]
        ax.plot([b["batch_size"] for b in ladder],
                [b.get("steps_to_target") or b["steps"] for b in ladder], "x",
                color="tab:red", label="critical_batch's branches")
        lines = [("B_noise (curves)", r["b_noise"][0], "tab:blue"),
                 ("critical_batch", r["critical_batch"], "tab:red"),
                 ("measure_noise B_simple", r["measure_noise_b_simple"], "tab:green"),
                 ("tracker B_simple", r["tracker_b_simple"], "tab:orange")]
        for label, value, color in lines:
            if value is not None and math.isfinite(value) and value > 0:
                ax.axvline(value, color=color, linestyle="--", label=f"{label} {value:.3g}")
        ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="steps to target",
               title=f"{r['task']}: loss {r['start_loss']:.3g} -> {r['target_loss']:.3g}")
        ax.legend(fontsize=7)
    for ax in axes[len(results):]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def number(value: float | None, error: float | None = None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if error is None or not math.isfinite(error):
        return f"{value:.3g}"
    return f"{value:.3g} ± {error:.2g}"


def train(r: dict) -> str:
    """The training examples alone (no evaluations, no measure_noise): critical_batch's against
    the curves', which evaluate far more densely to place each crossing."""
    ours, theirs = r.get("critical_examples_train"), r.get("curve_train_examples")
    if ours is None or not theirs:
        return "-"
    return f"{ours:,} / {theirs:,} ({ours / theirs:.3f})"


def write(results: list[dict], meta: dict) -> None:
    """The .json (with ``meta``: seeds, seconds, commit, date, device), .png and .md."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "critical_batch_cpu.json").write_text(json.dumps(
        {**meta, "results": results}, indent=1))
    seeds, elapsed = meta["seeds"], meta["seconds"]
    plot(results, RESULTS / "critical_batch_cpu.png")
    lines = [
        "# The measured critical batch against steps-to-target curves (CPU)",
        "",
        f"`python benchmarks/critical_batch.py`, commit {meta['commit']}, "
        f"{meta['date']}, {meta['device']}, "
        f"{seeds} seeds for the curves, {elapsed / 60:.1f} minutes in all.",
        "",
        "From one checkpoint per task (the weights and optimizer state after a warm-up at the "
        "base batch and the user's learning rate, from the initial weights of seed 0):",
        "",
        "- **critical_batch**: `bw.critical_batch(model, data, optimizer=optimizer, loss_fn=..., "
        "base_batch_size=base)`, everything else its defaults (ladder base x 1 .. 32, 64 base "
        "steps, the target 90% of the way to the loss the base batch reaches in them, 2 seeds, "
        "the optimizer's rule for the learning rate); its examples are `report.examples`: "
        "training and loss evaluations in its branches, and the 512 per-example gradients of "
        "its measure_noise.",
        "- **curves**: from the same checkpoint (weights and optimizer state) to the same "
        "`report.target_loss`, evaluated the same way (mean loss on the same "
        f"{EVAL_EXAMPLES} evenly spaced examples, at every step to 64 and then every step // 64; "
        "the steps interpolated between "
        "the last two evaluations where the loss crossed the target, as critical_batch counts "
        "them); the learning rate per batch "
        "size on the grid user lr x 2^k, the fewest mean steps over the seeds, searched up until "
        "a rate diverges (loss > 2x the start, any seed) or two rates in a row do not improve, "
        "and down while the lowest tried wins; runs capped at twice the best mean so far. "
        "B_noise: fit of S = S_min(1 + B_noise/B) in log S, one per seed (mean ± standard error "
        "over the seeds) and on the seeds' mean (pooled). Examples: every run of every rate and "
        "seed, training and evaluation.",
        "- **B_simple**: measure_noise's at the checkpoint (512 examples, the one "
        "critical_batch reports); the tracker's from "
        f"`accumulate(steps={TRACKER_STEPS}, noise=NoiseTracker(overhead_target=None))` on "
        f"micro-batches of the base batch for {TRACKER_UPDATES} updates from the checkpoint at "
        "the user's learning rate (the ratio of its moving averages, also where it does not call "
        "itself measurable).",
        "",
        "Goal (issue 27): the measured critical batch within 2x of the curves' B_noise, at a "
        "tenth of the curves' examples or less. The curves evaluate at every step to 64 (to "
        "place each crossing exactly), critical_batch at 4 per doubling of the steps from a "
        "quarter of the batch below's: most of either's examples are evaluations (forward "
        "passes only), so the training examples alone are compared too.",
        "",
        "| task | optimizer, lr, base | loss: start -> target | B_noise (curves, per seed) | "
        "pooled | critical_batch | measured / curves | measure_noise B_simple (/ curves) | "
        "tracker B_simple (/ curves) | examples: critical_batch / curves (ratio) | "
        "of them training: critical_batch / curves (ratio) | "
        "wall s: critical_batch / curves | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        text, ratio, spent = verdict(r)
        fit = r["b_noise"][0]

        def over(value: float | None, fit: float = fit) -> str:
            return f"{value / fit:.2g}" if value and math.isfinite(fit) else "-"

        lines.append(
            f"| {r['task']} | {r['optimizer']} {r['user_lr']:g}, {r['base_batch']} | "
            f"{r['start_loss']:.4g} -> {r['target_loss']:.4g} | {number(*r['b_noise'])} | "
            f"{number(r['b_noise_pooled'])} | "
            f"{number(r['critical_batch'], r['critical_batch_error'])} | "
            f"{f'{ratio:.2f}' if ratio is not None else '-'} | "
            f"{number(r['measure_noise_b_simple'], r['measure_noise_b_simple_error'])} "
            f"({over(r['measure_noise_b_simple'])}) | "
            f"{number(r['tracker_b_simple'], r['tracker_error'])}"
            f"{'' if r['tracker_measurable'] else ' (not measurable)'} "
            f"({over(r['tracker_b_simple'])}) | "
            f"{r['critical_examples']:,} / {r['curve_examples']:,} ({spent:.3f}) | "
            f"{train(r)} | "
            f"{r['critical_s']:.0f} / {r['curves_s']:.0f} | {text} |")
    lines += ["", "Tasks, checkpoints and the curves' steps to target (per seed) at the tuned "
              "learning rate (and the largest rate that did not diverge):", ""]
    for r in results:
        lines.append(
            f"- **{r['task']}** ({r['describe']}): checkpoint after {r['warmup_steps']} steps "
            f"at batch {r['base_batch']}, lr {r['user_lr']:g}. " + "; ".join(
                f"B={b}: [{', '.join(f'{v:.3g}' for v in r['steps'][b])}] "
                f"(lr {r['learning_rate'][b]:.3g}, edge {r['lr_edge'][b]:.3g})"
                for b in r["batch_sizes"]))
    lines += ["", "critical_batch's branches (batch: steps at lr, per seed; d = diverged, "
              "- = not reached):", ""]
    for r in results:
        cells: dict[int, list[str]] = {}
        for b in r["critical_ladder"]:
            steps = b.get("steps_to_target") or b["steps"]
            outcome = "d" if b["diverged"] else "-" if steps is None else f"{steps:.3g}"
            cells.setdefault(b["batch_size"], []).append(f"{outcome}@{b['lr']:.3g}")
        lines.append(f"- {r['task']}: " + "; ".join(
            f"{b}: {', '.join(v)}" for b, v in cells.items())
            + (f" (reason: {r['critical_reason']})" if r["critical_reason"] else ""))
    lines += ["", "![steps to target against the batch size](critical_batch_cpu.png)", ""]
    (RESULTS / "critical_batch_cpu.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 seeds, every other batch size, writes nothing: a try-out")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="*", help="names of the tasks to run (default: all)")
    parser.add_argument("--warmups", nargs="*", type=int, help="checkpoints to run (default: "
                        "all of WARMUPS)")
    parser.add_argument("--rewrite", action="store_true",
                        help="write the .md and .png again from the .json, without training")
    args = parser.parse_args()
    if args.rewrite:
        saved = json.loads((RESULTS / "critical_batch_cpu.json").read_text())
        for r in saved["results"]:  # JSON keeps the batch sizes of these maps as strings
            for key in ("steps", "learning_rate", "lr_edge"):
                r[key] = {int(b): v for b, v in r[key].items()}
        write(saved.pop("results"), saved)
        return
    torch.set_num_threads(1)
    meta = {"commit": commit(), "date": datetime.date.today().isoformat(),
            "device": device_name(torch.device("cpu"))}  # the code measured: at the start
    seeds = 2 if args.quick else args.seeds
    started = time.perf_counter()
    results = []
    for task in TASKS:
        if (args.tasks and task.name not in args.tasks) or (
                args.warmups and task.warmup not in args.warmups):
            continue
        results.append(run_task(task, seeds, args.quick))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k not in ("critical_ladder", "tried")}),
              flush=True)
        print(f"{r['task']}: {verdict(r)}", flush=True)
    if not args.quick:
        write(results, {**meta, "seeds": seeds, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
