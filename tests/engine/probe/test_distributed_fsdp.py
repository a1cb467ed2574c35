"""find_batch inside every rank of a real job: FSDP2 (``fully_shard``) and DDP over gloo on the
CPU, 2 processes started once for all the checks. One answer on every rank (budgets and data
uneven between ranks), every rank's shards, optimizer state and RNG bit-identical afterwards,
the per-rank peak against PyTorch's FSDPMemTracker, and an error on one rank raised on all;
then, in the same processes, the checks that break their group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import batchwidgets

WORKER = textwrap.dedent("""
    import dataclasses, datetime, gc, json, os, sys
    import torch
    import torch.distributed as dist
    import transformers
    from torch import nn
    import batchwidgets as bw

    rank, init_file, out, broken_out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    mesh = init_device_mesh("cpu", (2,))
    # what the imports made lives as long as the rank: out of the collections find_batch runs
    # after each out-of-memory (a quarter second each over torch's and transformers' objects)
    gc.freeze()
    KIB = 2**10
    results = {}

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 8))

    def sharded(model):  # each Linear a unit, and the root
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def make_batch(n):
        return torch.randn(n, 32), torch.randint(0, 8, (n,))

    def trained(model):  # AdamW with its state: one step taken before the probe
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = make_batch(8)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return optimizer

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def snapshot(model, optimizer):
        tensors = [local(p).clone() for p in model.parameters()]
        tensors += [local(v).clone() for s in optimizer.state.values() for v in s.values()]
        return (tensors, [p.grad is None for p in model.parameters()],
                [type(p).__name__ for p in model.parameters()], torch.get_rng_state())

    def same(a, b):
        return (len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
                and a[1] == b[1] and a[2] == b[2] and torch.equal(a[3], b[3]))

    def probe(name, model, optimizer, make, budget):
        before = snapshot(model, optimizer)
        try:
            report = bw.find_batch(model, make, loss_fn=nn.functional.cross_entropy,
                                   optimizer=optimizer, budget=budget)
            outcome = dataclasses.asdict(report)
        except Exception as error:
            outcome = {"raised": type(error).__name__, "message": str(error).splitlines()[0]}
        outcome["restored"] = same(before, snapshot(model, optimizer))
        results[name] = outcome
        dist.barrier()  # the group still works afterwards

    # FSDP2: the ranks' budgets differ; the answer is the lower budget's on both ranks
    for name, budgets in (("fsdp_mixed", (1024 * KIB, 512 * KIB)),
                          ("fsdp_low", (512 * KIB, 512 * KIB)),
                          ("fsdp_high", (1024 * KIB, 1024 * KIB))):
        model = sharded(mlp())
        probe(name, model, trained(model), make_batch, budgets[rank])

    # the per-rank peak at the answer against PyTorch's own FSDP2 tracker, the same two steps;
    # its least of three runs (a collective's buffers, freed on gloo's thread, may count late)
    peaks = []
    for _ in range(3):
        model = sharded(mlp())
        optimizer = trained(model)
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            for _ in range(2):
                x, y = make_batch(results["fsdp_mixed"]["max_batch_size"])
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    results["oracle_peaks"] = peaks

    # uneven data: rank 1's sequences are four times longer (variable-length text)
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.hidden = nn.Embedding(64, 32), nn.Linear(32, 64)
            self.out = nn.Linear(64, 8)

        def forward(self, tokens):
            return self.out(torch.relu(self.hidden(self.embed(tokens))).mean(dim=1))

    def texts(lengths):
        return lambda n: (torch.randint(0, 64, (n, lengths[rank])), torch.randint(0, 8, (n,)))

    for name, lengths in (("uneven", (16, 64)), ("both_long", (64, 64)),
                          ("both_short", (16, 16))):
        model = Bag()
        for module in (model.embed, model.hidden, model.out, model):
            fully_shard(module, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        probe(name, model, optimizer, texts(lengths), 1024 * KIB)

    # a stop asked on one rank only (its panel's Stop button) stops both after the same size
    model = sharded(mlp())
    seen = []
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=trained(model), budget=1024 * KIB, on_step=seen.append,
                           should_stop=lambda: rank == 1 and len(seen) >= 2,
                           cache=False)  # measured: the same call's answer is remembered
    results["stopped"] = dataclasses.asdict(report)

    # a Hugging Face GPT-2 from a config, each block a unit, rank 1's texts twice as long
    transformers.logging.set_verbosity_error()
    for name, lengths in (("gpt2_uneven", (32, 64)), ("gpt2_long", (64, 64))):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())

        def tokens(n, length=lengths[rank]):
            ids = torch.randint(0, 256, (n, length))
            return {"input_ids": ids, "labels": ids}

        before = snapshot(model, optimizer)
        report = bw.find_batch(model, tokens, optimizer=optimizer, budget="12MiB")
        results[name] = {**dataclasses.asdict(report),
                         "restored": same(before, snapshot(model, optimizer))}

    # an error on one rank (its data fails past 4 samples) stops both, naming rank 1
    def failing(n):
        if rank == 1 and n > 4:
            raise ValueError(f"rank 1 cannot make a batch of {n}")
        return make_batch(n)

    model = sharded(mlp())
    probe("error", model, trained(model), failing, 1024 * KIB)

    # DDP: the same agreement, its gradient all-reduce inside every step
    for name, budgets in (("ddp_mixed", (2048 * KIB, 1024 * KIB)),
                          ("ddp_low", (1024 * KIB, 1024 * KIB))):
        model = nn.parallel.DistributedDataParallel(mlp())
        probe(name, model, trained(model), make_batch, budgets[rank])
    model = nn.parallel.DistributedDataParallel(mlp())
    results["ddp_plan_in_job"] = dataclasses.asdict(bw.find_batch(
        model, make_batch, loss_fn=nn.functional.cross_entropy, optimizer=trained(model),
        target="1GiB"))

    # critical_batch on every rank (the same dataset): the sharded model's answer is one
    # process's on the same model, and its shards come back
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(512, 16, generator=generator)
    tasks = torch.utils.data.TensorDataset(features, features[:, :4].argmax(1))
    critical = {}
    for name in ("plain", "sharded"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        if name == "sharded":
            for module in (net[0], net[2], net):
                fully_shard(module, mesh=mesh)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        before = snapshot(net, optimizer)
        report = bw.critical_batch(net, tasks, optimizer=optimizer,
                                   loss_fn=nn.functional.cross_entropy, max_steps=60)
        critical[name] = [report.critical_batch_size, report.examples,
                          same(before, snapshot(net, optimizer))]
    results["critical"] = critical

    # a plan for a target from inside the job: a meta replica of the full model, planned under
    # FSDP2 over the job's ranks; the shards and the optimizer untouched, and training goes on
    model = sharded(mlp())
    optimizer = trained(model)
    before = snapshot(model, optimizer)
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, target="1GiB")
    results["plan_in_job"] = {**dataclasses.asdict(report),
                              "restored": same(before, snapshot(model, optimizer))}
    x, y = make_batch(8)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    results["plan_in_job_trains"] = all(bool(torch.isfinite(local(p)).all())
                                        for p in model.parameters())

    # accumulate and the NoiseTracker under FSDP2: the full gradient's quantities
    torch.manual_seed(100 + rank)
    data = [make_batch(4) for _ in range(8)]
    model = sharded(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = bw.NoiseTracker(warmup_updates=1)
    with bw.accumulate(optimizer, steps=2, model=model, noise=tracker):
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    results["noise"] = [dataclasses.asdict(point) for point in tracker.report.history]
    results["noise_weights"] = [p.full_tensor().tolist() for p in model.parameters()]

    # measure_noise and NoiseTracker.measure on a sharded GPT-2 (tied weights), each rank its
    # own texts: against the same calls on the unsharded model, then one training step on both
    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0,
            embd_pdrop=0, attn_pdrop=0))

    plain, model = gpt2(), gpt2()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(rank))
    texts = [{"input_ids": row, "labels": row} for row in ids]
    before = [local(p).clone() for p in model.parameters()]
    noise = {}
    for name, net in (("plain", plain), ("sharded", model)):
        report = bw.measure_noise(net, texts)
        tracker = bw.NoiseTracker()
        tracker.measure(net, {"input_ids": ids[:8], "labels": ids[:8]})
        point = tracker.report.history[-1]
        noise[name] = [report.trace_cov, report.grad_norm_sq, point.trace_cov, point.grad_norm_sq]
    results["sharded_noise"] = noise
    results["sharded_noise_restored"] = all(
        torch.equal(a, local(p)) for a, p in zip(before, model.parameters()))
    same = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(7))
    batch = {"input_ids": same, "labels": same}  # one batch on both ranks: the same step
    for net in (plain, model):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        net(**batch).loss.backward()
        optimizer.step()
    results["sharded_noise_trains"] = max((a - b.full_tensor()).abs().max().item()
                                          for a, b in zip(plain.parameters(), model.parameters()))

    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)

    # Wrong uses, then an error inside the step on one rank while the other waits in an FSDP2
    # all-gather: the group's timeout is 3 s, and the group is broken afterwards (so the workers
    # leave with os._exit, as a gloo group that timed out may abort its process at teardown).
    timeout = datetime.timedelta(seconds=3)
    dist.init_process_group("gloo", init_method="file://" + init_file + "a", rank=rank,
                            world_size=2, timeout=timeout)
    broken = {}

    def raised(name, call):
        try:
            call()
            broken[name] = None
        except Exception as error:
            broken[name] = {"raised": type(error).__name__, "message": str(error)}

    class Picky(nn.Module):  # rank 1's data breaks it past 4 samples, inside the forward
        def forward(self, x):
            if rank == 1 and len(x) > 4:
                raise IndexError(f"rank 1 cannot take {len(x)} samples")
            return x

    def picky():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), Picky(), nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (2,))
        for module in (net[0], net[2], net):
            fully_shard(module, mesh=mesh)
        return net

    def small_batch(n):
        return torch.randn(n, 8), torch.randint(0, 4, (n,))

    net = picky()
    loss_fn = nn.functional.cross_entropy
    dist.destroy_process_group()
    raised("no_group", lambda: bw.find_batch(net, small_batch, loss_fn=loss_fn))

    dist.init_process_group("gloo", init_method="file://" + init_file + "b", rank=rank,
                            world_size=2, timeout=timeout)
    net = picky()
    optimizer = torch.optim.AdamW(net.parameters())
    before = [p.to_local().clone() for p in net.parameters()]
    raised("in_step", lambda: bw.find_batch(net, small_batch, loss_fn=loss_fn,
                                            optimizer=optimizer, budget="1MiB"))
    broken["restored"] = all(torch.equal(a, p.to_local()) for a, p in zip(
        before, net.parameters())) and not optimizer.state
    with open(broken_out, "w") as f:
        json.dump(broken, f)
    sys.stdout.flush()
    os._exit(0)
