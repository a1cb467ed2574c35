"""Same answers: find_batch on 24 cases, everything it answers written down, so two commits can be
compared case by case (issue 22's method, kept for every redesign of the probe since).

Each case is one call through the public API (no option a commit may lack: ``cache=False`` and
``keep_output=False`` are passed only where the signature has them, so a commit from before those
options answers the same loop). What is recorded: the sizes tried in order (fake or real, fits or
not), the answer, the recommendation, the first size that ran out, the method, the stop reason, the
what-if rows, the memory split's size, a target's band and its predicted peak at the answer and one
size past it, the frontier, the per-rank plans, and an error's type and first line.

Usage:
    python benchmarks/same_answers.py --out /tmp/after.json          # this checkout
    python benchmarks/same_answers.py --repo ../old --out /tmp/before.json
    python benchmarks/same_answers.py --compare /tmp/before.json /tmp/after.json \
        --md benchmarks/results/same_answers_cpu.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import warnings
from pathlib import Path


def cases(bw, torch, nn):
    """(name, call) pairs; each call returns find_batch's report or raises."""
    extra = {k: False for k in ("cache", "keep_output")
             if k in inspect.signature(bw.find_batch).parameters}
    own = {k: v for k, v in extra.items() if k != "keep_output"}  # a step of one's own keeps its

    def mlp(width=256, depth=2, classes=10):
        torch.manual_seed(0)
        layers = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, classes))

    def xy(n, features=64, classes=10):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)

    def cnn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def images(n):
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(1000, 128)
            layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(128, 1000)

        def forward(self, ids):
            return self.head(self.body(self.embed(ids))).flatten(0, 1)

    def tokens(n, seq=64):
        ids = torch.randint(0, 1000, (n, seq))
        return ids, torch.randint(0, 1000, (n * seq,))

    def fb(model, make, budget="64MiB", optimizer=None, **kw):
        ce = nn.functional.cross_entropy
        optimizer = optimizer(model.parameters()) if optimizer else None
        return bw.find_batch(model, make, kw.pop("loss_fn", ce), optimizer, budget=budget,
                             **extra, **kw)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.randn(64), i % 10

    def bare_step():
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(n):
            x, y = xy(n)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return bw.find_batch(step, budget="64MiB", optimizer=opt, **own)

    def model_step():
        model = mlp()
        opt = torch.optim.AdamW(model.parameters())

        def step(n):
            x, y = xy(n)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return bw.find_batch(model, budget="64MiB", optimizer=opt, step=step, **own)

    def stop_after_two():
        seen = []
        return fb(mlp(), xy, should_stop=lambda: seen.append(1) or len(seen) > 2)

    return [
        ("MLP, AdamW assumed", lambda: fb(mlp(), xy)),
        ("MLP, Adam", lambda: fb(mlp(), xy, optimizer=torch.optim.Adam)),
        ("MLP, SGD", lambda: fb(mlp(), xy, optimizer=torch.optim.SGD)),
        ("MLP, what_if", lambda: fb(mlp(), xy, optimizer=torch.optim.Adam, what_if=True)),
        ("MLP, multiple_of=8", lambda: fb(mlp(), xy, multiple_of=8)),
        ("MLP, max_batch_size=100", lambda: fb(mlp(), xy, max_batch_size=100)),
        ("MLP, bf16 autocast", lambda: fb(mlp(), xy, amp="bf16")),
        ("MLP, target T4", lambda: fb(mlp(1024, 3), xy, budget=None, target="T4")),
        ("MLP, target 2GiB", lambda: fb(mlp(1024, 3), xy, budget=None, target="2GiB")),
        ("MLP, target 2GiB, real trace",
         lambda: fb(mlp(1024, 3), xy, budget=None, target="2GiB", trace="real")),
        ("MLP, target T4@2GiB", lambda: fb(mlp(1024, 3), xy, budget=None, target="T4@2GiB")),
        ("MLP, 8xA100-80GB compare",
         lambda: fb(mlp(1024, 3), xy, budget=None, target="8xA100-80GB", parallel="compare")),
        ("CNN with BatchNorm", lambda: fb(cnn(), images)),
        ("CNN, target A100-40GB", lambda: fb(cnn(), images, budget=None, target="A100-40GB")),
        ("encoder, 64 tokens", lambda: fb(Encoder(), tokens)),
        ("encoder, seq_len frontier", lambda: fb(Encoder(), tokens, seq_len=(32, 64, 128))),
        ("encoder, target L4", lambda: fb(Encoder(), tokens, budget=None, target="L4")),
        ("bare step, SGD", bare_step),
        ("model with step=", model_step),
        ("one example tensor", lambda: fb(mlp(), torch.randn(64), loss_fn=None)),
        ("Dataset", lambda: fb(mlp(), Samples())),
        ("nothing fits", lambda: fb(mlp(4096, 4), xy, budget="8MiB")),
        ("should_stop after two", stop_after_two),
        ("bad budget", lambda: fb(mlp(), xy, budget="lots")),
        ("bad headroom", lambda: fb(mlp(), xy, headroom=2.0)),
        ("bad multiple_of", lambda: fb(mlp(), xy, multiple_of=0)),
        ("bad target", lambda: fb(mlp(), xy, budget=None, target="Z9000")),
    ]


