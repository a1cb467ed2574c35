"""Factories ``python -m batchwidgets plan --factory`` builds in tests/test_plan_cli.py."""

from __future__ import annotations

import torch


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10))


def cnn_with_batches():
    def make_batch(batch_size: int):
        return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))
    return small_cnn(), make_batch, torch.nn.functional.cross_entropy