""")


def _run_job(tmp) -> tuple[list[dict], list[dict]]:
    """Both ranks' results of the 2-process gloo job: those of the working group's checks, then
    those of the checks that broke their group."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    outputs = [(tmp / f"rank{rank}.json", tmp / f"rank{rank}_broken.json") for rank in range(2)]
    root = str(Path(batchwidgets.__file__).parents[1])  # this checkout, not another install
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    workers = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp / "init"),
                                 *map(str, outputs[rank])], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        logs = [worker.communicate(timeout=240)[0] for worker in workers]
    finally:
        for worker in workers:  # a hang fails the test and leaves no process behind
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], logs
    return ([json.loads(working.read_text()) for working, _ in outputs],
            [json.loads(broken.read_text()) for _, broken in outputs])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    return _run_job(tmp_path_factory.mktemp("fsdp_job"))


@pytest.fixture(scope="module")
def job(jobs) -> list[dict]:
    """The checks of a working group."""
    return jobs[0]


@pytest.fixture(scope="module")
def broken_job(jobs) -> list[dict]:
    """The wrong uses and the error inside the step, which breaks its group."""
    return jobs[1]


def _answers(job: list[dict], name: str) -> list[tuple]:
    return [(rank[name]["max_batch_size"], rank[name]["first_oom_batch_size"],
             rank[name]["limit_bytes"]) for rank in job]


