"""batchwidgets' ``find_batch`` against Lightning's ``Tuner.scale_batch_size`` and Accelerate's
``find_executable_batch_size``, on the same models, training step and emulated device.

On the CPU the device is emulated (see NOTE [ One emulated device for every tool ]); with
``--device cuda`` every tool meets real CUDA out-of-memory errors under the same process cap (see
NOTE [ One capped GPU for every tool ]).

Usage:
    pip install -e ".[bench]"   # with the CPU build of torch already installed
    python benchmarks/probe_vs_peers.py            # writes benchmarks/results/probe_vs_peers_cpu.*
    python benchmarks/probe_vs_peers.py --device cuda --budget 8GiB   # ..._cuda.*
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _machine import commit
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import batchwidgets
from batchwidgets.demo import small_cnn, synthetic_images
from batchwidgets.engine.memory import BudgetExceededError, is_oom, parse_bytes, track_tensor_memory

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
CUDA_BUDGET = "8GiB"
RESULTS = Path(__file__).parent / "results"
BATCHWIDGETS = "batchwidgets find_batch"
BATCHWIDGETS_STEP = "batchwidgets find_batch(step)"
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


class BertLM(nn.Module):
    """A masked-language-model BERT with BERT's 30,522-word vocabulary, built from a config (no
    download), 2 layers of width 128: its vocabulary head and embedding gradient are a large
    constant phase that hides the per-sample growth at small sizes. Returns logits as
    (batch, vocabulary, tokens), so the common step's cross_entropy(model(x), y) is its loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM
        self.bert = BertForMaskedLM(BertConfig(
            vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=256, max_position_embeddings=64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=tokens).logits.transpose(1, 2)


def bert_tokens(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 30522, (batch_size, 32))
    return tokens, tokens


def wide_cnn() -> nn.Module:
    """The demo CNN twice as wide, for 3x64x64 images: about 13 MB of activations per sample,
    so that 8 GiB hold a few hundred (the CUDA workload)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(256, 10),
    )


def cuda_images(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Made on the GPU: a host-to-device copy per step would only add time to every tool."""
    return (torch.randn(batch_size, 3, 64, 64, device="cuda"),
            torch.randint(0, 10, (batch_size,), device="cuda"))


def long_encoder() -> nn.Module:
    return TinyEncoder(d_model=128, heads=4, layers=4, seq_len=256)


def cuda_tokens(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 1000, (batch_size, 256), device="cuda"),
            torch.randint(0, 10, (batch_size,), device="cuda"))


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    budget: str
    device: str = "cpu"

    @property
    def budget_bytes(self) -> int:
        return parse_bytes(self.budget)


WORKLOADS = (
    Workload("demo CNN", small_cnn, synthetic_images, "256MiB"),
    Workload("transformer encoder", TinyEncoder, synthetic_tokens, "384MiB"),
    Workload("BERT, 30k vocabulary", BertLM, bert_tokens, "512MiB"),
)


def cuda_workloads(budget: str) -> tuple[Workload, ...]:
    return (Workload("wide CNN, 64x64 images", wide_cnn, cuda_images, budget, "cuda"),
            Workload("transformer encoder, 4x128, 256 tokens", long_encoder, cuda_tokens,
                     budget, "cuda"))


@dataclass
class Trial:
    """One run of steps at one batch size; ``steps`` counts steps started, the failed one too."""

    batch_size: int
    steps: int = 0
    fits: bool = True
    fake: bool = False  # traced on fake tensors (find_batch's free first search): nothing ran


@dataclass
class Outcome:
    model: str
    tool: str
    found: int  # the size the tool hands back
    trials: list[Trial]
    times: list[tuple[float, float]]  # (wall s, CPU s of this process), one per timing round
    changed: list[str] = field(default_factory=list)  # parts of the state that did not come back

    @property
    def real(self) -> list[Trial]:
        """The sizes that really ran (a fake trace runs nothing: no trial, step or sample)."""
        return [t for t in self.trials if not t.fake]

    @property
    def largest_ran(self) -> int:
        return max((t.batch_size for t in self.real if t.fits), default=0)

    @property
    def n_ooms(self) -> int:
        return sum(not t.fits for t in self.real)

    @property
    def n_steps(self) -> int:
        return sum(t.steps for t in self.real)

    @property
    def samples(self) -> int:  # a failed step counts whole: work that no other load changes
        return sum(t.steps * t.batch_size for t in self.real)

    @property
    def wall_s(self) -> float:
        return statistics.median(wall for wall, _ in self.times)

    @property
    def cpu_s(self) -> float:  # steadier than wall time when other jobs share the machine
        return statistics.median(cpu for _, cpu in self.times)


