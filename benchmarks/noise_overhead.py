"""Overhead of ``bw.NoiseTracker`` per training step against the same loop without it.

What the tracker adds (see NOTE [ What the noise tracker costs accumulate ] in
``batchwidgets/engine/accumulate.py``): under ``accumulate(optimizer, steps=k, model=model,
noise=tracker)``, by default a gradient hook per parameter computing one reduction of each
micro-batch gradient (the tighter estimate from all k micro-batch norms), one fused
``torch._foreach_norm`` for |G_big|^2, and a few small ops that stack the update's k losses and
squared norms into one device tensor. No host sync per update: the tracker reads what it holds
in one ``.tolist()`` when its report is read, at the end of the block, every 16 updates (or
second) with a listener, and every 256 without. ``NoiseTracker(every_micro_batch=False)`` drops
the hooks: one fused norm of ``.grad`` after the first micro-step (the first micro-batch's
gradient: the prefix-sum estimator) instead, cheaper but noisier.
In a plain loop ``observe_loss(loss)`` costs one ``float(loss)``: a host sync per step.

Compared, on the same micro-batches, model and AdamW optimizer:
  (a) ``accumulate(steps=4, model=model)``, the baseline of (b), (c) and (e);
  (b) the same with ``noise=NoiseTracker()`` (the issue's target: at most 2% over (a));
  (c) the same with ``track_grad_norms=True`` (the per-parameter hooks alone, for context);
  (e) the same with ``noise=NoiseTracker(every_micro_batch=False)`` (no hooks, noisier);
  (d) a plain loop (no accumulation) calling ``tracker.observe_loss(loss)`` every step, against
      the same plain loop without it.
All six run once per round, in an order rotated every round, so drift of a shared machine hits
them alike; each overhead is the median of the per-round time ratios, with its quartiles (the
spread is the measurement's own noise). Three models: the demo CNN, an MLP and a small
transformer encoder whose step is cheap and whose parameters are many small tensors (the worst
case for a per-parameter, per-micro-step cost).

Since issue 16 the tracker samples updates by default (``NoiseTracker(overhead_target=0.02)``:
1 update in k measured, k from its measured cost; NOTE [ Sampling updates to keep the tracker
cheap ]); (b) keeps every update (``overhead_target=None``) and (f) is the default, one tracker
kept across the passes so that its sampling settles. ``--realistic`` times steps of 20-200 ms
instead: a small ResNet-like CNN and a small GPT (results/noise_overhead_realistic_<device>.md).

Usage:
    python benchmarks/noise_overhead.py                # -> results/noise_overhead_cpu.{md,json}
    python benchmarks/noise_overhead.py --realistic --rounds 9 --repeat 1
    python benchmarks/noise_overhead.py --device cuda  # -> results/noise_overhead_cuda.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _machine import commit, device_name
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.demo import small_cnn, synthetic_images
from batchwidgets.engine.noise._estimate import (
    first_sq_norm,
    grad_norms,
    grad_sq_norm,
    group_by_device_and_dtype,
)
from batchwidgets.engine.noise._schedule import CALIBRATION

RESULTS = Path(__file__).parent / "results"
STEPS = 4  # micro-steps per update
TARGET = 0.02  # the target for (b) over (a)
Batch = tuple[torch.Tensor, torch.Tensor]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 10))


class TinyEncoder(nn.Module):
    """Two-layer transformer encoder on 32 tokens: 30 parameter tensors, a cheap step."""

    def __init__(self, vocab: int = 1000, d_model: int = 64, seq_len: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=4 * d_model,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))


def synthetic_tokens(batch_size: int) -> Batch:
    return torch.randint(0, 1000, (batch_size, 32)), torch.randint(0, 10, (batch_size,))


class Block(nn.Module):
    """A ResNet basic block (He et al. 2016): two 3x3 convolutions with BatchNorm, a shortcut."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False), nn.BatchNorm2d(channels),
            nn.ReLU(), nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels))
        self.shortcut = (nn.Identity() if stride == 1 and channels_in == channels else
                         nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False),
                                       nn.BatchNorm2d(channels)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def small_resnet() -> nn.Module:
    """A ResNet-10-like CNN for 32x32 images: 4 stages of one basic block, 32..256 channels."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2), Block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


class SmallGPT(nn.Module):
    """A GPT-like decoder (pre-norm, causal self-attention): 4 layers of 128, 128 tokens;
    returns the next-token logits of every position, flattened for cross_entropy."""

    def __init__(self, vocab: int = 2000, d_model: int = 128, seq_len: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embed(tokens) + self.position, mask=self.mask, is_causal=True)
        return self.head(hidden).flatten(0, 1)


def synthetic_text(batch_size: int) -> Batch:
    tokens = torch.randint(0, 2000, (batch_size, 129))
    return tokens[:, :-1], tokens[:, 1:].flatten()


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Batch]
    micro: int  # micro-batch size on the CPU
    micro_cuda: int  # on a GPU: larger, or the step is nothing but kernel launches
    n_micro: int = 2 * STEPS  # micro-steps per timed run: two updates
    realistic: bool = False  # a 20-200 ms step: timed with --realistic only


WORKLOADS = (
    Workload("demo CNN", small_cnn, synthetic_images, 16, 256),
    Workload("MLP 3072-512-10", mlp, synthetic_images, 64, 256),
    Workload("transformer encoder 2x64, 32 tokens", TinyEncoder, synthetic_tokens, 8, 64),
    Workload("ResNet-10-like CNN, 32x32", small_resnet, synthetic_images, 8, 256,
             realistic=True),
    Workload("small GPT 4x128, 128 tokens", SmallGPT, synthetic_text, 2, 64, realistic=True),
)


# ---- the loops ---------------------------------------------------------------------------------
def plain(model, optimizer, data, observe=None):
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if observe is not None:
            observe(loss)


def accumulated(model, optimizer, data, **options):
    with bw.accumulate(optimizer, steps=STEPS, model=model, **options):
        plain(model, optimizer, data)


CONTENDERS: dict[str, Callable] = {
    "accumulate": accumulated,
    "accumulate + NoiseTracker": lambda m, o, d: accumulated(
        m, o, d, noise=bw.NoiseTracker(overhead_target=None)),
    "accumulate + track_grad_norms": lambda m, o, d: accumulated(m, o, d, track_grad_norms=True),
    "accumulate + NoiseTracker(every_micro_batch=False)": lambda m, o, d: accumulated(
        m, o, d, noise=bw.NoiseTracker(every_micro_batch=False, overhead_target=None)),
    "plain": plain,
    "plain + observe_loss": lambda m, o, d: plain(m, o, d, observe=bw.NoiseTracker().observe_loss),
}
CHEAP = "accumulate + NoiseTracker(every_micro_batch=False)"
SAMPLED = "accumulate + NoiseTracker() (default: sampled)"  # one tracker per model, see measure
COMPARISONS = (  # (name, contender, baseline)
    ("(b) NoiseTracker under accumulate, every update", "accumulate + NoiseTracker",
     "accumulate"),
    ("(f) NoiseTracker() default: sampled under 2%", SAMPLED, "accumulate"),
    ("(c) track_grad_norms alone", "accumulate + track_grad_norms", "accumulate"),
    ("(e) NoiseTracker(every_micro_batch=False), no hooks", CHEAP, "accumulate"),
    ("(d) observe_loss per step, plain loop", "plain + observe_loss", "plain"),
)


def timed(fn: Callable, *args: object, device: torch.device) -> float:
    """Process CPU time on the CPU (less disturbed by other jobs than wall time); on a GPU, wall
    time between two synchronisations, so queued kernels are counted and nothing else is."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize(device)
    started = clock()
    fn(*args)
    if cuda:
        torch.cuda.synchronize(device)
    return clock() - started


