"""The built-in demo: probe a small CNN on synthetic 3x32x32 images, on the best device present.

Usage:
    python -m batchwidgets demo --budget 256MB --plot probe.png
"""

from __future__ import annotations

import torch
from torch import nn

from .engine._util import default_device
from .engine.probe import find_batch
from .results import BatchSizeReport

CPU_DEMO_BUDGET = "256MiB"  # keeps the CPU demo under a minute on 2 cores


def small_cnn(num_classes: int = 10) -> nn.Module:
    """A CIFAR-sized CNN: 3x32x32 in, ``num_classes`` logits out (about 0.3M parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def synthetic_images(batch_size: int, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels, shaped like CIFAR-10."""
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, num_classes, (batch_size,))


def run_demo(device: str | None = None, budget: str | None = None, amp: str | None = None,
             max_batch_size: int | None = None) -> BatchSizeReport:
    """Probe the demo CNN with Adam; on the CPU the budget defaults to ``CPU_DEMO_BUDGET``."""
    target = torch.device(device) if device else default_device()  # CUDA, MPS, else the CPU
    if budget is None and target.type == "cpu":
        budget = CPU_DEMO_BUDGET
    torch.manual_seed(0)
    model = small_cnn().to(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return find_batch(model, synthetic_images, loss_fn=nn.functional.cross_entropy,
                      optimizer=optimizer, device=target, budget=budget, amp=amp,
                      max_batch_size=max_batch_size)
