"""A small float64 classification set and MLP, seeded: what the noise tests measure
(tests/engine/noise/test_noise.py) and what the one-story cases build their noise reports from
(tests/results/test_reports_one_story_cases.py)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_data(n, dim=5, classes=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
