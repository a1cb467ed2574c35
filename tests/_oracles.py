"""Oracles the tests share: what a fresh device says about one batch size."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from batchwidgets.engine.memory._simulated import ProbeMeter


def fits_on_a_fresh_device(build, make_batch, batch_size: int, budget: int) -> bool:
    """The oracle: a fresh simulated device, warmed up as the probe's is, two Adam steps."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters())
    meter = ProbeMeter("cpu", budget)
    meter.warm_up()
    model.train()
    try:
        with meter.measure(lambda: [*model.parameters(), *model.buffers()]):
            for _ in range(2):
                x, y = make_batch(batch_size)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return False
    return True
