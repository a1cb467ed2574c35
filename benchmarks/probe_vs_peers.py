"""batchwidgets' ``find_batch`` against Lightning's ``Tuner.scale_batch_size`` and Accelerate's
``find_executable_batch_size``, on the same models, training step and emulated device.

Usage:
    pip install -e ".[bench]"   # with the CPU build of torch already installed
    python benchmarks/probe_vs_peers.py            # writes benchmarks/results/probe_vs_peers_cpu.*
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import batchwidgets
from batchwidgets.demo import small_cnn, synthetic_images
from batchwidgets.engine._memory import BudgetExceededError, parse_bytes, track_tensor_memory

try:
    import accelerate
    import lightning
    from accelerate.utils import find_executable_batch_size
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.tuner import Tuner
except ImportError as err:
    raise ImportError("benchmarks/probe_vs_peers.py needs Lightning and Accelerate: "
                      "pip install 'batchwidgets[bench]'") from err

STEPS_PER_TRIAL = 2  # find_batch's default; used for the true maximum and Accelerate's function
WARMUP_BATCH_SIZE = 8  # one real step first, so Adam has state that must come back unchanged
ACCELERATE_STARTS = (4096, 8192)
RESULTS = Path(__file__).parent / "results"
BATCHWIDGETS = "batchwidgets find_batch"
LIGHTNING_BINSEARCH = "Lightning scale_batch_size (binsearch)"
DERIVED = ("largest_ran", "n_ooms", "n_steps", "samples", "wall_s", "cpu_s")  # Outcome properties


class TinyEncoder(nn.Module):
    """Transformer encoder classifier: 64 tokens of a 1000-word vocabulary -> 10 classes."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, heads: int = 4, layers: int = 2,
                 seq_len: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))


def synthetic_tokens(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (batch_size, 64)), torch.randint(0, 10, (batch_size,))


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    budget: str

    @property
    def budget_bytes(self) -> int:
        return parse_bytes(self.budget)


WORKLOADS = (
    Workload("demo CNN", small_cnn, synthetic_images, "256MiB"),
    Workload("transformer encoder", TinyEncoder, synthetic_tokens, "384MiB"),
)


@dataclass
class Trial:
    """One run of steps at one batch size; ``steps`` counts steps started, the failed one too."""

    batch_size: int
    steps: int = 0
    fits: bool = True


@dataclass
class Outcome:
    model: str
    tool: str
    found: int  # the size the tool hands back
    trials: list[Trial]
    times: list[tuple[float, float]]  # (wall s, CPU s of this process), one per timing round
    changed: list[str] = field(default_factory=list)  # parts of the state that did not come back

    @property
    def largest_ran(self) -> int:
        return max((t.batch_size for t in self.trials if t.fits), default=0)

    @property
    def n_ooms(self) -> int:
        return sum(not t.fits for t in self.trials)

    @property
    def n_steps(self) -> int:
        return sum(t.steps for t in self.trials)

    @property
    def samples(self) -> int:  # a failed step counts whole: work that no other load changes
        return sum(t.steps * t.batch_size for t in self.trials)

    @property
    def wall_s(self) -> float:
        return statistics.median(wall for wall, _ in self.times)

    @property
    def cpu_s(self) -> float:  # steadier than wall time when other jobs share the machine
        return statistics.median(cpu for _, cpu in self.times)


@contextmanager
def timed() -> Iterator[list[tuple[float, float]]]:
    """Yields a list that holds (wall seconds, CPU seconds) once the block ends."""
    clock: list[tuple[float, float]] = []
    wall, cpu = time.perf_counter(), time.process_time()
    yield clock
    clock.append((time.perf_counter() - wall, time.process_time() - cpu))


