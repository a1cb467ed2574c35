"""Under torch.distributed every rank gets one answer: the largest size that fits on all of them.
Two gloo processes on the CPU, each with its own budget."""

from __future__ import annotations

import textwrap

import pytest
from _two_ranks import run_two_ranks

WORKER = textwrap.dedent("""
    import dataclasses, json, sys
    import torch
    from torch import nn
    import batchwidgets as bw

    rank, init_file, budget, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def probe():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        make_batch = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))
        # real steps only: under torch.distributed the search takes no fake first guess, and
        # alone it must search as it does together
        return bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                             optimizer=torch.optim.Adam(model.parameters()), budget=budget,
                             trace="real")

    alone = probe()
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                         world_size=2)
    try:
        together = probe()
        torch.distributed.barrier()  # both done before gloo is torn down (else it may abort)
    finally:
        torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"alone": dataclasses.asdict(alone),
                   "together": dataclasses.asdict(together)}, f)
""")
BUDGETS = (192 * 2**10, 96 * 2**10)  # rank 0 has twice the memory of rank 1


@pytest.mark.slow
def test_all_ranks_agree_on_the_largest_size_that_fits_on_every_rank(tmp_path):
    results = run_two_ranks(tmp_path, WORKER, lambda rank: [str(BUDGETS[rank])], timeout=120)
    alone = [result["alone"] for result in results]
    together = [result["together"] for result in results]

    assert alone[0]["max_batch_size"] > alone[1]["max_batch_size"]  # the budgets matter alone
    for report in together:
        assert report["max_batch_size"] == alone[1]["max_batch_size"]
        assert report["first_oom_batch_size"] == alone[1]["first_oom_batch_size"]
        assert report["limit_bytes"] == min(BUDGETS)
    assert [r["budget_bytes"] for r in together] == list(BUDGETS)  # each rank's own request

    def outcome(report: dict) -> tuple:
        """What the ranks must agree on: everything but their own budget and error messages."""
        attempts = [{k: v for k, v in a.items() if k not in ("error", "step_time_s")}
                    for a in report["attempts"]]
        rest = {k: v for k, v in report.items() if k not in ("attempts", "budget_bytes")}
        return attempts, rest, [a["step_time_s"] for a in report["attempts"]]

    assert outcome(together[0]) == outcome(together[1])

    def search(report: dict) -> tuple:
        """Sizes and outcomes, and every measurement of the sizes that ran (equal on both ranks:
        same model, same batches)."""
        ran = [{k: v for k, v in a.items() if k not in ("error", "step_time_s")}
               for a in report["attempts"] if a["fits"]]
        sizes = [(a["batch_size"], a["fits"]) for a in report["attempts"]]
        return sizes, ran, report["memory_model"]

    assert search(together[0]) == search(alone[1])  # the search went as rank 1's alone
