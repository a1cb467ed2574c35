"""Oracles the tests share: what a fresh device says about one batch size; a critical_batch
report as it gives one; a padding collate_fn as tokenizers' collators batch text."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from batchwidgets.engine.memory._simulated import ProbeMeter
from batchwidgets.results import CriticalBatchReport


def fits_on_a_fresh_device(build, make_batch, batch_size: int, budget: int,
                           steps: int = 2) -> bool:
    """The oracle: a fresh simulated device, warmed up as the probe's is, ``steps`` Adam steps."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters())
    meter = ProbeMeter("cpu", budget)
    meter.warm_up()
    model.train()
    try:
        with meter.measure(lambda: [*model.parameters(), *model.buffers()]):
            for _ in range(steps):
                x, y = make_batch(batch_size)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return False
    return True


def critical_report(critical: float | None, error: float | None = None, reason: str | None = None,
                    examples: int = 1000) -> CriticalBatchReport:
    """A CriticalBatchReport as critical_batch gives one, to loss 0.5 from 1 (critical None: not
    measurable, with ``reason``)."""
    if reason is None:
        reason = "" if critical else "the steps did not fall"
    return CriticalBatchReport(critical_batch_size=critical, critical_batch_size_error=error,
                               target_loss=0.5, start_loss=1.0, examples=examples, ladder=(),
                               base_batch_size=8, s_min=10.0, e_min=None, lr_scaling="linear",
                               reason=reason)


def pad_text(batch: list[dict]) -> dict:
    """DataCollatorWithPadding's batches without a tokenizer: ids padded with 0, a mask, sample
    by sample in Python (as most collators do)."""
    longest = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
        mask[row, :len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.stack([item["labels"] for item in batch])}
