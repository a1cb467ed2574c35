"""``split_batch``: a global batch as per-device batch x accumulation steps x devices, the
per-device batch as large as fits, so the recipe (global batch, learning rate, schedule)
stays whatever the device holds.

Usage:
    >>> from batchwidgets import split_batch
    >>> split_batch(512, max_per_device=48, world_size=4)   # 32 x 4 steps x 4 devices
    (32, 4)
"""

from __future__ import annotations

import warnings

from ..._warnings import BatchwidgetsWarning

# NOTE [ Keeping the global batch ]
# The learning rate, warm-up and schedule were tuned for a global batch G (examples per optimizer
# update over all devices). A device that holds fewer examples than G / world_size must not
# change G: it takes micro-batches of b and accumulates k of them, b x k x world_size = G, and
# the learning rate stays (the update is the same mean gradient). b must divide G / world_size
# exactly, so b is the largest divisor of it that fits; for a G / world_size with few divisors
# (a prime, twice a prime) that can be far below what fits, and the run is slower than it needs
# to be: one warning then names a global batch near G that would use the device. This is the
# rule Hugging Face's accelerate and transformers were asked for (accelerate PR #742,
# transformers PR #33281, Ludwig #3533): the per-device batch adapts, the recipe does not.


def split_batch(global_batch_size: int, max_per_device: int,
                world_size: int = 1) -> tuple[int, int]:
    """Split a global batch into a per-device batch and gradient accumulation steps.

    ``per_device x steps x world_size == global_batch_size``, with ``per_device`` the largest
    divisor of ``global_batch_size / world_size`` that is at most ``max_per_device`` (see NOTE
    [ Keeping the global batch ]). The learning rate stays as it is: the global batch does.

    Parameters
    ----------
    global_batch_size : int
        Examples per optimizer update, over all devices.
    max_per_device : int
        The largest batch one device trains (e.g. ``find_batch``'s
        ``recommended_batch_size``).
    world_size : int
        Devices (data-parallel ranks) the global batch is spread over.

    Returns
    -------
    (per_device, steps) : tuple of int
        The batch each device runs, and the micro-steps it accumulates per update
        (``accumulate(optimizer, steps=steps)``).

    Raises
    ------
    ValueError
        A size below 1, or a global batch that the ranks cannot share evenly.

    Warns
    -----
    BatchwidgetsWarning
        When ``per_device`` is below half of ``max_per_device`` (few divisors).

    Examples
    --------
    >>> split_batch(256, max_per_device=100)
    (64, 4)
    """
    per_device, steps, advice = split(global_batch_size, max_per_device, world_size)
    if advice:
        warnings.warn(advice, BatchwidgetsWarning, stacklevel=2)
    return per_device, steps


def split(global_batch_size: int, max_per_device: int,
          world_size: int) -> tuple[int, int, str]:
    """``split_batch``'s numbers, checked, and its warning's text ("" for none)."""
    for name, value in (("global_batch_size", global_batch_size),
                        ("max_per_device", max_per_device), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} should be a positive int, but got {name}={value!r}.")
    if global_batch_size % world_size:
        low = global_batch_size // world_size * world_size
        raise ValueError(f"global_batch_size should be a multiple of world_size ({world_size}) "
                         f"so every rank takes the same share, but got global_batch_size="
                         f"{global_batch_size}; use e.g. global_batch_size="
                         f"{max(low, world_size)} or {low + world_size}.")
    per_rank = global_batch_size // world_size
    per_device = largest_divisor(per_rank, max_per_device)
    steps = per_rank // per_device
    advice = ""
    if 2 * per_device < min(max_per_device, per_rank):
        better = -(-per_rank // max_per_device) * max_per_device * world_size
        advice = (f"The per-device batch is {per_device} x {steps} steps: the largest divisor "
                  f"of {per_rank} (global_batch_size {global_batch_size} / {world_size} "
                  f"devices) up to the {max_per_device} that fits, so each step uses under "
                  f"half of what the device holds. A global batch of {better} "
                  f"({max_per_device} x {better // max_per_device // world_size} steps x "
                  f"{world_size}) would use it all.")
    return per_device, steps, advice


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (1 at least)."""
    best = 1
    d = 1
    while d * d <= n:  # divisors come in pairs (d, n // d)
        if n % d == 0:
            if d <= at_most:
                best = max(best, d)
            if n // d <= at_most:
                best = max(best, n // d)
        d += 1
    return best
