"""Stop in the middle of a step: ``should_stop`` polled between ops, not only between sizes.

Usage:
    >>> with stop_between_ops(event.is_set, device):   # doctest: +SKIP
    ...     trainer.attempt(size)                      # raises StepStopped once event is set
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POLL_S = 0.05  # should_stop is asked at most this often: a user's callable may not be cheap

# NOTE [ Stopping mid-step ]
# A Stop button that waits for the running size to finish can take as long as a whole trial
# (49 s on a CPU with a large model). So while a size runs, ``should_stop`` is polled between
# ops, at most every POLL_S, and a yes raises StepStopped out of the step. The step unwinds as
# after an out-of-memory error: the trial's ``finally`` restores the model, optimizer and RNGs
# (the TrainingState snapshot), and the search ends with the sizes it finished, as a stop between
# sizes ends it; the size it stopped in is not an attempt. Where ops are seen:
# - tensors that are not on a real CUDA device (the CPU, the simulated CUDA device, fake
#   tensors): a dispatch mode, which sees every op, forward, backward and the optimizer step;
# - a real CUDA device: global module forward hooks only, which cost nothing per op, so the
#   timed steps near the boundary keep their speed. CUDA ops are queued far faster than they
#   run, so a stop waits at most for the queued work (``synchronize`` in the trial's end).
# Inside a job (torchrun) no rank stops alone: ranks agree on a stop between sizes.
# The dispatch mode asks only at ops that compute (aten's, not a query of a tensor's metadata):
# on fake tensors C++ asks Python for a tensor's device, sizes and strides (prim.device,
# aten.sym_size, aten.is_contiguous) where no exception may pass, and StepStopped raised there
# ended the process ("terminate called after throwing an instance of 'python_error'").


class StepStopped(Exception):
    """``should_stop`` said yes in the middle of a step."""


class _Poll:
    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self.should_stop, self.next_s = should_stop, 0.0

    def __call__(self, *_: Any) -> None:
        now = time.monotonic()
        if now >= self.next_s:
            self.next_s = now + POLL_S
            if self.should_stop():
                raise StepStopped("stopped by should_stop in the middle of a step")


class _BetweenOps(TorchDispatchMode):
    def __init__(self, poll: _Poll) -> None:
        super().__init__()
        self.poll = poll

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _computes(func):
            self.poll()
        return func(*args, **(kwargs or {}))


_QUERIES = ("dim", "size", "stride", "numel", "storage_offset")


def _computes(func: Any) -> bool:
    """An op that computes, where an exception may be raised; not a query of a tensor's metadata
    that C++ makes through Python."""
    name = func._opname
    return (func.namespace == "aten" and name not in _QUERIES
            and not name.startswith(("sym_", "is_")))


@contextlib.contextmanager
def stop_between_ops(should_stop: Callable[[], bool] | None,
                     device: torch.device) -> Iterator[None]:
    """Raise StepStopped out of the code inside once ``should_stop()`` says yes (NOTE
    [ Stopping mid-step ]); nothing is installed without ``should_stop``."""
    if should_stop is None:
        yield
        return
    poll = _Poll(should_stop)
    if device.type == "cuda" and torch.cuda.is_available():
        hooks = torch.nn.modules.module
        handles = [hooks.register_module_forward_pre_hook(poll),
                   hooks.register_module_forward_hook(poll)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        return
    with _BetweenOps(poll):
        yield