def record(report) -> dict:
    out = {
        "max_batch_size": report.max_batch_size,
        "recommended_batch_size": report.recommended_batch_size,
        "first_oom_batch_size": report.first_oom_batch_size,
        "tried": [f"{a.batch_size}{'f' if a.fake else ''}{'' if a.fits else '!'}"
                  for a in report.attempts],
        "method": report.method,
        "stop_reason": report.stop_reason,
        "what_if": [[w.name, w.max_batch_size, w.measured] for w in report.what_if],
        "split_at": getattr(report.memory_split, "batch_size", None),
        "frontier": {str(k): v for k, v in (report.frontier or {}).items()},
        "target_band": list(report.target_band) if report.target_band else None,
        "parallel": [[p.parallel, p.world_size, p.max_batch_size]
                     for p in report.parallel_plans],
    }
    if report.target:
        n = report.max_batch_size
        out["need_gib"] = [round(report.predict_peak_bytes(k) / 2**30, 3) for k in (n, n + 1)]
    return out


def one(repo: Path, index: int) -> dict:
    """Case ``index`` in this process: its record, or its error's type and first line."""
    sys.path.insert(0, str(repo))
    import torch
    from torch import nn

    import batchwidgets as bw

    listed = cases(bw, torch, nn)
    if index >= len(listed):
        raise SystemExit(3)  # no such case: the caller has them all
    name, call = listed[index]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return {"name": name, **record(call())}
        except Exception as error:
            first = str(error).splitlines()[0] if str(error) else ""
            return {"name": name, "error": f"{type(error).__name__}: {first}"}


def run(repo: Path) -> dict:
    """Every case in a process of its own (a case that kills its interpreter is an answer too:
    its exit status and last line of stderr)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                            capture_output=True, text=True).stdout.strip()
    results, index = {}, 0
    while True:
        done = subprocess.run([sys.executable, __file__, "--repo", str(repo), "--case",
                               str(index)], capture_output=True, text=True, timeout=900)
        if done.returncode == 3:  # no case of that index: all done
            break
        if done.returncode == 0:
            answer = json.loads(done.stdout.splitlines()[-1])
        else:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            answer = {"name": f"case {index}", "error": f"exit {done.returncode}: {last}"}
        name = answer.pop("name")
        results[name] = answer
        print(f"{name}: {answer.get('max_batch_size', answer.get('error'))}"[:160], flush=True)
        index += 1
    import torch
    return {"commit": commit, "torch": torch.__version__, "cases": results}


def compare(before: dict, after: dict) -> str:
    lines = [f"# Same answers: {before['commit']} (before) and {after['commit']} (after)", "",
             f"torch {after['torch']}, CPU, `python benchmarks/same_answers.py`; a field is listed "
             "where the two commits differ.", "",
             "| case | field | before | after |", "|---|---|---|---|"]
    same = 0
    for name, old in before["cases"].items():
        new = after["cases"].get(name, {})
        fields = [k for k in sorted({*old, *new}) if old.get(k) != new.get(k)]
        same += not fields
        for k in fields:
            lines.append(f"| {name} | {k} | {_cell(old.get(k))} | {_cell(new.get(k))} |")
    lines[4:4] = [f"{same} of {len(before['cases'])} cases answer identically in every field.",
                  ""]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--md", type=Path)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(one(args.repo.resolve(), args.case)))
        return
    if args.compare:
        text = compare(*(json.loads(p.read_text()) for p in args.compare))
        if args.md:
            args.md.write_text(text)
        print(text)
        return
    data = run(args.repo.resolve())
    if args.out:
        args.out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
