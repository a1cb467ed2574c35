"""Small synthetic datasets for tutorials and tests: torch only, importable by DataLoader workers
under every start method (fork, spawn, forkserver), so their classes pickle by reference.

Usage:
    >>> from batchwidgets.datasets import SlowDataset
    >>> data = SlowDataset(64, shape=(3, 32, 32), work_ms=2.0)   # about 2 ms of CPU per sample
    >>> image, label = data[5]
    >>> tuple(image.shape), label
    ((3, 32, 32), 5)
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

CALIBRATION_ROUNDS = 64  # rounds timed once to turn work_ms into a number of rounds
NUM_CLASSES = 10


def _augment(image: torch.Tensor, rounds: int) -> torch.Tensor:
    """A fixed amount of CPU work on one image, standing in for decoding and augmenting it: each
    round blurs the image a little along its first and last axes (small ops, one thread each)."""
    for _ in range(rounds):
        image = 0.5 * image + 0.25 * (image.roll(1, -1) + image.roll(1, 0))
    return image


def _seconds_per_round(shape: tuple[int, ...]) -> float:
    image = torch.zeros(shape)
    _augment(image, CALIBRATION_ROUNDS)  # the first calls of each op are slow: warm up first
    timings = []
    for _ in range(3):
        start = time.thread_time()  # CPU time of this thread: the same on a busy machine
        _augment(image, CALIBRATION_ROUNDS)
        timings.append(time.thread_time() - start)
    return max(min(timings), 1e-9) / CALIBRATION_ROUNDS


class SlowDataset(Dataset):
    """``n`` seeded random images with labels, each costing about ``work_ms`` of CPU to read.

    The work per sample is a fixed number of rounds of a small blur, measured once when the
    dataset is made (``work_ms`` is CPU time on this machine), so a worker process does the same
    work as the main process and extra workers only help while there are free CPU cores. The
    values depend only on ``seed`` and the index, never on the timing.

    Parameters
    ----------
    n : int
        Number of samples.
    shape : tuple of int
        Shape of one image, for example ``(3, 32, 32)``.
    work_ms : float
        CPU time to spend on each sample, in milliseconds (0 for none).
    seed : int
        Seed of the images: ``data[i]`` is the same in every process and every run.
    rounds : int, optional
        The number of blur rounds per sample, instead of measuring ``work_ms``.

    Examples
    --------
    >>> SlowDataset(8, shape=(4,), work_ms=0)[3][1]
    3
    """

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), work_ms: float = 1.0, *,
                 seed: int = 0, rounds: int | None = None) -> None:
        if n < 1:
            raise ValueError(f"n should be >= 1, but got n={n!r}; pass the number of samples.")
        if work_ms < 0:
            raise ValueError(f"work_ms should be >= 0, but got work_ms={work_ms!r}.")
        self.n, self.shape, self.seed = n, tuple(shape), seed
        if rounds is None:
            rounds = 0 if work_ms == 0 else round(work_ms / 1000 / _seconds_per_round(self.shape))
        self.rounds = max(0, int(rounds))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} is out of range for SlowDataset of {self.n}")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(self.shape, generator=generator)
        _augment(image.clone(), self.rounds)  # the work; the sample stays the seeded image
        return image, index % NUM_CLASSES

    def __repr__(self) -> str:
        return f"SlowDataset({self.n}, shape={self.shape}, rounds={self.rounds}, seed={self.seed})"