def tracker_reductions(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                       losses: list[torch.Tensor]) -> None:
    """The tracker's device work for one update, alone, as accumulate does it: the fused norms
    of the gradient after the first micro-step, its square, |G_big|^2 and the one tensor handed
    to the tracker (its host sync comes once per 256 updates without a listener)."""
    groups = group_by_device_and_dtype(params)
    with torch.no_grad():
        first = first_sq_norm(grad_norms(groups), None)
        big = grad_sq_norm(params, None, optimizer, groups)
        torch.stack([*losses, first, big])


def reductions_alone_s(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Batch],
                       device: torch.device, rounds: int, repeat: int = 20) -> float:
    """Median time of ``tracker_reductions`` over this model's gradients, per update: the
    tracker's cost without the noise of a whole training loop."""
    optimizer.zero_grad()
    x, y = data[0]
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    losses = [loss.detach()] * STEPS
    samples = [timed(lambda: [tracker_reductions(params, optimizer, losses)
                              for _ in range(repeat)], device=device) / repeat
               for _ in range(rounds)]
    optimizer.zero_grad()
    return statistics.median(samples)


def measure(work: Workload, device: torch.device, rounds: int, repeat: int) -> list[dict]:
    torch.manual_seed(0)
    model = work.build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro = work.micro_cuda if device.type == "cuda" else work.micro
    data = [tuple(t.to(device) for t in work.make_batch(micro)) for _ in range(work.n_micro)]
    sampled = bw.NoiseTracker()  # kept across passes, so that its sampling settles
    contenders = {**CONTENDERS, SAMPLED: lambda m, o, d: accumulated(m, o, d, noise=sampled)}
    names = list(contenders)
    for name in names:  # warm-up every path (allocator, kernels, AdamW state)
        contenders[name](model, optimizer, data)
    for _ in range(CALIBRATION // 2 + 2):  # the sampled tracker's calibration (2 updates each)
        contenders[SAMPLED](model, optimizer, data)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        # `repeat` passes in an order rotated every pass, so every loop takes every place
        # equally often; a loop's time in the round is its fastest pass (a pass that another
        # job slowed down tells nothing about the loop)
        passes: dict[str, list[float]] = {name: [] for name in names}
        for i in range(r * repeat, (r + 1) * repeat):
            for name in names[i % len(names):] + names[:i % len(names)]:
                passes[name].append(timed(contenders[name], model, optimizer, data,
                                          device=device))
        for name in names:
            times[name].append(min(passes[name]))
    alone = reductions_alone_s(model, optimizer, data, device, rounds)
    settled = sampled.report
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for label, name, base in COMPARISONS:
        ratios = [a / b for a, b in zip(times[name], times[base])]
        quartiles = statistics.quantiles(ratios, n=4)
        rows.append({
            "model": work.name, "comparison": label, "contender": name, "baseline": base,
            "micro_batch": micro, "steps": STEPS if base == "accumulate" else 1,
            "micro_steps": work.n_micro, "rounds": rounds,
            "parameter_tensors": len(list(model.parameters())), "parameters": n_params,
            "baseline_ms_per_micro_step": 1e3 * statistics.median(times[base]) / work.n_micro,
            "added_ms_per_micro_step":
                1e3 * statistics.median(a - b for a, b in zip(times[name], times[base]))
                / work.n_micro,
            "overhead": statistics.median(ratios) - 1,
            "overhead_q1": quartiles[0] - 1, "overhead_q3": quartiles[2] - 1,
            "reductions_alone_ms_per_micro_step":
                1e3 * alone / STEPS if name == CHEAP else None,
            "sample_every": settled.sample_every if name == SAMPLED else None,
            "tracker_overhead_estimate": settled.overhead if name == SAMPLED else None,
            "repeat": repeat})
    return rows


# NOTE [ Page faults on the CPU ]
# glibc serves large buffers (the MLP's 6 MB gradients) with mmap and unmaps them on free, with
# thresholds that adapt at run time: each step then zero-fills fresh pages (10-20% of the CPU time
# went to the kernel), and whichever loop happens to move the thresholds runs 10% faster or
# slower, so the MLP's overhead swung from -10% to +11% between runs. Fixed thresholds keep freed
# memory in the heap: kernel time fell 25x and the MLP's quartiles narrowed from about +-8% to
# +-1.5%. Both loops get the same allocator, so this removes noise, not cost.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def _restart_with_steady_malloc() -> None:
    """Run this script again with MALLOC_ENV (glibc reads it at start-up only)."""
    if platform.system() == "Linux" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def markdown(rows: list[dict], device: torch.device, rounds: int, repeat: int) -> str:
    cuda = device.type == "cuda"
    lines = [
        "# NoiseTracker overhead per training step",
        "",
        f"{datetime.date.today()}, device: {device_name(device)}, torch {torch.__version__}, "
        f"batchwidgets {bw.__version__} (commit {commit()}), AdamW, "
        f"{'wall time between synchronisations' if cuda else 'process CPU time'}, median of "
        f"{rounds} rounds, each loop's time in a round the fastest of {repeat} passes, the "
        f"six loops in an order rotated every pass. Target: (b) at most {TARGET:.0%} over (a)."
        + ("" if cuda else " glibc malloc thresholds fixed: " + ", ".join(
            f"{k}={os.environ.get(k, 'unset')}" for k in MALLOC_ENV) + "."),
        "",
        "What the tracker adds (b, the default): a gradient hook per parameter, one reduction "
        "each per micro-step (every micro-batch's norm), one fused norm (torch._foreach_norm) "
        "for |G_big|^2, a few small ops that stack the update's losses and squared norms into "
        "one device tensor, and no host sync per update (one .tolist() per 256 updates without "
        "a listener, per 16 with one). (c): the hooks alone. (e) NoiseTracker("
        "every_micro_batch=False): no hooks, one fused norm of the gradients after the first "
        "micro-step (the prefix-sum estimator: cheaper, noisier). observe_loss in a plain loop "
        "is one float(loss) per step: a host sync per step. 'Reductions alone' times (e)'s "
        "device work "
        "by itself, repeated on the model's gradients: far less noisy than a whole loop, and on "
        "the CPU close to a floor of (b)'s cost (the gradients sit in cache); on a GPU it is all "
        "kernel launches with no step to overlap with, so (b) can cost less."
        + ("" if cuda else " This CPU is shared with other jobs (2 cores): expect run-to-run "
           "drift of a percent or two; the quartiles show each run's own noise."),
        "",
        "| model | comparison | micro-batch | steps | parameter tensors | ms per micro-step "
        "(baseline) | added ms per micro-step | overhead (median) | quartiles | reductions "
        "alone: ms per micro-step (share of baseline) |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    lines += [f"| {r['model']} | {r['comparison']} | {r['micro_batch']} | {r['steps']} | "
              f"{r['parameter_tensors']} | {r['baseline_ms_per_micro_step']:.2f} | "
              f"{r['added_ms_per_micro_step']:+.3f} | {r['overhead']:+.2%} | "
              f"{r['overhead_q1']:+.2%} .. {r['overhead_q3']:+.2%} | {_alone(r)} |"
              for r in rows]
    verdicts = [f"{r['model']} {r['overhead']:+.2%} "
                f"({'met' if r['overhead'] <= TARGET else 'MISSED'})"
                for r in rows if r["contender"] == "accumulate + NoiseTracker"]
    sampled = [f"{r['model']} {r['overhead']:+.2%}, 1 update in {r['sample_every']} measured, "
               f"the tracker's own estimate of its share "
               f"{100 * (r['tracker_overhead_estimate'] or 0):.2g}% "
               f"({'met' if r['overhead'] <= TARGET else 'MISSED'})"
               for r in rows if r["contender"] == SAMPLED]
    cheap = [f"{r['model']} {r['overhead']:+.2%} "
             f"({'met' if r['overhead'] <= TARGET else 'MISSED'})"
             for r in rows if r["contender"] == CHEAP]
    lines += ["", f"Target (b) <= {TARGET:.0%}: " + ", ".join(verdicts) + ".",
              "(f), the default since issue 16: " + "; ".join(sampled) + ".",
              "The same target for (e): " + ", ".join(cheap) + ".", ""]
    return "\n".join(lines)


def _alone(row: dict) -> str:
    alone = row["reductions_alone_ms_per_micro_step"]
    if alone is None:
        return ""
    return f"{alone:.3f} ({alone / row['baseline_ms_per_micro_step']:.2%})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--repeat", type=int, default=3,
                        help="passes per round; a loop's time in the round is its fastest")
    parser.add_argument("--models", default="",
                        help="only the models whose name contains this text")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 keeps CPU times steadier on a shared machine")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .md and .json")
    parser.add_argument("--realistic", action="store_true",
                        help="time the 20-200 ms steps (ResNet-like CNN, small GPT) instead")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        if argv is None:  # run from the command line: see NOTE [ Page faults on the CPU ]
            _restart_with_steady_malloc()
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*BatchNorm.*")  # the demo CNN's, once per block
    rows = []
    for work in WORKLOADS:
        if args.models in work.name and work.realistic == args.realistic:
            rows += measure(work, device, args.rounds, args.repeat)
            print(f"{work.name}: done", flush=True)
    text = markdown(rows, device, args.rounds, args.repeat)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "noise_overhead_realistic" if args.realistic else "noise_overhead"
    stem = args.out / f"{kind}_{device.type}"
    stem.with_suffix(".md").write_text(text)
    document = {"device": device_name(device), "torch": torch.__version__,
                "batchwidgets": bw.__version__, "commit": commit(),
                "date": datetime.date.today().isoformat(), "rounds": args.rounds,
                "repeat": args.repeat, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