def fresh(work: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and Adam state for every tool: seeded, after one warm-up step."""
    torch.manual_seed(0)
    model = work.build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, optimizer, work.make_batch, WARMUP_BATCH_SIZE)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               make_batch: Callable[[int], tuple], batch_size: int) -> None:
    """The step every tool runs: forward, cross-entropy, backward, Adam step, zero_grad."""
    x, y = make_batch(batch_size)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy({
        "weights": list(model.parameters()), "buffers": list(model.buffers()),
        "gradients": [p.grad for p in model.parameters()],
        "optimizer state": optimizer.state_dict()["state"],
        "param_groups": optimizer.state_dict()["param_groups"]})


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def changed_parts(model: nn.Module, optimizer: torch.optim.Optimizer, before: dict) -> list[str]:
    after = snapshot(model, optimizer)
    return [part for part in before if not _same(before[part], after[part])]


# NOTE [ One emulated device for every tool ]
# batchwidgets' tensor tracker counts the storage bytes of live tensors op by op from a baseline
# (weights, buffers, gradients, Adam state; for Lightning also the batch, which its loader made
# before the step) and raises BudgetExceededError past the budget. find_batch uses it itself; the
# peers' steps run inside the same tracker, and the error becomes the RuntimeError both peers
# recognise (Lightning's is_out_of_cpu_memory, Accelerate's should_reduce_batch_size):
# "DefaultCPUAllocator: can't allocate memory", one argument. Neither matches BudgetExceededError's
# own "CPU out of memory" message.
@contextmanager
def emulated_device(budget_bytes: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trial: Trial, batch: object = ()) -> Iterator[None]:
    trial.steps += 1
    baseline = [*model.parameters(), *model.buffers(),
                *(p.grad for p in model.parameters() if p.grad is not None),
                *(dict(s) for s in optimizer.state.values()), batch]
    try:
        with track_tensor_memory(budget_bytes, baseline=baseline):
            yield
    except BudgetExceededError as error:
        trial.fits = False
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: {error}") from error


def true_maximum(work: Workload) -> tuple[int, list[Trial]]:
    """Double, bisect, then verify that the answer fits and the next size does not."""
    model, optimizer = fresh(work)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    trials: list[Trial] = []

    def fits(batch_size: int) -> bool:
        trials.append(trial := Trial(batch_size))
        try:
            for _ in range(STEPS_PER_TRIAL):
                with emulated_device(work.budget_bytes, model, optimizer, trial):
                    train_step(model, optimizer, work.make_batch, batch_size)
        except RuntimeError:
            if trial.fits:  # not the emulated out-of-memory error
                raise
        model.load_state_dict(weights)
        optimizer.load_state_dict(copy.deepcopy(state))
        optimizer.zero_grad(set_to_none=True)
        return trial.fits

    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0 or not fits(low) or fits(low + 1):
        raise RuntimeError(f"{work.name}: no reproducible boundary at {low}")
    return low, trials


def run_batchwidgets(work: Workload) -> Outcome:
    model, optimizer = fresh(work)
    before = snapshot(model, optimizer)
    trials: list[Trial] = []
    steps = [0]

    def make_batch(batch_size: int) -> tuple:
        steps[0] += 1  # one call per training step
        return work.make_batch(batch_size)

    def on_step(attempt: batchwidgets.Attempt) -> None:
        trials.append(Trial(attempt.batch_size, steps[0], attempt.fits))
        steps[0] = 0

    with timed() as clock:
        report = batchwidgets.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                                         optimizer=optimizer, budget=work.budget_bytes,
                                         on_step=on_step)
    return Outcome(work.name, BATCHWIDGETS, report.max_batch_size, trials, clock,
                   changed_parts(model, optimizer, before))


class _Batches(Dataset):
    """``make_batch(n)`` as a map-style dataset: one call per batch (``__getitems__``)."""

    def __init__(self, make_batch: Callable[[int], tuple]) -> None:
        self.make_batch = make_batch

    def __len__(self) -> int:
        return 2**16  # above Lightning's max_val (8192): its tuner stops at len(dataset)

    def __getitems__(self, indices: list[int]) -> tuple:
        return self.make_batch(len(indices))


class _LitClassifier(LightningModule):
    """The model as Lightning wants it; each step runs on the emulated device."""

    def __init__(self, work: Workload, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.work, self.net, self.adam = work, model, optimizer
        self.batch_size = 2
        self.trials: list[Trial] = []
        self._batch: tuple = ()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.work.make_batch), batch_size=self.batch_size,
                          collate_fn=lambda batch: batch)  # already one batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.adam

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_start(self) -> None:  # once per trial: the tuner runs the fit loop per size
        self.trials.append(Trial(self.batch_size))

    def on_train_batch_start(self, batch: tuple, batch_idx: int) -> None:
        self._batch = batch

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: object,
                       optimizer_closure: Callable | None = None) -> None:
        # The closure runs training_step, zero_grad and backward inside optimizer.step.
        with emulated_device(self.work.budget_bytes, self.net, self.adam, self.trials[-1],
                             self._batch):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


def run_lightning(work: Workload, mode: str) -> Outcome:
    model, optimizer = fresh(work)
    before = snapshot(model, optimizer)
    module = _LitClassifier(work, model, optimizer)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=root)
        with timed() as clock:
            found = Tuner(trainer).scale_batch_size(module, mode=mode)  # Lightning's defaults
    return Outcome(work.name, f"Lightning scale_batch_size ({mode})", found, module.trials,
                   clock, changed_parts(model, optimizer, before))


def run_accelerate(work: Workload, start: int) -> Outcome:
    model, optimizer = fresh(work)
    before = snapshot(model, optimizer)
    trials: list[Trial] = []

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size: int) -> int:
        trials.append(trial := Trial(batch_size))
        # Drop gradients a failed try left behind, as Accelerate's docs do with free_memory().
        optimizer.zero_grad(set_to_none=True)
        for _ in range(STEPS_PER_TRIAL):
            with emulated_device(work.budget_bytes, model, optimizer, trial):
                train_step(model, optimizer, work.make_batch, batch_size)
        return batch_size

    with timed() as clock:
        found = train()
    return Outcome(work.name, f"Accelerate find_executable_batch_size (start {start})", found,
                   trials, clock, changed_parts(model, optimizer, before))


def run_all(work: Workload, rounds: int) -> tuple[int, list[Trial], list[Outcome]]:
    truth, truth_trials = true_maximum(work)
    print(f"{work.name}: true maximum {truth} under {work.budget}", flush=True)
    outcomes = [run_batchwidgets(work), run_lightning(work, "power"),
                run_lightning(work, "binsearch")]
    outcomes += [run_accelerate(work, start) for start in ACCELERATE_STARTS]
    # The wall-time target compares these two: time them again, alternating, and keep medians.
    for _ in range(rounds - 1):
        for outcome, run in ((outcomes[0], run_batchwidgets),
                             (outcomes[2], functools.partial(run_lightning, mode="binsearch"))):
            again = run(work)
            if (again.found, again.trials) != (outcome.found, outcome.trials):
                raise RuntimeError(f"{outcome.tool} on {work.name} is not deterministic: "
                                   f"{_sizes(outcome.trials)} then {_sizes(again.trials)}")
            outcome.times += again.times
    for o in outcomes:
        print(f"  {o.tool}: {o.found} in {o.wall_s:.1f} s ({o.cpu_s:.1f} s CPU)", flush=True)
    return truth, truth_trials, outcomes


def _sizes(trials: list[Trial]) -> str:
    return ", ".join(f"{t.batch_size}" if t.fits else f"{t.batch_size}✗" for t in trials)


NOTES = (
    "Lightning zeroes gradients after training_step, before backward, so the last step's "
    "gradients are alive at the forward's peak: its step holds more than the common one "
    "(zero_grad last) and its largest size can sit below the true maximum; binsearch then "
    "hands back 95% of it (margin=0.05).",
    "Lightning restores weights, buffers and optimizer from a checkpoint, not .grad.",
    "Accelerate restores nothing: the decorated function is the training loop.",
    "True maximum: doubling from 1, bisection, then the answer and the next size re-run, each "
    "with the common step from the same restored state.",
)


def _targets(truths: dict[str, int], outcomes: list[Outcome]) -> list[str]:
    """Is batchwidgets exact, within 5 trials and 1 OOM, and 4x faster than Lightning binsearch?"""
    lines = []
    for w in WORKLOADS:
        mine = next(o for o in outcomes if (o.model, o.tool) == (w.name, BATCHWIDGETS))
        peer = next(o for o in outcomes if (o.model, o.tool) == (w.name, LIGHTNING_BINSEARCH))
        checks = {"exact": mine.found == truths[w.name], "trials <= 5": len(mine.trials) <= 5,
                  "OOMs <= 1": mine.n_ooms <= 1,
                  "wall <= 0.25 x Lightning binsearch": mine.wall_s <= 0.25 * peer.wall_s}
        lines.append(f"- targets, {w.name}: " + ", ".join(
            f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks.items()))
    return lines


def markdown(truths: dict[str, int], outcomes: list[Outcome], header: list[str]) -> str:
    lines = [*header, *_targets(truths, outcomes), "",
             "| model | tool | found | true max | found/true | largest size run | trials | OOMs "
             "| steps | samples | wall (s) | CPU (s) | weights, buffers, optimizer bit-identical "
             "| gradients as before |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for o in outcomes:
        truth = truths[o.model]
        kept = "no" if set(o.changed) - {"gradients"} else "yes"
        grads = "no" if "gradients" in o.changed else "yes"
        lines.append(f"| {o.model} | {o.tool} | {o.found} | {truth} | {o.found / truth:.3f} | "
                     f"{o.largest_ran} | {len(o.trials)} | {o.n_ooms} | {o.n_steps} | "
                     f"{o.samples} | {o.wall_s:.1f} | "
                     f"{o.cpu_s:.1f} | {kept} | {grads} |")
    lines += ["", "Sizes tried, in order (✗: out of memory):", ""]
    lines += [f"- {o.model}, {o.tool}: {_sizes(o.trials)}" for o in outcomes]
    lines += ["", "Notes:", "", *(f"- {note}" for note in NOTES)]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _commit() -> str:
    """The checkout's commit (``+`` if tracked files differ from it): the engine changes often."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty=+"], check=True,
                              cwd=Path(__file__).parent, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(outcomes: list[Outcome]) -> list[str]:
    runs = {(o.model, o.tool): o for o in outcomes}
    pairs = [(w.name, runs[w.name, BATCHWIDGETS], runs[w.name, LIGHTNING_BINSEARCH])
             for w in WORKLOADS]
    ratios = [f"{name} {a.wall_s / b.wall_s:.2f} (CPU time {a.cpu_s / b.cpu_s:.2f}, samples "
              f"{a.samples / b.samples:.2f})" for name, a, b in pairs]
    rounds = len(pairs[0][1].times)
    budgets = ", ".join(f"{w.name} {w.budget}" for w in WORKLOADS)
    return [
        "# find_batch vs Lightning and Accelerate on an emulated CPU device", "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()}-core CPU ({_cpu_name()}), torch threads "
        f"{torch.get_num_threads()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}, accelerate {accelerate.__version__}, batchwidgets "
        f"{batchwidgets.__version__} (commit {_commit()})",
        f"- budgets (live tensor bytes of a step, weights/grads/Adam state included): {budgets}",
        f"- wall time of batchwidgets / Lightning binsearch: {', '.join(ratios)} (target <= 0.25)",
        f"- times: batchwidgets and Lightning binsearch are medians of {rounds} alternating "
        f"rounds, the others one run; load average (1, 5, 15 min) at the end: "
        f"{', '.join(f'{load:.1f}' for load in os.getloadavg())}",
        f"- step: forward, cross-entropy, backward, Adam, zero_grad. Lightning with its defaults "
        f"(init_val 2, steps_per_trial 3, max_trials 25, binsearch margin 5%); Accelerate and "
        f"the true maximum with {STEPS_PER_TRIAL} steps per size; steps count the one that ran "
        f"out of memory; samples sum the batch sizes of all steps (load-independent work)",
        "- regenerate: `python benchmarks/probe_vs_peers.py`",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .md and .json")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds of batchwidgets and Lightning binsearch (median)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps times steady when other jobs share the CPU")
    args = parser.parse_args(argv)
    # With 2 threads on 2 busy cores, OpenMP's spin-waiting swings times (CPU time too) 5-10x.
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    truths, records, outcomes = {}, [], []
    for work in WORKLOADS:
        truth, truth_trials, found = run_all(work, args.rounds)
        truths[work.name] = truth
        outcomes += found
        records.append({"model": work.name, "budget": work.budget,
                        "budget_bytes": work.budget_bytes, "true_max": truth,
                        "true_max_trials": [asdict(t) for t in truth_trials]})
    lines = header(outcomes)
    table = markdown(truths, outcomes, lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_vs_peers_cpu.md").write_text(table)
    runs = [{**asdict(o), "true_max": truths[o.model], "n_trials": len(o.trials),
             **{key: getattr(o, key) for key in DERIVED}} for o in outcomes]
    document = {"header": lines, "notes": NOTES, "workloads": records, "runs": runs}
    (args.out / "probe_vs_peers_cpu.json").write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
