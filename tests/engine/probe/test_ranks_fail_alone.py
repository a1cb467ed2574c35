"""One rank's device runs out of memory mid-step while the others' do not: jobs of 1, 2 and 4
gloo processes on the CPU, each running every case in one process group. The emulated device
(tests/_emulated_device.py) runs out on the last rank only, in forward, in backward (after the
last layer's gradients were made, so DDP is mid-reduction) or in the optimizer's step, under DDP
and FSDP2. No rank hangs or aborts, every rank gives the same answer (the emulated device's edge),
and every rank's model then trains exactly as one that never met find_batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _paths import TESTS

import batchwidgets

EDGE = 12
WORKER = textwrap.dedent("""
    import dataclasses, datetime, gc, json, sys
    import torch
    import torch.distributed as dist
    from torch import nn

    rank, world, init_file, out, tests = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                          sys.argv[4], sys.argv[5])
    sys.path.insert(0, tests)
    import batchwidgets as bw
    from _emulated_device import (WHERE, Device, batches, equal, make_batch, net, state_of,
                                  step_runs_out, train)

    EDGE = int(sys.argv[6])
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    # what the imports made lives as long as the rank: out of the collections find_batch runs
    # after each out-of-memory (a quarter second each over torch's objects, on 1 thread)
    gc.freeze()
    results = {}

    def build(kind, where):
        device = Device(EDGE, where, failing=world - 1)
        model = net(device)
        if kind == "ddp":  # a bucket per layer: backward stops between two of their reductions
            model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        else:
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = step_runs_out(torch.optim.AdamW(model.parameters(), lr=1e-2), device)
        train(model, optimizer, batches(2, seed=10 + rank))  # the user trained before
        return model, optimizer, device

    def run(kind, where, probe):
        model, optimizer, device = build(kind, where)
        outcome = {}
        if probe:
            try:
                report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                                       optimizer=optimizer, budget="1GiB", max_batch_size=16,
                                       start=8, trace="real", cache=False)
                outcome["answer"] = report.max_batch_size
            except Exception as error:
                outcome["raised"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        device.armed = False
        try:
            train(model, optimizer, batches(3, seed=20 + rank))
            outcome["state"] = state_of(model, optimizer)
        except Exception as error:
            outcome["trains"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return outcome

    for kind in ("ddp", "fsdp"):
        for where in WHERE:
            name = f"{kind}_{where}"
            reference = run(kind, where, probe=False)
            probed = run(kind, where, probe=True)
            results[name] = {k: v for k, v in probed.items() if k != "state"}
            results[name]["same"] = "state" in probed and equal(reference["state"],
                                                                probed["state"])
            dist.barrier()  # the group still works
            with open(out, "w") as f:
                json.dump(results, f)
    dist.destroy_process_group()
""")


def _run_job(tmp: Path, world: int) -> list[dict]:
    """Every rank's results of a ``world``-process gloo job (those written before any abort)."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    outputs = [tmp / f"rank{rank}.json" for rank in range(world)]
    root = str(Path(batchwidgets.__file__).parents[1])  # this checkout, not another install
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    tests = str(TESTS)
    workers = [subprocess.Popen([sys.executable, str(script), str(rank), str(world),
                                 str(tmp / "init"), str(outputs[rank]), tests, str(EDGE)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in range(world)]
    try:
        logs = [worker.communicate(timeout=600)[0] for worker in workers]
    finally:
        for worker in workers:  # a hang fails the test and leaves no process behind
            worker.kill()
    results = [json.loads(path.read_text()) if path.exists() else {} for path in outputs]
    return [{"returncode": worker.returncode, "log": log[-3000:], **result}
            for worker, log, result in zip(workers, logs, results)]


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda world: f"{world}ranks")
def job(request, tmp_path_factory) -> list[dict]:
    return _run_job(tmp_path_factory.mktemp(f"fail_alone_{request.param}"), request.param)


CASES = [f"{kind}_{where}" for kind in ("ddp", "fsdp") for where in ("forward", "backward", "step")]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_one_rank_out_of_memory_every_rank_answers_the_same_and_trains_as_if_never_probed(
        job, case):
    assert all(rank["returncode"] == 0 for rank in job), [rank["log"] for rank in job]
    outcomes = [rank[case] for rank in job]
    assert [o.get("raised") for o in outcomes] == [None] * len(job), outcomes
    assert [o["answer"] for o in outcomes] == [EDGE] * len(job)  # the failing rank's edge
    assert [o.get("trains") for o in outcomes] == [None] * len(job), outcomes
    assert [o["same"] for o in outcomes] == [True] * len(job)  # bit for bit, every rank