def _search(report: dict) -> list[tuple]:
    """What every rank must agree on: each size tried, whether it fit, and its peak."""
    return [(a["batch_size"], a["fits"], a["peak_memory_bytes"]) for a in report["attempts"]]


@pytest.mark.slow
def test_fsdp2_ranks_agree_on_the_lower_budgets_answer_and_restore_their_shards(job):
    mixed, low, high = (_answers(job, name) for name in ("fsdp_mixed", "fsdp_low", "fsdp_high"))
    assert mixed[0] == mixed[1] == low[0]  # the rank with less memory decides, for both
    assert high[0][0] > low[0][0]  # and the budgets matter
    assert _search(job[0]["fsdp_mixed"]) == _search(job[1]["fsdp_mixed"])
    assert [a["fits"] for a in job[0]["fsdp_mixed"]["attempts"]].count(False) >= 1
    for rank in job:
        assert all(rank[name]["restored"] for name in ("fsdp_mixed", "fsdp_low", "fsdp_high"))


@pytest.mark.slow
def test_fsdp2_peak_per_rank_matches_pytorchs_fsdp_memory_tracker(job):
    # Each rank counts its local shards (not the DTensors' global sizes), the units FSDP2
    # all-gathers and the gradients it reduce-scatters: PyTorch's FSDPMemTracker as the oracle.
    report = job[0]["fsdp_mixed"]
    at_answer = next(a for a in report["attempts"]
                     if a["batch_size"] == report["max_batch_size"] and a["fits"])
    oracle = min(job[0]["oracle_peaks"])
    assert abs(at_answer["peak_memory_bytes"] - oracle) <= 0.03 * oracle, job[0]["oracle_peaks"]