@contextmanager
def timed(device: str = "cpu") -> Iterator[list[tuple[float, float]]]:
    """Yields a list that holds (wall seconds, CPU seconds) once the block ends; on a GPU the
    clocks are read after synchronising, so queued kernels count."""
    clock: list[tuple[float, float]] = []
    if device == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    yield clock
    if device == "cuda":
        torch.cuda.synchronize()
    clock.append((time.perf_counter() - wall, time.process_time() - cpu))


def fresh(work: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and Adam state for every tool: seeded, after one warm-up step."""
    torch.manual_seed(0)
    model = work.build().to(work.device)
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


def _host_copy(value: object) -> object:
    """A copy in host memory: on a GPU, copies kept for checking must not count against the cap."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(item) for item in value)
    return copy.deepcopy(value)


def keep(value: object, work: Workload) -> object:
    return _host_copy(value) if work.device == "cuda" else copy.deepcopy(value)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    state = {
        "weights": list(model.parameters()), "buffers": list(model.buffers()),
        "gradients": [p.grad for p in model.parameters()],
        "optimizer state": optimizer.state_dict()["state"],
        "param_groups": optimizer.state_dict()["param_groups"]}
    on_gpu = any(p.is_cuda for p in model.parameters())
    return _host_copy(state) if on_gpu else copy.deepcopy(state)


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


# NOTE [ One capped GPU for every tool ]
# With --device cuda each tool, and the true maximum, runs inside capped_gpu: the cache is emptied,
# then torch.cuda.set_per_process_memory_fraction(budget / total) caps what the caching allocator
# may reserve for the whole process (weights, Adam state, activations, cuDNN and cuBLAS
# workspaces), and the allocator's own torch.OutOfMemoryError ("CUDA out of memory.") is what
# every tool sees and recognises. batchwidgets also gets budget=, with which it sets the same cap
# itself (and puts ours back). Copies kept for checking live in host memory (keep, snapshot).
@contextmanager
def capped_gpu(work: Workload) -> Iterator[None]:
    if work.device != "cuda":
        yield
        return
    device = torch.cuda.current_device()
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(device) if getter is not None else 1.0
    total = torch.cuda.get_device_properties(device).total_memory
    release_gpu()
    torch.cuda.set_per_process_memory_fraction(min(1.0, work.budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)
        release_gpu()


def release_gpu() -> None:
    """Free what the last size or tool left in the caching allocator (an OOM's frames are gone)."""
    gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def real_gpu(trial: Trial) -> Iterator[None]:
    """One step on the capped GPU: an out-of-memory error (the allocator's, or cuDNN's and
    cuBLAS's allocation failures, which the peers also count) marks the trial and goes on
    unchanged."""
    trial.steps += 1
    try:
        yield
    except RuntimeError as error:
        if is_oom(error):
            trial.fits = False
        raise


def on_device(work: Workload, model: nn.Module, optimizer: torch.optim.Optimizer, trial: Trial,
              batch: object = ()) -> AbstractContextManager[None]:
    if work.device == "cuda":
        return real_gpu(trial)
    return emulated_device(work.budget_bytes, model, optimizer, trial, batch)


def true_maximum(work: Workload) -> tuple[int, list[Trial]]:
    """Double, bisect, then verify that the answer fits and the next size does not. On a GPU
    every size starts from an empty cache, and a boundary that does not reproduce is kept with a
    warning (the caching allocator's state can tip a size at the edge) rather than raised."""
    model, optimizer = fresh(work)
    weights, state = keep(model.state_dict(), work), keep(optimizer.state_dict(), work)
    trials: list[Trial] = []

    def fits(batch_size: int) -> bool:
        trials.append(trial := Trial(batch_size))
        try:
            for _ in range(STEPS_PER_TRIAL):
                with on_device(work, model, optimizer, trial):
                    train_step(model, optimizer, work.make_batch, batch_size)
        except RuntimeError:
            if trial.fits:  # not the (emulated) out-of-memory error
                raise
        model.load_state_dict(weights)
        optimizer.load_state_dict(copy.deepcopy(state))
        optimizer.zero_grad(set_to_none=True)
        if work.device == "cuda":
            release_gpu()
        return trial.fits

    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0 or not fits(low) or fits(low + 1):
        if work.device != "cuda" or low == 0:
            raise RuntimeError(f"{work.name}: no reproducible boundary at {low}")
        warnings.warn(f"{work.name}: the boundary at {low} did not reproduce: "
                      f"{_sizes(trials[-2:])}", stacklevel=2)
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
        trials.append(Trial(attempt.batch_size, steps[0], attempt.fits, attempt.fake))
        steps[0] = 0

    with timed(work.device) as clock:
        report = batchwidgets.find_batch(model, make_batch, loss_fn=F.cross_entropy,
                                         optimizer=optimizer,
                                         device=work.device if work.device != "cpu" else None,
                                         budget=work.budget_bytes, on_step=on_step)
    return Outcome(work.name, BATCHWIDGETS, report.max_batch_size, trials, clock,
                   changed_parts(model, optimizer, before))


def run_batchwidgets_step(work: Workload) -> Outcome:
    """The bare form: find_batch(step) with the user's own step, optimizer= to restore it."""
    model, optimizer = fresh(work)
    before = snapshot(model, optimizer)
    trials: list[Trial] = []
    steps = [0]

    def step(batch_size: int) -> None:
        steps[0] += 1
        model.train()
        train_step(model, optimizer, work.make_batch, batch_size)

    def on_step(attempt: batchwidgets.Attempt) -> None:
        trials.append(Trial(attempt.batch_size, steps[0], attempt.fits, attempt.fake))
        steps[0] = 0

    with timed(work.device) as clock:
        report = batchwidgets.find_batch(step, optimizer=optimizer, device=work.device,
                                         budget=work.budget_bytes, on_step=on_step)
    model.train()
    return Outcome(work.name, BATCHWIDGETS_STEP, report.max_batch_size, trials, clock,
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
        with on_device(self.work, self.net, self.adam, self.trials[-1], self._batch):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


def run_lightning(work: Workload, mode: str) -> Outcome:
    model, optimizer = fresh(work)
    before = snapshot(model, optimizer)
    module = _LitClassifier(work, model, optimizer)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(accelerator=work.device, devices=1, max_epochs=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=root)
        with timed(work.device) as clock:
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
            with on_device(work, model, optimizer, trial):
                train_step(model, optimizer, work.make_batch, batch_size)
        return batch_size

    with timed(work.device) as clock:
        found = train()
    return Outcome(work.name, f"Accelerate find_executable_batch_size (start {start})", found,
                   trials, clock, changed_parts(model, optimizer, before))


def capped(run: Callable[..., Outcome], work: Workload, *args: object) -> Outcome:
    """One tool's run on its own capped GPU (on the CPU, just the run)."""
    with capped_gpu(work):
        return run(work, *args)


def run_all(work: Workload, rounds: int, accelerate_starts: tuple[int, ...] = ACCELERATE_STARTS,
            ) -> tuple[int, list[Trial], list[Outcome]]:
    with capped_gpu(work):
        truth, truth_trials = true_maximum(work)
    print(f"{work.name}: true maximum {truth} under {work.budget}", flush=True)
    outcomes = [capped(run_batchwidgets, work), capped(run_lightning, work, "power"),
                capped(run_lightning, work, "binsearch"), capped(run_batchwidgets_step, work)]
    outcomes += [capped(run_accelerate, work, start) for start in accelerate_starts]
    # The wall-time target compares these two: time them again, alternating, and keep medians.
    for _ in range(rounds - 1):
        for outcome, run in ((outcomes[0], run_batchwidgets),
                             (outcomes[2], functools.partial(run_lightning, mode="binsearch")),
                             (outcomes[3], run_batchwidgets_step)):
            again = capped(run, work)
            if (again.found, again.trials) != (outcome.found, outcome.trials):
                message = (f"{outcome.tool} on {work.name} is not deterministic: "
                           f"{_sizes(outcome.trials)} then {_sizes(again.trials)}")
                if work.device != "cuda":
                    raise RuntimeError(message)
                warnings.warn(message, stacklevel=2)  # the first run's sizes stay in the table
            outcome.times += again.times
    for o in outcomes:
        print(f"  {o.tool}: {o.found} in {o.wall_s:.1f} s ({o.cpu_s:.1f} s CPU)", flush=True)
    return truth, truth_trials, outcomes


def _sizes(trials: list[Trial]) -> str:
    return ", ".join(f"{t.batch_size}{'ᶠ' if t.fake else ''}{'' if t.fits else '✗'}"
                     for t in trials)


NOTES = (
    "Lightning zeroes gradients after training_step, before backward, so the last step's "
    "gradients are alive at the forward's peak: its step holds more than the common one "
    "(zero_grad last) and its largest size can sit below the true maximum; binsearch then "
    "hands back 95% of it (margin=0.05).",
    "Lightning restores weights, buffers and optimizer from a checkpoint, not .grad.",
    "Accelerate restores nothing: the decorated function is the training loop.",
    "True maximum: doubling from 1, bisection, then the answer and the next size re-run, each "
    "with the common step from the same restored state.",
    "batchwidgets find_batch(step) is given only optimizer=, as a bare step is: it restores and "
    "counts the optimizer's parameters and state, but cannot see BatchNorm buffers the step "
    "updates (hence a 'no' there); find_batch(model, step=step, optimizer=optimizer) restores "
    "them too.",
)
CUDA_NOTES = (
    "GPU: every tool, and the true maximum, runs with the cache emptied first and the process "
    "capped at the budget by torch.cuda.set_per_process_memory_fraction(budget / total memory), "
    "so the allocator's own CUDA out-of-memory errors are what every tool sees; batchwidgets "
    "also gets budget= and sets the same cap itself. The true maximum empties the cache before "
    "every size.",
)


def _targets(truths: dict[str, int], outcomes: list[Outcome],
             workloads: tuple[Workload, ...] = WORKLOADS) -> list[str]:
    """Is batchwidgets (both forms) exact, within 1 OOM, and 4x faster than Lightning binsearch
    (issue 11's targets), in 3 real sizes (the model form, whose first real size a fake trace
    places: issue 23) or 4 (the bare step, which no fake trace can run)?"""
    lines = []
    for w in workloads:
        peer = next(o for o in outcomes if (o.model, o.tool) == (w.name, LIGHTNING_BINSEARCH))
        for tool in (BATCHWIDGETS, BATCHWIDGETS_STEP):
            mine = next((o for o in outcomes if (o.model, o.tool) == (w.name, tool)), None)
            if mine is None:
                continue
            most = 3 if tool == BATCHWIDGETS else 4
            checks = {"exact": mine.found == truths[w.name],
                      f"real sizes <= {most}": len(mine.real) <= most,
                      "OOMs <= 1": mine.n_ooms <= 1,
                      "wall <= 0.25 x Lightning binsearch": mine.wall_s <= 0.25 * peer.wall_s}
            ratio = mine.wall_s / peer.wall_s
            lines.append(f"- targets, {w.name}, {tool} ({ratio:.2f} x Lightning binsearch's wall "
                         f"time): " + ", ".join(f"{name} {'met' if ok else 'MISSED'}"
                                               for name, ok in checks.items()))
    return lines


def markdown(truths: dict[str, int], outcomes: list[Outcome], header: list[str],
             workloads: tuple[Workload, ...] = WORKLOADS, notes: tuple[str, ...] = NOTES) -> str:
    lines = [*header, *_targets(truths, outcomes, workloads), "",
             "| model | tool | found | true max | found/true | largest size run | trials | OOMs "
             "| steps | samples | wall (s) | CPU (s) | weights, buffers, optimizer bit-identical "
             "| gradients as before |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for o in outcomes:
        truth = truths[o.model]
        kept = "no" if set(o.changed) - {"gradients"} else "yes"
        grads = "no" if "gradients" in o.changed else "yes"
        lines.append(f"| {o.model} | {o.tool} | {o.found} | {truth} | {o.found / truth:.3f} | "
                     f"{o.largest_ran} | {len(o.real)} | {o.n_ooms} | {o.n_steps} | "
                     f"{o.samples} | {o.wall_s:.1f} | "
                     f"{o.cpu_s:.1f} | {kept} | {grads} |")
    lines += ["", "Sizes tried, in order (✗: out of memory; ᶠ: traced on fake tensors, not run):",
              ""]
    lines += [f"- {o.model}, {o.tool}: {_sizes(o.trials)}" for o in outcomes]
    lines += ["", "Notes:", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _gpu_lines(workloads: tuple[Workload, ...]) -> list[str]:
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget = workloads[0].budget_bytes
    return [
        "# find_batch vs Lightning and Accelerate on one GPU capped at a budget", "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {torch.cuda.get_device_name()} ({total / 2**30:.1f} GiB), CUDA "
        f"{torch.version.cuda}; host {os.cpu_count()}-core CPU ({_cpu_name()})",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}, accelerate {accelerate.__version__}, batchwidgets "
        f"{batchwidgets.__version__} (commit {commit()})",
        f"- budget: {workloads[0].budget} for every tool and model, the whole process capped by "
        f"torch.cuda.set_per_process_memory_fraction({budget / total:.4f}); real CUDA "
        f"out-of-memory errors; float32 (TF32 as torch's defaults)",
    ]


def header(outcomes: list[Outcome], workloads: tuple[Workload, ...] = WORKLOADS,
           command: str = "python benchmarks/probe_vs_peers.py") -> list[str]:
    runs = {(o.model, o.tool): o for o in outcomes}
    pairs = [(w.name, runs[w.name, BATCHWIDGETS], runs[w.name, LIGHTNING_BINSEARCH])
             for w in workloads]
    ratios = [f"{name} {a.wall_s / b.wall_s:.2f} (CPU time {a.cpu_s / b.cpu_s:.2f}, samples "
              f"{a.samples / b.samples:.2f})" for name, a, b in pairs]
    rounds = len(pairs[0][1].times)
    budgets = ", ".join(f"{w.name} {w.budget}" for w in workloads)
    first = _gpu_lines(workloads) if workloads[0].device == "cuda" else [
        "# find_batch vs Lightning and Accelerate on an emulated CPU device", "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()}-core CPU ({_cpu_name()}), torch threads "
        f"{torch.get_num_threads()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}, accelerate {accelerate.__version__}, batchwidgets "
        f"{batchwidgets.__version__} (commit {commit()})",
        f"- budgets (live tensor bytes of a step, weights/grads/Adam state included): {budgets}",
    ]
    return [
        *first,
        f"- wall time of batchwidgets / Lightning binsearch: {', '.join(ratios)} (target <= 0.25)",
        f"- times: batchwidgets and Lightning binsearch are medians of {rounds} alternating "
        f"rounds, the others one run; load average (1, 5, 15 min) at the end: "
        f"{', '.join(f'{load:.1f}' for load in os.getloadavg())}",
        f"- step: forward, cross-entropy, backward, Adam, zero_grad. Lightning with its defaults "
        f"(init_val 2, steps_per_trial 3, max_trials 25, binsearch margin 5%); Accelerate and "
        f"the true maximum with {STEPS_PER_TRIAL} steps per size; steps count the one that ran "
        f"out of memory; samples sum the batch sizes of all steps (load-independent work); trials, "
        f"steps and samples count real sizes only (find_batch's fake traces run nothing)",
        f"- regenerate: `{command}`",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .md and .json")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds of batchwidgets and Lightning binsearch (median)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps times steady when other jobs share the CPU")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the emulated device (the recorded results); cuda: real OOMs")
    parser.add_argument("--budget", default=CUDA_BUDGET,
                        help="with --device cuda: the memory cap of every tool, e.g. 8GiB")
    parser.add_argument("--quick", action="store_true",
                        help="one timing round and Accelerate from 4096 only")
    args = parser.parse_args(argv)
    # With 2 threads on 2 busy cores, OpenMP's spin-waiting swings times (CPU time too) 5-10x.
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False")
    workloads = cuda_workloads(args.budget) if args.device == "cuda" else WORKLOADS
    rounds = 1 if args.quick else args.rounds
    starts = ACCELERATE_STARTS[:1] if args.quick else ACCELERATE_STARTS
    command = "python benchmarks/probe_vs_peers.py" + (
        f" --device cuda --budget {args.budget}" + (" --quick" if args.quick else
                                                   f" --rounds {args.rounds}")
        if args.device == "cuda" else "")
    truths, records, outcomes, edges = {}, [], [], []
    for work in workloads:
        truth, truth_trials, found = run_all(work, rounds, starts)
        truths[work.name] = truth
        outcomes += found
        records.append({"model": work.name, "budget": work.budget,
                        "budget_bytes": work.budget_bytes, "true_max": truth,
                        "true_max_trials": [asdict(t) for t in truth_trials]})
        verify = truth_trials[-2:]  # the answer and the next size, re-run (only a GPU goes on)
        if not (verify[0].fits and not verify[1].fits):
            records[-1]["boundary_reproducible"] = False
            edges.append(f"{work.name}: the true maximum's edge did not reproduce on the re-run "
                         f"({_sizes(verify)}), so the GPU's boundary is {truth} give or take a "
                         f"few samples (cuDNN's choice of algorithm and the allocator's state "
                         f"move it); 'found/true' within about 1% is as good as exact.")
    notes = NOTES + CUDA_NOTES + tuple(edges) if args.device == "cuda" else NOTES
    lines = header(outcomes, workloads, command)
    table = markdown(truths, outcomes, lines, workloads, notes)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"probe_vs_peers_{args.device}.md").write_text(table)
    runs = [{**asdict(o), "true_max": truths[o.model], "n_trials": len(o.real),
             "n_fake": len(o.trials) - len(o.real),
             **{key: getattr(o, key) for key in DERIVED}} for o in outcomes]
    document = {"header": lines, "notes": notes, "workloads": records, "runs": runs}
    (args.out / f"probe_vs_peers_{args.device}.json").write_text(
        json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
