"""One-process plans for N ranks against the boundary real jobs find (issue 25, item 2).

The truth: a gloo job of N CPU processes (torch.multiprocessing, spawn, a free port on
127.0.0.1) running DDP, FSDP2 (``fully_shard`` on each block or Linear, then the root) or DDP
with ``ZeroRedundancyOptimizer`` over AdamW (ZeRO-1); every rank seeded the same, one real
training step taken (so the optimizer state exists), then ``find_batch(wrapped_model, ...,
budget=B)`` on every rank: its per-rank ``max_batch_size``, the same on all ranks. The plan: in
this process, with no process group, ``find_batch(plain_model, ..., budget=B,
target="NxCPU", parallel=strategy)`` on the unwrapped model from the same factory after one
real step with plain AdamW. They should agree within 2%.

    python benchmarks/distributed_plans.py   # -> results/distributed_plans_cpu.{json,md}

tests/engine/probe/test_distributed_plans.py imports ``real_boundaries`` and ``plan_report``
from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _machine
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import batchwidgets as bw

KIB, MIB = 2**10, 2**20
STRATEGIES = ("ddp", "fsdp", "zero1")
STEP_BATCH_SIZE = 8  # the real training step taken before every probe, real job and plan alike


# The models: top-level factories, so a spawned rank builds them by name.
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


class Encoder(nn.Module):
    """Token embedding, TransformerEncoderLayer blocks in a ModuleList, a mean-pooled head."""

    def __init__(self, vocab: int = 8192, width: int = 128, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def encoder_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 8192, (n, 8)), torch.randint(0, 10, (n,))


def gpt2() -> nn.Module:
    import transformers  # only this workload needs it (seconds to import in every rank)

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=8192, n_positions=64))


def gpt2_batch(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 8192, (n, 8))
    return {"input_ids": ids, "labels": ids}


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]


@dataclasses.dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[..., torch.Tensor] | None  # None: the output's own .loss
    units: Callable[[nn.Module], list[nn.Module]]  # FSDP2's units below the root
    budget: int  # per rank, bytes: the benchmark's default


WORKLOADS = {
    "mlp": Workload(mlp, mlp_batch, F.cross_entropy, _linears, 8 * MIB),
    "encoder": Workload(Encoder, encoder_batch, F.cross_entropy, _blocks, 96 * MIB),
    "gpt2": Workload(gpt2, gpt2_batch, None, _blocks, 96 * MIB),
}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # a key of WORKLOADS
    strategy: str  # "ddp" | "fsdp" | "zero1"
    budget: int  # per rank, bytes


@dataclasses.dataclass(frozen=True)
class RealBoundary:
    """What a real job found for one case, per rank, the same on every rank."""

    case: Case
    world_size: int
    probed: int | None  # find_batch's answer in the job (None when it raised: ``error``)
    held: int | None  # the answer with every byte the ranks hold counted: the truth
    error: str | None
    seconds: float  # the first find_batch's wall time on the slowest rank
    held_seconds: float  # the second's (NOTE [ What the probe inside a job does not see ])
    ranks: tuple[dict, ...]  # per rank: its answers, baseline, what it holds, restored or not


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload) -> None:
    """One real step, as a user's training would have taken before the probe."""
    batch = workload.make_batch(STEP_BATCH_SIZE)
    if workload.loss_fn is None:
        loss = model(**batch).loss
    else:
        loss = workload.loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _wrap(model: nn.Module, strategy: str, workload: Workload) -> tuple[nn.Module, Any]:
    """The model and optimizer of one rank under ``strategy`` (inside a process group)."""
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in workload.units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())
    wrapped = nn.parallel.DistributedDataParallel(model)
    if strategy == "ddp":
        return wrapped, torch.optim.AdamW(wrapped.parameters())
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(),
                                                optimizer_class=torch.optim.AdamW)
    raise ValueError(f"strategy should be one of {STRATEGIES}, but got strategy={strategy!r}.")


