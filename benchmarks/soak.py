"""Does the recommended batch size survive training? Probe, then train at the recommendation
through a shuffled DataLoader of variable-length sequences, under the same memory budget.

Each workload's data set has sequences of 16-96 tokens with 12 of 4,000 at 384, and a padding
collator, so a batch that draws one of the long sequences is four times longer than most:
exactly the batch a probe that reads a few samples never sees. Every training step (and an
evaluation pass every 50 steps) runs under the budget with the weights, gradients and optimizer
state counted, as the probe counted them; an out-of-memory error is counted and training goes on.

Usage:
    python benchmarks/soak.py             # 300 steps a workload; writes results/soak_cpu.md
    python benchmarks/soak.py --steps 50  # shorter
"""

from __future__ import annotations

import argparse
import datetime
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _machine import commit
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw
from batchwidgets.engine.memory import BudgetExceededError, TensorMemoryTracker

RESULTS = Path(__file__).parent / "results"
VOCAB = 1000


class Sequences(torch.utils.data.Dataset):
    """4,000 token sequences of 16-96 tokens, 12 of them 384 long, with a class label."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.lengths = [rng.randrange(16, 97) for _ in range(4000)]
        for index in rng.sample(range(4000), 12):
            self.lengths[index] = 384
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 10_000 + index)
        ids = torch.randint(1, VOCAB, (self.lengths[index],), generator=generator)
        return {"input_ids": ids, "label": int(ids[0]) % 10}


def pad(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
    return ids, torch.tensor([item["label"] for item in items])


class Classifier(nn.Module):
    """Embedding, transformer encoder layers, mean pooling, a class head."""

    def __init__(self, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


class ConvText(nn.Module):
    """A 1-d convolutional text classifier (BatchNorm included)."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.convs = nn.Sequential(nn.Conv1d(width, width, 5, padding=2), nn.BatchNorm1d(width),
                                   nn.ReLU(), nn.Conv1d(width, width, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(width, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.convs(self.embed(ids).transpose(1, 2))
        return self.head(hidden.amax(dim=2))


class GPTLike(nn.Module):
    """A small GPT-2 from transformers (built from a config, no download), classifying from the
    last token's hidden state."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model
        self.gpt = GPT2Model(GPT2Config(vocab_size=VOCAB, n_positions=384, n_embd=64, n_layer=2,
                                        n_head=4))
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gpt(input_ids=ids).last_hidden_state[:, -1])


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    budget: str


WORKLOADS = (Workload("transformer classifier", Classifier, "768MiB"),
             Workload("1-d CNN with BatchNorm", ConvText, "64MiB"),
             Workload("GPT-2 style (transformers)", GPTLike, "1GiB"))


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    return [*model.parameters(), *model.buffers(),
            *[p.grad for p in model.parameters() if p.grad is not None],
            *[dict(state) for state in optimizer.state.values()]]


def soak(work: Workload, steps: int) -> dict:
    torch.manual_seed(0)
    model = work.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Sequences()
    probe_loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, collate_fn=pad)
    started = time.perf_counter()
    report = bw.find_batch(model, probe_loader, loss_fn=F.cross_entropy, optimizer=optimizer,
                           budget=work.budget)
    probe_s = time.perf_counter() - started
    batch_size = report.recommended_batch_size
    budget = bw.engine.parse_bytes(work.budget)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True,
                                         collate_fn=pad, generator=torch.Generator().manual_seed(1))
    ooms = evaluation_ooms = done = long_batches = 0
    peak = 0
    model.train()
    while done < steps:
        for ids, labels in loader:
            if done == steps:
                break
            long_batches += ids.shape[1] == 384
            try:
                with TensorMemoryTracker("cpu", budget, state_tensors(model, optimizer)) as t:
                    F.cross_entropy(model(ids), labels).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                peak = max(peak, t.peak_bytes)
            except BudgetExceededError:
                ooms += 1
                optimizer.zero_grad(set_to_none=True)
            done += 1
            if done % 50 == 0:  # an evaluation pass, as a training loop runs one
                model.eval()
                try:
                    with torch.no_grad(), TensorMemoryTracker(
                            "cpu", budget, state_tensors(model, optimizer)):
                        model(pad([data[i] for i in range(batch_size)])[0])
                except BudgetExceededError:
                    evaluation_ooms += 1
                model.train()
    return {"name": work.name, "budget": work.budget, "max": report.max_batch_size,
            "recommended": batch_size, "attempts": report.n_attempts, "probe_ooms": report.n_ooms,
            "worst_case": report.worst_case, "probe_s": probe_s, "steps": done,
            "long_batches": long_batches, "ooms": ooms, "evaluation_ooms": evaluation_ooms,
            "peak_fraction": peak / budget}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [soak(work, args.steps) for work in WORKLOADS]
    lines = [
        "# Soak: training at the recommended batch size, under the probe's budget",
        "",
        f"- date: {datetime.date.today()}, commit {commit()}, torch {torch.__version__}, "
        f"1 thread, CPU (the budget is batchwidgets' tensor budget: weights, gradients and "
        f"AdamW state counted, as the probe counts them)",
        "- data: 4,000 sequences of 16-96 tokens, 12 of them 384 long, a padding collator, "
        "shuffled; an evaluation pass every 50 steps",
        f"- regenerate: `python benchmarks/soak.py --steps {args.steps}`",
        "",
        "| model | budget | max | recommended | probe sizes (OOMs) | probe s | steps | "
        "batches with a 384-token sequence | training OOMs | evaluation OOMs | peak / budget |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget']} | {r['max']} | {r['recommended']} | "
                     f"{r['attempts']} ({r['probe_ooms']}) | {r['probe_s']:.1f} | {r['steps']} | "
                     f"{r['long_batches']} | {r['ooms']} | {r['evaluation_ooms']} | "
                     f"{r['peak_fraction']:.3f} |")
    lines += ["", "Batches were built by the probe from: "
              + "; ".join(f"{r['name']}: {r['worst_case']}" for r in rows), ""]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
