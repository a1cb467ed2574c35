"""batchwidgets' own training steps, marked on their thread: code that intercepts the user's
training calls (an ``accumulate`` block) lets them through untouched.

Usage:
    >>> with own_steps():
    ...     in_own_steps()
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCAL = threading.local()  # _LOCAL.depth: own_steps() blocks open on this thread


# NOTE [ Own steps ]
# find_batch may run inside a user's `with accumulate(...)` block (a %%accumulate cell that probes
# first). Its trial steps call optimizer.step() and backward(), which the block would count as
# the user's micro-steps, leaving gradients behind. The probe marks its steps here, and the
# accumulator asks `in_own_steps()` before it takes a call. Neither capability imports the other:
# both import this module, which imports nothing of theirs.
@contextmanager
def own_steps() -> Iterator[None]:
    """Inside, on this thread, the training calls are batchwidgets' own (see NOTE [ Own steps ])."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def in_own_steps() -> bool:
    """Whether this thread runs batchwidgets' own steps now."""
    return getattr(_LOCAL, "depth", 0) > 0