def _local(tensors: Any) -> list[torch.Tensor]:
    """This rank's part of ``tensors``: a DTensor (FSDP2) its local shard."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return [t for t in local if isinstance(t, torch.Tensor)]


def _nbytes(tensors: Any) -> int:
    """The bytes of the storages under ``tensors``, each once (FSDP2 pads a rank's shard)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _local(tensors)}
    return sum(storages.values())


def _inner_state(optimizer: Any) -> list:
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO keeps its shard's state in .optim
    return [v for state in inner.state.values() for v in state.values()]


def _held(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """What this rank holds before the probe, by owner: weights and buffers, gradients, its
    optimizer state (ZeRO's shard included), and DDP's gradient buckets (a second copy of every
    gradient with gradient_as_bucket_view=False, allocated when DDP is built)."""
    ddp = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    buckets = sum(int(n) for n in str(ddp.get("bucket_sizes", "")).split(",") if n.strip())
    return {"parameters_bytes": _nbytes([*model.parameters(), *model.buffers()]),
            "gradients_bytes": _nbytes(p.grad for p in model.parameters()),
            "optimizer_bytes": _nbytes(_inner_state(optimizer)),
            "ddp_bucket_bytes": 0 if ddp.get("gradient_as_bucket_view") else buckets}


def _snapshot(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    tensors = _local([*model.parameters(), *_inner_state(optimizer)])
    return [t.clone() for t in tensors] + [torch.get_rng_state()]


def _find(model: nn.Module, optimizer: Any, workload: Workload, budget: int) -> dict:
    """find_batch on this rank, its outcome or its error's first line, and its wall time."""
    started = time.perf_counter()
    try:
        report = bw.find_batch(model, workload.make_batch, loss_fn=workload.loss_fn,
                               optimizer=optimizer, budget=budget)
        outcome = {"max_batch_size": report.max_batch_size,
                   "first_oom_batch_size": report.first_oom_batch_size,
                   "baseline_bytes": report.baseline_bytes, "limit_bytes": report.limit_bytes,
                   "sizes_tried": [(a.batch_size, a.fits) for a in report.attempts]}
    except Exception as error:  # recorded, and the job goes on to the next case
        outcome = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {**outcome, "seconds": time.perf_counter() - started}


# NOTE [ What the probe inside a job does not see ]
# On the CPU find_batch counts the tensors it can reach before the step (its baseline: the
# model's weights, buffers and gradients, the optimizer's state) and those born during the step.
# A rank may hold more, made before the probe where the probe does not look: DDP's gradient
# buckets (made when DDP is built), ZeroRedundancyOptimizer's shard of the state (in
# optimizer.optim.state; its own optimizer.state is empty). Such bytes never count against the
# budget, and the job's answer is too large by them. "unseen" is what the rank holds less
# find_batch's baseline; where any rank has some, every rank probes again under budget - unseen
# (find_batch takes the smallest limit of any rank as everyone's, so the rank holding the most
# unseen bytes decides, as it would run out first). That answer, or the first where nothing was
# unseen, is the per-rank boundary of what the ranks hold: "held", the truth a plan must meet.


def _probe(case: Case) -> dict:
    """One case on this rank: build, wrap, one real step, find_batch (twice if it misses bytes
    the rank holds: NOTE [ What the probe inside a job does not see ])."""
    workload = WORKLOADS[case.model]
    torch.manual_seed(0)  # every rank the same weights and batches
    model, optimizer = _wrap(workload.build(), case.strategy, workload)
    _train_step(model, optimizer, workload)
    held, before = _held(model, optimizer), _snapshot(model, optimizer)
    dist.barrier()
    outcome = _find(model, optimizer, workload, case.budget)
    after = _snapshot(model, optimizer)  # weights, the optimizer's own state (ZeRO's too), RNG
    restored = len(before) == len(after) and all(map(torch.equal, before, after))
    unseen = sum(held.values()) - outcome["baseline_bytes"] if "error" not in outcome else 0
    most = torch.tensor([unseen])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    second = (_find(model, optimizer, workload, case.budget - unseen) if most.item() > 0
              else {**outcome, "seconds": 0.0})
    dist.barrier()  # every rank done with this case before the next one's collectives
    return {**outcome, **held, "unseen_bytes": unseen, "restored": restored,
            "held": {k: second.get(k) for k in ("max_batch_size", "error", "seconds")}}


def _rank(rank: int, world_size: int, port: int, cases: list[Case], out: str) -> None:
    """A spawned rank: every case in order, its outcomes written to ``out``/rank<N>.json."""
    torch.set_num_threads(1)  # N ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        results = [_probe(case) for case in cases]
        dist.barrier()  # all done before gloo is torn down (else it may abort)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def real_boundaries(cases: Sequence[Case], world_size: int,
                    timeout_s: float = 600) -> tuple[list[RealBoundary], float]:
    """Run every case in one real gloo job of ``world_size`` CPU processes, in order.

    Returns each case's agreed per-rank boundary and the job's wall time (spawn to exit).
    Raises RuntimeError if the job fails or times out, or if ranks give different answers.
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        context = torch.multiprocessing.start_processes(
            _rank, args=(world_size, _free_port(), list(cases), out), nprocs=world_size,
            join=False, start_method="spawn")
        try:
            while not context.join(timeout=max(1.0, started + timeout_s - time.perf_counter())):
                if time.perf_counter() > started + timeout_s:
                    raise RuntimeError(f"the {world_size}-process job ran past {timeout_s} s")
        finally:
            for process in context.processes:  # a hang or a failure leaves no process behind
                if process.is_alive():
                    process.kill()
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
    seconds = time.perf_counter() - started
    return [_agreed(case, world_size, [ranks[i] for ranks in per_rank])
            for i, case in enumerate(cases)], seconds


def _one(case: Case, name: str, answers: list) -> int | None:
    if len(set(answers)) != 1:
        raise RuntimeError(f"the ranks disagree on {name} for {case}: {answers}")
    return answers[0]


def _agreed(case: Case, world_size: int, ranks: list[dict]) -> RealBoundary:
    errors = [o["error"] for o in [*ranks, *(r["held"] for r in ranks)] if o.get("error")]
    # the error of the rank that met it, else (RankFailed on every rank) the first
    error = next((e for e in errors if not e.startswith("RankFailed")), None)
    return RealBoundary(
        case, world_size, _one(case, "find_batch", [r.get("max_batch_size") for r in ranks]),
        _one(case, "the held bytes' answer", [r["held"]["max_batch_size"] for r in ranks]),
        error or (errors[0] if errors else None), max(r["seconds"] for r in ranks),
        max(r["held"]["seconds"] for r in ranks), tuple(ranks))


def plan_report(case: Case, world_size: int) -> Any:
    """The one-process plan: the unwrapped model, one real step with plain AdamW, then
    ``find_batch(..., target="<N>xCPU", parallel=strategy)``; raises what find_batch raises."""
    workload = WORKLOADS[case.model]
    torch.manual_seed(0)
    model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_step(model, optimizer, workload)
    return bw.find_batch(model, workload.make_batch, loss_fn=workload.loss_fn,
                         optimizer=optimizer, budget=case.budget,
                         target=f"{world_size}xCPU", parallel=case.strategy)


def plan_boundary(case: Case, world_size: int) -> tuple[int | None, str | None, float]:
    """``plan_report``'s per-rank answer, or its error's first line, and its wall time."""
    started = time.perf_counter()
    try:
        answer, error = plan_report(case, world_size).max_batch_size, None
    except Exception as err:  # the plan side may not exist yet: recorded, the grid goes on
        answer, error = None, f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return answer, error, time.perf_counter() - started


def _row(real: RealBoundary, plan: tuple[int | None, str | None, float], job_s: float) -> dict:
    answer, error, plan_s = plan
    ratio = answer / real.held if answer is not None and real.held else None
    return {"model": real.case.model, "strategy": real.case.strategy,
            "world_size": real.world_size, "budget_bytes": real.case.budget,
            "probed": real.probed, "held": real.held, "real_error": real.error,
            "plan": answer, "plan_error": error, "ratio": ratio, "probed_s": real.seconds,
            "held_s": real.held_seconds, "plan_s": plan_s, "job_s": job_s,
            "ranks": list(real.ranks)}


def _kib(values: list) -> str:
    return "/".join(f"{v / KIB:.0f}" for v in values)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"  # the JSON keeps it whole


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | strategy | ranks | budget/rank | find_batch in the job | all held bytes "
             "counted | plan | plan/held | probe (s) | again (s) | plan (s) | unseen/rank (KiB) "
             "| optimizer state/rank (KiB) | state restored |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        if r["real_error"] is not None:
            r = {**r, "probed": f"error: {r['real_error']}", "held": "-"}
        plan = r["plan"] if r["plan_error"] is None else f"plan: {_short(r['plan_error'])}"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        restored = "/".join("yes" if k["restored"] else "**no**" for k in r["ranks"])
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['world_size']} | "
            f"{r['budget_bytes'] / MIB:g} MiB | {r['probed']} | {r['held']} | {plan} | {ratio} | "
            f"{r['probed_s']:.1f} | {r['held_s']:.1f} | {r['plan_s']:.1f} | "
            f"{_kib([k['unseen_bytes'] for k in r['ranks']])} | "
            f"{_kib([k['optimizer_bytes'] for k in r['ranks']])} | {restored} |")
    return lines


def run_grid(models: Sequence[str], world_sizes: Sequence[int]) -> tuple[list[dict], dict]:
    """Every model x strategy in one real job per world size, then each case's plan here."""
    rows, jobs = [], {}
    for world_size in world_sizes:
        cases = [Case(m, s, WORKLOADS[m].budget) for m in models for s in STRATEGIES]
        reals, job_s = real_boundaries(cases, world_size)
        jobs[world_size] = job_s
        for real in reals:
            rows.append(_row(real, plan_boundary(real.case, world_size), job_s))
            print(table(rows)[-1], flush=True)
    return rows, jobs


def notes(rows: list[dict]) -> list[str]:
    """What the rows say beyond each one: 2 against 4 ranks, ZeRO-1's uneven shards, and
    where find_batch in the job missed bytes or state."""
    by = {(r["model"], r["strategy"], r["world_size"]): r["held"] for r in rows}
    sizes = sorted({r["world_size"] for r in rows})
    lines = ["Per-rank boundary (all held bytes counted) by ranks:", "",
             f"| model | strategy | {' | '.join(f'{n} ranks' for n in sizes)} |",
             f"|---|---|{'--:|' * len(sizes)}"]
    for model, strategy in dict.fromkeys((r["model"], r["strategy"]) for r in rows):
        cells = " | ".join(str(by.get((model, strategy, n), "-")) for n in sizes)
        lines.append(f"| {model} | {strategy} | {cells} |")
    lines.append("")
    for r in rows:
        state = [k["optimizer_bytes"] for k in r["ranks"]]
        if r["strategy"] == "zero1":
            most = [str(i) for i, nbytes in enumerate(state) if nbytes == max(state)]
            lines.append(
                f"- zero1, {r['model']}, {r['world_size']} ranks: ZeroRedundancyOptimizer deals "
                f"out whole parameters, so rank{'s' if len(most) > 1 else ''} "
                f"{' and '.join(most)} {'holds' if len(most) == 1 else 'each hold'} "
                f"{max(state) / sum(state):.0%} of the "
                f"optimizer state (1/{r['world_size']} would be {1 / r['world_size']:.0%}) and "
                f"decide{'s' if len(most) == 1 else ''} the boundary")
        if r["probed"] != r["held"] or not all(k["restored"] for k in r["ranks"]):
            lines.append(
                f"- {r['strategy']}, {r['model']}, {r['world_size']} ranks: find_batch in the "
                f"job found {r['probed']}, missing {_kib([k['unseen_bytes'] for k in r['ranks']])}"
                f" KiB per rank; state restored: {all(k['restored'] for k in r['ranks'])}")
    return [*lines, ""]


def _header(rows: list[dict], jobs: dict, total_s: float, loads: list[float]) -> list[str]:
    lines = [
        "# One-process plans for N ranks against real gloo jobs on this CPU (issue 25, item 2)",
        "",
        f"- date: {time.strftime('%Y-%m-%d')}",
        f"- machine: {platform.machine()} CPU, {os.cpu_count()} cores; every rank on 1 torch "
        f"thread ({_machine.device_name(torch.device('cpu'))} in this process)",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"batchwidgets commit {_machine.commit()}",
        "- real: one gloo job of N spawned processes per world size, the cases in turn; every "
        "rank seeded the same, one real AdamW step at batch 8, then find_batch(wrapped model, "
        "budget=B) on every rank (the ranks agreed in every case); ddp = "
        "DistributedDataParallel + AdamW, fsdp = fully_shard on each Linear (mlp) or encoder "
        "block, then the root, + AdamW, zero1 = DDP + ZeroRedundancyOptimizer(AdamW)",
        "- all held bytes counted: the truth a plan must meet; find_batch in the job again, "
        "under B less what each rank holds and the first probe did not count (unseen: DDP's "
        "gradient buckets, ZeRO's shard of the state; NOTE [ What the probe inside a job does "
        "not see ] in the script); equal to the first answer where nothing was unseen",
        "- plan: find_batch(unwrapped model, budget=B, target='NxCPU', parallel=strategy) in "
        "the parent process, no process group, after one real step with plain AdamW; "
        "plan/held within 2% is issue 25's target",
        "- budget/rank: the same at 2 and 4 ranks; r0/r1/...: each rank's own",
        f"- time: probe and again = find_batch on the slowest rank (again: 0 when not needed); "
        f"jobs (spawn to exit) {', '.join(f'{n} ranks {s:.0f} s' for n, s in jobs.items())}; "
        f"whole run {total_s:.0f} s; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        f"(before, after)",
        "- regenerate: `python benchmarks/distributed_plans.py`",
        "",
    ]
    if all(r["plan"] is None for r in rows):
        lines += ["**The plan column is empty: the one-process plan side (target='NxCPU', "
                  "parallel=) does not run at this commit; each row says why. The real "
                  "boundaries are the truth the plans must meet within 2%.**", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "encoder"], choices=WORKLOADS)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()[0]
    rows, jobs = run_grid(args.models, args.world_sizes)
    header = _header(rows, jobs, time.perf_counter() - started, [load, os.getloadavg()[0]])
    lines = [*header, *table(rows), "", *notes(rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed_plans_cpu.md").write_text("\n".join(lines))
    (args.out / "distributed_plans_cpu.json").write_text(
        json.dumps({"header": header, "rows": rows, "jobs_s": jobs}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