@pytest.mark.slow
def test_fsdp2_uneven_data_the_longest_ranks_answer_on_every_rank(job):
    uneven, long, short = (_answers(job, name) for name in ("uneven", "both_long", "both_short"))
    assert uneven[0] == uneven[1]
    assert uneven[0][0] == long[0][0] < short[0][0]
    assert all(rank[name]["restored"] for rank in job
               for name in ("uneven", "both_long", "both_short"))


@pytest.mark.slow
def test_an_error_on_one_rank_raises_on_every_rank_naming_it(job):
    assert job[1]["error"]["raised"] == "ValueError"  # its own error, unchanged
    message = job[1]["error"]["message"]
    assert message.startswith("find_batch called make_batch(")  # what it called, then its own
    own = message.split("it raised ValueError: ", 1)[1]
    assert own.startswith("rank 1 cannot make a batch of ")
    assert job[0]["error"]["raised"] == "RankFailed"
    assert f"rank 1 of 2 raised ValueError: {own} (" in job[0]["error"]["message"]
    assert [rank["error"]["restored"] for rank in job] == [True, True]


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_lower_budgets_answer_and_restore_their_state(job):
    mixed, low = _answers(job, "ddp_mixed"), _answers(job, "ddp_low")
    assert mixed[0] == mixed[1] == low[0]
    assert mixed[0][0] > 2  # a search, not the smallest size
    assert _search(job[0]["ddp_mixed"]) == _search(job[1]["ddp_mixed"])
    assert all(rank[name]["restored"] for rank in job for name in ("ddp_mixed", "ddp_low"))


