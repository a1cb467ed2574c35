"""Under torch.distributed, one outcome for every rank: each size fits only if it fit on every
rank, and the smallest memory limit of any rank is everyone's, so all ranks take the same next
step and none waits alone in a collective."""

from __future__ import annotations

import dataclasses

import torch

from ...results import Attempt


def _collective_device() -> torch.device | None:
    """Where all_reduce tensors live (CUDA for NCCL, else the CPU); None when not distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(attempt: Attempt) -> Attempt:
    """Under torch.distributed, one outcome for all ranks: fits only if it fit everywhere, and
    the largest memory and time of any rank, so every rank takes the same next step."""
    device = _collective_device()
    if device is None:
        return attempt
    values = [attempt.peak_memory_bytes, attempt.peak_reserved_bytes,
              attempt.activation_peak_bytes, attempt.step_time_s]
    # MIN of (fits, -x) is (fits everywhere, -max x); -1 stands for "not measured" (None).
    flat = torch.tensor([float(attempt.fits)] + [-(v if v is not None else -1) for v in values],
                        dtype=torch.float64, device=device)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MIN)
    fits, peak, reserved, activation, seconds = flat.tolist()
    unmeasured = 1.0
    return dataclasses.replace(  # the prediction fields are the same on every rank: kept
        attempt, fits=bool(fits),
        peak_memory_bytes=None if peak == unmeasured else int(-peak),
        peak_reserved_bytes=None if reserved == unmeasured else int(-reserved),
        step_time_s=None if seconds == unmeasured or not fits else -seconds,
        activation_peak_bytes=None if activation == unmeasured else int(-activation),
        error=attempt.error or ("" if fits else "out of memory on another rank"))


def agree_limit(limit_bytes: int | None) -> int | None:
    device = _collective_device()
    if device is None:
        return limit_bytes  # every rank takes part below, with or without a limit of its own
    value = torch.tensor([float("inf") if limit_bytes is None else float(limit_bytes)],
                         dtype=torch.float64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return None if value.item() == float("inf") else int(value.item())
