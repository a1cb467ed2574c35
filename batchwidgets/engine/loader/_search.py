"""tune_loader's search policy, apart from any DataLoader: which setting to measure next.

Usage:
    >>> next_setting([], max_workers=4)
    {'num_workers': 0, 'pin_memory': False, 'prefetch_factor': None, 'persistent_workers': False}
    >>> worker_ladder(6), grid_size(6, accelerator=True)
    ([0, 1, 2, 4, 6], 34)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...results import LoaderTrial

Setting = dict[str, object]  # DataLoader keyword arguments: the four options searched
Key = tuple[int, bool, "int | None", bool]

PREFETCH_FACTORS = (2, 4)  # 2 is DataLoader's default

# NOTE [ Where the search starts ]
# With no workers the main process loads and collates each batch itself, so the no-worker trial
# measures the per-batch cost of the data, t0 = 1 / batches_per_s. With workers the main process
# still receives every batch (queue, unpickling, mapping the tensors out of shared memory) and
# copies it to the device: about MAIN_OVERHEAD_S plus bytes / SHM_BYTES_PER_S per batch. The
# workers keep up when n / t0 >= 1 / that, so the search starts at n = ceil(t0 / that), rounded
# up to the ladder and capped at max_workers; it then climbs the ladder while a step up gains at
# least `threshold`, and looks one rung down when throughput grew less than in proportion to the
# workers (the main process or the CPUs, not the workers, were the limit there).
MAIN_OVERHEAD_S = 1e-3  # per batch received from a worker (order of magnitude on a CPU core)
SHM_BYTES_PER_S = 2e9  # reading a batch's tensors out of shared memory

# The search stops after this share of the grid's settings (at least MIN_TRIALS) even when it
# could go on: the goal is the best setting within 5% in at most 40% of the full grid's time.
TRIAL_SHARE = 0.35
MIN_TRIALS = 3


def worker_ladder(max_workers: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``max_workers`` (which is always on it)."""
    ladder, n = [0], 1
    while n < max_workers:
        ladder.append(n)
        n *= 2
    return [*ladder, max_workers] if max_workers > 0 else ladder


