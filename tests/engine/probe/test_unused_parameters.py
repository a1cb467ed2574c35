"""A DDP model under find_unused_parameters=True whose ranks take different branches (a mixture
of experts, a head per task): the probe's steps in the job and accumulate's remainder average the
gradients by hand, every rank over the same tensors as DDP's reducer (NOTE [ DDP's average, by
hand ] in engine/_grads.py). Each rank reduced only the gradients it had: gloo aborted the job on
the size mismatch, or, with heads of one shape, averaged one rank's head with another's."""

from __future__ import annotations

import textwrap

import pytest
from _two_ranks import run_two_ranks

WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import batchwidgets as bw

    rank, init_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                         world_size=2, timeout=timedelta(seconds=60))
    torch.set_default_dtype(torch.float64)

    class Branchy(nn.Module):  # rank 0's data takes head a, rank 1's the larger head b
        def __init__(self):
            super().__init__()
            self.body, self.a = nn.Linear(16, 32), nn.Linear(32, 4)
            self.b = nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4))

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.a(h) if x[0, 0] > 0 else self.b(h)

    def build():
        torch.manual_seed(0)
        model = DDP(Branchy(), find_unused_parameters=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def make_batch(n, generator=None):
        x = torch.randn(n, 16, generator=generator)
        x[:, 0] = x[:, 0].abs() * (1 if rank == 0 else -1)
        return x, torch.randint(0, 4, (n,), generator=generator)

    def step(model, optimizer, batch):
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def weights(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    result = {}
    model, optimizer = build()
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget="32MiB", max_batch_size=64, cache=False)
    result["answer"] = report.max_batch_size
    batch = make_batch(8, torch.Generator().manual_seed(rank))
    step(model, optimizer, batch)  # trains on as it would have without the probe
    untouched, untouched_optimizer = build()
    step(untouched, untouched_optimizer, batch)
    result["trains_as_before"] = torch.equal(weights(model), weights(untouched))

    data = [make_batch(3, torch.Generator().manual_seed(10 + 2 * rank + k)) for k in range(2)]
    model, optimizer = build()
    with bw.accumulate(optimizer, steps=4, model=model) as acc:  # 2 of 4: the remainder
        for batch in data:
            step(model, optimizer, batch)
    result["remainder"] = acc.report.remainder
    reference, reference_optimizer = build()  # DDP's own accumulation of the two
    with reference.no_sync():
        (nn.functional.cross_entropy(reference(data[0][0]), data[0][1]) / 2).backward()
    (nn.functional.cross_entropy(reference(data[1][0]), data[1][1]) / 2).backward()
    reference_optimizer.step()
    result["accumulated_as_ddp"] = torch.equal(weights(model), weights(reference))
    mine, other = weights(model), weights(model).clone()
    torch.distributed.broadcast(other, 0)
    result["replicas_equal"] = torch.equal(mine, other)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
""")


@pytest.mark.slow
def test_ranks_on_different_branches_probe_and_accumulate_as_ddp_does(tmp_path):
    results = run_two_ranks(tmp_path, WORKER)
    assert results[0]["answer"] == results[1]["answer"] > 1
    for result in results:
        assert result["trains_as_before"]
        assert result["remainder"] == "applied"
        assert result["accumulated_as_ddp"]
        assert result["replicas_equal"]
