"""Memory backends for the probe: CUDA reads its caching allocator and caps the process with
``set_per_process_memory_fraction``; CPU and MPS count the live tensor bytes of each step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import _memory

CPU_DEFAULT_FRACTION = 0.5  # without a budget, the CPU probe may use half of the available RAM


@dataclass
class Reading:
    peak_bytes: int = 0
    peak_reserved_bytes: int | None = None
    activation_peak_bytes: int | None = None  # forward+backward only; see NOTE [ Two phases ]


# NOTE [ Two phases ]
# A training step's peak is max(forward+backward, optimizer step). The second is nearly constant
# in the batch size (gradients, optimizer state and its temporaries), so at small sizes it hides
# the per-sample growth and a line fitted on whole-step peaks predicts nonsense. The model form
# marks the end of backward; the meter keeps that phase's peak apart, and the search fits on it.


class TensorMeter:
    """Counts tensor storages on the device; the budget is enforced op by op."""

    def __init__(self, device: torch.device, budget_bytes: int | None) -> None:
        self.device = device
        self.limit_bytes = budget_bytes if budget_bytes is not None else self._default_limit()
        self.baseline_bytes: int | None = None
        self._tracker: _memory.TensorMemoryTracker | None = None
        self._reading = Reading()

    def _default_limit(self) -> int | None:
        if self.device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
            return int(torch.mps.recommended_max_memory())
        available = _memory.available_memory_bytes()  # cgroup and ulimit included
        if available is None and hasattr(os, "sysconf"):
            try:
                available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                available = None
        return None if available is None else int(CPU_DEFAULT_FRACTION * available)

    @contextmanager
    def capped(self) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        if self.device.type == "mps":
            torch.mps.synchronize()

    def end_forward_backward(self) -> None:
        tracker, reading = self._tracker, self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0, tracker.peak_bytes)
        reading.peak_bytes = max(reading.peak_bytes, tracker.peak_bytes)
        tracker.reset_peak()

    @contextmanager
    def measure(self, tracked: list) -> Iterator[Reading]:
        reading = self._reading = Reading()
        tracker = self._tracker = _memory.TensorMemoryTracker(self.device, self.limit_bytes,
                                                              tracked)
        if self.baseline_bytes is None:
            self.baseline_bytes = tracker.baseline_bytes
        try:
            with tracker:
                yield reading
        finally:
            reading.peak_bytes = max(reading.peak_bytes, tracker.peak_bytes)
            self._tracker = None


class CudaMeter:
    """Peak allocated and reserved bytes from the caching allocator; the budget caps the process."""

    def __init__(self, device: torch.device, budget_bytes: int | None) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.budget_bytes = budget_bytes
        self.total_bytes = torch.cuda.get_device_properties(device).total_memory
        free, _ = torch.cuda.mem_get_info(device)
        reachable = free + torch.cuda.memory_reserved(device)
        self.limit_bytes = min(budget_bytes, reachable) if budget_bytes else reachable
        self.baseline_bytes: int | None = None
        self._reading = Reading()

    @contextmanager
    def capped(self) -> Iterator[None]:
        if self.budget_bytes is None:
            yield
            return
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = getter(self.device) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, self.budget_bytes / self.total_bytes), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _fold_peaks(self) -> None:
        reading = self._reading
        reading.peak_bytes = max(reading.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        reading.peak_reserved_bytes = max(reading.peak_reserved_bytes or 0,
                                          torch.cuda.max_memory_reserved(self.device))

    def end_forward_backward(self) -> None:
        reading = self._reading
        reading.activation_peak_bytes = max(reading.activation_peak_bytes or 0,
                                            torch.cuda.max_memory_reserved(self.device))
        self._fold_peaks()
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def measure(self, tracked: list) -> Iterator[Reading]:
        del tracked  # the allocator sees everything already
        reading = self._reading = Reading(peak_reserved_bytes=0)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.baseline_bytes is None:
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        try:
            yield reading
        finally:
            self._fold_peaks()


def make_meter(device: torch.device, budget_bytes: int | None) -> TensorMeter | CudaMeter:
    if device.type == "cuda":
        return CudaMeter(device, budget_bytes)
    return TensorMeter(device, budget_bytes)