@pytest.mark.slow
def test_noise_tracker_under_fsdp2_equals_one_process_on_both_ranks_micro_batches(job):
    # Oracle: one process, no sharding, each micro-batch the two ranks' micro-batches together
    # (FSDP2's .grad after a micro-step is their average), the same hook-free estimate.
    import torch
    from torch import nn

    import batchwidgets as bw

    per_rank = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        per_rank.append([(torch.randn(4, 32), torch.randint(0, 8, (4,))) for _ in range(8)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = bw.NoiseTracker(warmup_updates=1, every_micro_batch=False, overhead_target=None)
    with bw.accumulate(optimizer, steps=2, model=model, noise=tracker):
        for (x0, y0), (x1, y1) in zip(*per_rank):
            nn.functional.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = tracker.report.history
    assert len(expected) == 4
    for rank in job:
        assert [point["update"] for point in rank["noise"]] == [p.update for p in expected]
        for point, oracle in zip(rank["noise"], expected):
            assert point["grad_norm_sq"] == pytest.approx(oracle.grad_norm_sq, rel=1e-4)
            assert point["trace_cov"] == pytest.approx(oracle.trace_cov, rel=1e-4)
        for weights, param in zip(rank["noise_weights"], model.parameters()):
            assert torch.allclose(torch.tensor(weights), param.detach(), atol=1e-6)


@pytest.mark.slow
def test_an_error_inside_one_ranks_step_raises_on_every_rank_within_the_groups_timeout(
        broken_job):
    # rank 1 left its forward while rank 0 waited in the next unit's all-gather: rank 0's
    # collective fails at the group's timeout (3 s here), and it names rank 1's error
    assert broken_job[1]["in_step"]["raised"] == "IndexError"
    message = broken_job[1]["in_step"]["message"]
    assert message.startswith("find_batch called model(")  # what it called, then its own
    assert "it raised IndexError: rank 1 cannot take " in message
    assert broken_job[0]["in_step"]["raised"] == "RankFailed"
    assert f"rank 1 of 2 raised IndexError: {message} (" in broken_job[0]["in_step"]["message"]
    assert [rank["restored"] for rank in broken_job] == [True, True]


@pytest.mark.slow
def test_wrong_uses_with_a_sharded_model_are_one_line_errors(broken_job):
    for rank in broken_job:
        for name, fix in (("no_group", "init_process_group()"),):
            assert rank[name]["raised"] == "ValueError"
            assert rank[name]["message"].startswith("model should ")
            assert fix in rank[name]["message"]
            assert "\n" not in rank[name]["message"]


@pytest.mark.slow
def test_fsdp2_gpt2_with_uneven_lengths_one_answer_the_longer_ranks(job):
    uneven, long = _answers(job, "gpt2_uneven"), _answers(job, "gpt2_long")
    assert uneven[0] == uneven[1] == long[0]
    assert uneven[0][0] >= 2
    assert [rank[name]["restored"] for rank in job for name in ("gpt2_uneven", "gpt2_long")] == [
        True] * 4


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_every_rank_after_the_same_size(job):
    assert [rank["stopped"]["stop_reason"] for rank in job] == ["stopped", "stopped"]
    assert [len(rank["stopped"]["attempts"]) for rank in job] == [2, 2]


@pytest.mark.slow
def test_measure_noise_and_tracker_measure_under_fsdp2_equal_the_unsharded_model(job):
    # per-example gradients need every weight: they run on a replica with the full weights
    # (NOTE [ An unsharded replica ]), leaving the shards, their hooks and training unchanged
    for rank in job:
        plain, sharded = rank["sharded_noise"]["plain"], rank["sharded_noise"]["sharded"]
        assert sharded == pytest.approx(plain, rel=1e-5)
        assert rank["sharded_noise_restored"]
        assert rank["sharded_noise_trains"] < 1e-6
    assert job[0]["sharded_noise"]["plain"] != job[1]["sharded_noise"]["plain"]  # own texts


@pytest.mark.slow
def test_a_target_plan_inside_the_job_plans_the_jobs_strategy_over_its_ranks(job):
    import torch
    from torch import nn

    import batchwidgets as bw

    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 8))
    outside = bw.find_batch(meta, lambda n: (torch.randn(n, 32), torch.randint(0, 8, (n,))),
                            loss_fn=nn.functional.cross_entropy, target="2x1GiB",
                            parallel="fsdp")
    ddp = bw.find_batch(meta, lambda n: (torch.randn(n, 32), torch.randint(0, 8, (n,))),
                        loss_fn=nn.functional.cross_entropy, target="2x1GiB", parallel="ddp")
    for rank in job:
        plan = rank["ddp_plan_in_job"]  # a DDP model: DDP over the job's ranks
        assert (plan["parallel"], plan["world_size"]) == ("ddp", 2)
        assert plan["max_batch_size"] == ddp.max_batch_size > 0
        plan = rank["plan_in_job"]
        assert (plan["parallel"], plan["world_size"], plan["trace"]) == ("fsdp", 2, "fake")
        assert plan["max_batch_size"] == outside.max_batch_size > 0
        assert plan["restored"]
        assert rank["plan_in_job_trains"]


@pytest.mark.slow
def test_critical_batch_on_a_sharded_model_is_one_processs_answer(job):
    for rank in job:
        plain, sharded = rank["critical"]["plain"], rank["critical"]["sharded"]
        assert sharded[:2] == pytest.approx(plain[:2], rel=1e-6)
        assert plain[0] > 0
        assert sharded[2]