def setting(num_workers: int, pin_memory: bool, prefetch_factor: int | None = 2,
            persistent_workers: bool = False) -> Setting:
    """A valid setting (no prefetch_factor and no persistence without workers)."""
    if num_workers == 0:
        prefetch_factor, persistent_workers = None, False
    return {"num_workers": num_workers, "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}


def full_grid(max_workers: int, accelerator: bool = False) -> list[Setting]:
    """Every distinct setting: num_workers on the ladder x pin_memory (True only with an
    accelerator) x prefetch_factor {2, 4} x persistent_workers (the last two need workers)."""
    pins = (False, True) if accelerator else (False,)
    grid, seen = [], set()
    for workers in worker_ladder(max_workers):
        for pin in pins:
            for prefetch in PREFETCH_FACTORS:
                for persistent in (False, True):
                    candidate = setting(workers, pin, prefetch, persistent)
                    if _key(candidate) not in seen:
                        seen.add(_key(candidate))
                        grid.append(candidate)
    return grid


def grid_size(max_workers: int, accelerator: bool = False) -> int:
    return len(full_grid(max_workers, accelerator))


def default_max_trials(max_workers: int, accelerator: bool = False) -> int:
    return max(MIN_TRIALS, int(TRIAL_SHARE * grid_size(max_workers, accelerator)))


def _key(s: Setting | LoaderTrial) -> Key:
    if isinstance(s, LoaderTrial):
        return s.num_workers, s.pin_memory, s.prefetch_factor, s.persistent_workers
    return s["num_workers"], s["pin_memory"], s["prefetch_factor"], s["persistent_workers"]


def start_workers(base: LoaderTrial, ladder: Sequence[int]) -> int:
    """Workers that should keep up (NOTE [ Where the search starts ])."""
    if not base.batches_per_s or len(ladder) == 1:
        return ladder[-1]
    per_batch_s = 1 / base.batches_per_s
    receive_s = MAIN_OVERHEAD_S + base.bytes_per_batch / SHM_BYTES_PER_S
    needed = max(1, math.ceil(per_batch_s / receive_s))
    return next((n for n in ladder if n >= needed), ladder[-1])


def _speed(trial: LoaderTrial) -> float:
    return trial.samples_per_s if trial.ok else 0.0


def _worker_step(rates: dict[int, float], ladder: list[int], threshold: float) -> int | None:
    """One step of the climb over num_workers (NOTE [ Where the search starts ])."""
    best = max(rates, key=lambda w: (rates[w], -w))
    if best == 0:  # workers lost so far: look below the fewest tried, down to one worker
        fewest = min((w for w in rates if w > 0), default=0)
        lower = ladder[ladder.index(fewest) - 1] if fewest else 0
        return lower if lower > 0 else None
    i = ladder.index(best)
    lower = max(w for w in rates if w < best)  # 0 is always tried
    gain = rates[best] / rates[lower] - 1 if rates[lower] > 0 else math.inf
    if i + 1 < len(ladder) and ladder[i + 1] not in rates and gain >= threshold:
        return ladder[i + 1]
    # linear: each worker added its share of the rate, so fewer workers would be slower
    linear = rates[best] >= (1 - threshold) * rates[lower] * best / max(lower, 1)
    if ladder[i - 1] > 0 and ladder[i - 1] not in rates and not linear:
        return ladder[i - 1]
    return None


def next_setting(history: Sequence[LoaderTrial], *, max_workers: int, accelerator: bool = False,
                 threshold: float = 0.05, max_trials: int | None = None) -> Setting | None:
    """The next setting to measure, or None when the search is done.

    First no workers (the per-batch cost), then the number of workers that should keep up,
    then up or down the ladder of num_workers while that gains ``threshold`` or more, then, at
    the best number of workers, pin_memory flipped (with an accelerator), persistent_workers
    (only when an epoch ended inside a measurement: otherwise it cannot show) and
    prefetch_factor 4. At most ``max_trials`` settings (default ``default_max_trials``).
    Failed trials count as 0 samples/s.
    """
    if max_trials is None:
        max_trials = default_max_trials(max_workers, accelerator)
    if len(history) >= max_trials:
        return None
    if not history:
        return setting(0, accelerator)
    ladder = worker_ladder(max_workers)
    base = next((t for t in history if t.num_workers == 0 and t.ok), None)
    if base is None:
        return None
    climb = {t.num_workers: _speed(t) for t in history
             if _key(t) == _key(setting(t.num_workers, accelerator))}
    workers_fail = any(t.num_workers and not t.ok for t in history)  # more will not help
    start = start_workers(base, ladder)
    if start not in climb and not workers_fail:
        return setting(start, accelerator)
    workers = None if workers_fail else _worker_step(climb, ladder, threshold)
    if workers is not None:
        return setting(workers, accelerator)
    return _toggle(history, accelerator)


def _toggle(history: Sequence[LoaderTrial], accelerator: bool) -> Setting | None:
    """One option changed at the best setting so far, each option once: pin_memory, then
    persistent_workers, then prefetch_factor."""
    best = max((t for t in history if t.ok), key=_speed)
    options = []
    if accelerator and all(t.pin_memory for t in history):
        options.append({"pin_memory": False})
    if best.num_workers and any(t.n_epoch_ends for t in history) \
            and not any(t.persistent_workers for t in history):
        options.append({"persistent_workers": True})
    if best.num_workers and not any(t.prefetch_factor == 4 for t in history):
        options.append({"prefetch_factor": 4})
    if not options:
        return None
    return setting(**{**setting(best.num_workers, best.pin_memory, best.prefetch_factor,
                                best.persistent_workers), **options[0]})
