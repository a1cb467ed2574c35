"""``live_loader(autotune=True)``'s policy, apart from any DataLoader: from the training loop's
own numbers per setting, which setting to try next, and when to settle.

Usage:
    >>> tuner = Autotune({"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
    ...                   "persistent_workers": False}, max_workers=2, pin_memory=False)
    >>> tuner.status
    'measuring no workers (the start)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...results import LoaderSegment
from ._search import worker_ladder

Settings = dict[str, Any]  # num_workers, pin_memory, prefetch_factor, persistent_workers

# NOTE [ Judging a setting from the running loop ]
# The loop's numbers after a switch start with the switch itself: the old workers stopping, the
# new ones starting (tens of ms with fork, over a second with spawn or forkserver), then a burst:
# n fresh workers each deliver their first batch at about the same time, so the n - 1 batches
# after the first come without waiting. Counting those batches would charge a setting its
# start-up and credit it a head start it cannot keep. So a trial skips the first max(1, n)
# batches of its segment (from successive snapshots of the segment, one batch at a time), and
# again after each epoch's first batch (the workers' queue starts empty; non-persistent workers
# start afresh), then judges whole periods of max(1, n) batches: in steady state each period
# holds one burst, so the periods' wall time over their samples is the setting's cost per
# sample whatever the phase. The trial ends once it has MIN_BATCHES batches, 3 periods and
# MIN_S seconds of the loop's wall time judged. Its samples/s is the loop's (steps and waits):
# a setting that slows the step (workers taking the CPU the step needs) is charged for it.

# NOTE [ Which setting next ]
# A hill-climb from where the user started, as tf.data's AUTOTUNE retunes a running pipeline:
# - it stops as soon as the best setting's loop waits less than STALL_TARGET of its time: there
#   is little left to gain, and every trial costs a switch;
# - otherwise it tries the best setting's untried neighbours, one option at a time: more
#   num_workers (never above max_workers: the CPUs this process may use) while no setting with
#   more was measured, fewer while none with fewer was (fewer win when workers take the CPU the
#   main process needs), then prefetch_factor doubled (up to MAX_PREFETCH) where the loop
#   waited now and then (in under BURSTY of its periods: a deeper queue absorbs slow batches;
#   where it waits in every period, the workers are too slow on average and a deeper queue
#   only holds more memory), then pin_memory flipped (with CUDA only); those two only while a
#   switch costs under SLOW_SWITCH_S (workers started by spawn or forkserver take over a second
#   each time, for what is rarely more than a few percent). More workers is the next
#   rung of the ladder 0, 1, 2, 4, ..., max_workers; from no workers it is the rung that should
#   keep up: without workers the loop's wait per batch is the loading itself (L) and the rest
#   its step (S), and n workers keep up when L / n <= S, so n = ceil(L / S): one trial, not a
#   climb through the rungs below, each a switch and a trial at a slow setting;
# - a setting replaces the best only when its loop ran MIN_GAIN faster: a tie keeps the setting
#   measured first, with no more switching for noise; but a number of workers that ties the
#   best is followed one more rung the same way (a first worker gains little when the step is
#   short next to loading, since it only overlaps the two, while two gain twice; fewer workers
#   that tie show workers were not the limit, so none may win);
# - at most MAX_TRIALS settings are measured, the start included, each once: it never
#   oscillates. Then it settles: on the setting in force if it ties the best, else back on the
#   best, and gives no more advice. persistent_workers stays the user's (it matters only
#   between epochs). The only setting above max_workers it may go back to is the user's start.
STALL_TARGET = 0.05
MIN_GAIN = 0.05
MIN_BATCHES = 8
MIN_S = 0.3
MAX_PREFETCH = 8
MAX_TRIALS = 6
BURSTY = 0.5  # prefetch_factor is tried when fewer than this share of periods waited
SLOW_SWITCH_S = 0.5  # a switch this slow (spawn, forkserver): only num_workers is worth one


@dataclass(frozen=True)
class Trial:
    """One setting as the loop ran it, after its warm-up (NOTE [ Judging a setting ... ])."""

    settings: Settings
    samples_per_s: float
    stall_fraction: float
    n_batches: int  # the batches judged
    step_s: float  # per batch, outside next(): the loop's own step
    wait_s: float  # per batch, inside next()
    waited: float  # share of its periods that waited (over STALL_TARGET of their time)


def describe(settings: Settings) -> str:
    """``'2 workers, prefetch 4'``, ``'no workers, pinned'``."""
    workers = settings["num_workers"]
    parts = ["no workers" if not workers else f"{workers} worker{'s' if workers > 1 else ''}"]
    if workers:
        parts.append(f"prefetch {settings['prefetch_factor']}")
    if settings["pin_memory"]:
        parts.append("pinned")
    return ", ".join(parts)


class Autotune:
    """Advice for a live loader after each batch: the settings to switch to, or None.

    Parameters
    ----------
    settings : dict
        The settings the loop starts with (the user's): the first trial.
    max_workers : int
        Never more workers than this (the usable CPUs).
    pin_memory : bool
        Whether pin_memory may be tried (True with CUDA); otherwise it stays as it is.

    Attributes
    ----------
    status : str
        What it is doing, in a line: "exploring 2 workers, prefetch 2 (trial 2 of at most 6)",
        "settled on 2 workers, prefetch 2: 812 samples/s, stall 3% (stall under 5%; ...)".
    done : bool
        Settled: no more advice.
    best : Trial or None
        The fastest setting measured so far; ``trials``: every one, in order.
    """

    def __init__(self, settings: Settings, *, max_workers: int, pin_memory: bool,
                 stall_target: float = STALL_TARGET, min_gain: float = MIN_GAIN,
                 min_batches: int = MIN_BATCHES, min_s: float = MIN_S,
                 max_trials: int = MAX_TRIALS) -> None:
        self.start = self._valid(settings, settings["persistent_workers"])
        self.max_workers = max(0, max_workers)
        self.pin_memory = pin_memory
        self.stall_target, self.min_gain = stall_target, min_gain
        self.min_batches, self.min_s, self.max_trials = min_batches, min_s, max_trials
        self._persistent = bool(settings["persistent_workers"])
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.done = False
        self._target = self.start  # the setting measured now, or asked for and not yet in force
        self._segment: tuple[int, int] | None = None  # (epoch, batch) where the segment began
        self._last = (0, 0, 0.0, 0.0)  # the segment's n_batches, n_samples, wall_s, wait_s
        self._batches: list[tuple[float, float, int]] = []  # judged: wall_s, wait_s, samples
        self._warm = 0  # batches since the workers (re)started: a switch, an epoch
        self.switch_s = 0.0  # the slowest switch seen: the loop's wait for its first batch
        self.status = f"measuring {describe(self.start)} (the start)"

    # -- the loop's numbers -----------------------------------------------------------------------

    def advise(self, segment: LoaderSegment, batch: int | None = None) -> Settings | None:
        """Called after every batch with the segment in force (and the batch's index in its
        epoch, when known); the settings to switch to at the next batch, or None."""
        if self.done or self._key(segment.settings) != self._key(self._target):
            return None  # settled, or a switch asked for has not landed yet
        if not self._take(segment, batch):
            return None
        trial = self._judge()
        if trial is None:
            return None
        self.trials.append(trial)
        if self.best is None or self._ranks_above(trial, self.best):
            self.best = trial
        return self._switch(*self._next())

    def _take(self, segment: LoaderSegment, batch: int | None) -> bool:
        """Book the segment's latest batch; False while it warms up (NOTE [ Judging a setting
        from the running loop ]) or when there is no batch before it to tell it from."""
        key = (segment.epoch, segment.batch)
        last = self._last if key == self._segment else (0, 0, 0.0, 0.0)
        if key != self._segment:
            self._segment, self._batches, self._warm = key, [], 0
        now = (segment.n_batches, segment.n_samples, segment.wall_s, segment.wait_s)
        self._last = now
        if now[0] != last[0] + 1:  # first seen mid-segment (autotune turned on): a baseline
            return False
        if now[0] == 1 and self.trials:  # the first batch after a switch autotune asked for
            self.switch_s = max(self.switch_s, now[3])
        period = self._period(segment.settings)
        if batch == 0 and now[0] > 1:  # a new epoch: the workers' pipeline starts afresh
            del self._batches[len(self._batches) - len(self._batches) % period:]
            self._warm = 0
        self._warm += 1
        if self._warm <= period:
            return False
        self._batches.append((now[2] - last[2], now[3] - last[3], now[1] - last[1]))
        return True

    @staticmethod
    def _period(settings: Settings) -> int:
        return max(1, settings["num_workers"])

    def _judge(self) -> Trial | None:
        """The trial's numbers once it has enough batches and time; None until then."""
        period = self._period(self._target)
        batches = self._batches
        if len(batches) % period or len(batches) < max(self.min_batches, 3 * period):
            return None
        wall, wait, samples = (sum(b[i] for b in batches) for i in range(3))
        if wall < self.min_s or not samples:
            return None
        periods = [batches[i:i + period] for i in range(0, len(batches), period)]
        waited = sum(sum(b[1] for b in p) > self.stall_target * sum(b[0] for b in p)
                     for p in periods) / len(periods)
        n = len(batches)
        return Trial(dict(self._target), samples / wall if wall > 0 else 0.0,
                     min(1.0, wait / wall) if wall > 0 else 0.0, n, (wall - wait) / n,
                     wait / n, waited)

    # -- the policy -------------------------------------------------------------------------------

    def _next(self) -> tuple[Settings | None, str]:
        """The next setting to try (NOTE [ Which setting next ]), or None and why none."""
        best = self.best
        if best.stall_fraction < self.stall_target and not self.advised_against(best.settings):
            return None, f"stall under {self.stall_target:.0%}"
        if len(self.trials) >= self.max_trials:
            return None, f"{self.max_trials} settings tried"
        tried = {self._key(t.settings) for t in self.trials}
        for candidate in self._candidates(best):
            if self._key(candidate) not in tried and \
                    candidate["num_workers"] <= self.max_workers:
                return candidate, ""
        return None, "no untried neighbour of the best"

    def _candidates(self, best: Trial) -> list[Settings]:
        """The best's neighbours, then one rung on past a number of workers that tied it."""
        settings, workers = best.settings, best.settings["num_workers"]
        measured = [t.settings["num_workers"] for t in self.trials]
        up, down = self._rungs(workers)
        moves: list[Settings] = []
        if self.advised_against(settings):  # NOTE [ Advice that agrees with its warnings ]
            moves.append({"pin_memory": self.pin_memory and settings["pin_memory"],
                          "num_workers": min(workers, self.max_workers)})
        if up and max(measured) <= workers:  # nothing above measured yet
            moves.append({"num_workers": self._keeps_up(best) if workers == 0 else up[0]})
        if down and min(measured) >= workers:
            moves.append({"num_workers": down[-1]})
        cheap = self.switch_s < SLOW_SWITCH_S
        if cheap and workers and best.waited < BURSTY \
                and settings["prefetch_factor"] * 2 <= MAX_PREFETCH:
            moves.append({"prefetch_factor": settings["prefetch_factor"] * 2})
        if cheap and self.pin_memory:
            moves.append({"pin_memory": not settings["pin_memory"]})
        for trial in self.trials:
            other = trial.settings["num_workers"]
            if other != workers and self._ties(trial):
                up, down = self._rungs(other)
                moves += [{**trial.settings, "num_workers": n}
                          for n in (up[:1] if other > workers else down[-1:])]
        return [self._valid({**settings, **move}, self._persistent) for move in moves]

    def advised_against(self, settings: Settings) -> bool:
        """Whether the live loader warns to change ``settings`` (``setting_warnings``, as this
        policy knows the machine): pinned memory where it does nothing, more workers than
        ``max_workers`` (the usable CPUs in a live loader)."""
        return (settings["pin_memory"] and not self.pin_memory) or \
            settings["num_workers"] > self.max_workers

    def _ranks_above(self, trial: Trial, best: Trial) -> bool:
        """``trial`` replaces ``best``: a setting warned against never replaces one that is
        not; otherwise when it ran ``min_gain`` faster."""
        warned, best_warned = self.advised_against(trial.settings), \
            self.advised_against(best.settings)
        if warned != best_warned:
            return best_warned
        return trial.samples_per_s >= best.samples_per_s * (1 + self.min_gain)

    def _keeps_up(self, base: Trial) -> int:
        """From no workers: the rung of workers that should keep up with the step (NOTE [
        Which setting next ]); the top rung when the step takes no time."""
        ladder = worker_ladder(self.max_workers)
        needed = math.ceil(base.wait_s / base.step_s - 1e-6) if base.step_s > 0 \
            else ladder[-1]  # (1e-6: sums of floats that divide exactly stay exact)
        return next((n for n in ladder if n >= max(1, needed)), ladder[-1])

    def _ties(self, trial: Trial) -> bool:
        """Within ``min_gain`` of the best: the same speed, as far as the loop can tell."""
        return trial.samples_per_s * (1 + self.min_gain) > self.best.samples_per_s

    def _rungs(self, workers: int) -> tuple[list[int], list[int]]:
        """The ladder's rungs above and below ``workers``."""
        ladder = worker_ladder(self.max_workers)
        return [n for n in ladder if n > workers], [n for n in ladder if n < workers]

    @staticmethod
    def _valid(settings: Settings, persistent: bool) -> Settings:
        """The four settings as the live loader keeps them (none of the workers' options
        without workers; prefetch_factor 2 by default with them)."""
        workers = settings["num_workers"]
        return {"num_workers": workers, "pin_memory": bool(settings["pin_memory"]),
                "prefetch_factor": (settings["prefetch_factor"] or 2) if workers else None,
                "persistent_workers": persistent if workers else False}

    @staticmethod
    def _key(settings: Settings) -> tuple:
        return (settings["num_workers"], settings["pin_memory"], settings["prefetch_factor"],
                settings["persistent_workers"])

    def _switch(self, candidate: Settings | None, why: str) -> Settings | None:
        """Ask for ``candidate``; with none left, settle: on the setting in force when it ties
        the best (no switch for nothing), else back on the best."""
        current = self.trials[-1]
        if candidate is None:
            self.done = True
            keep = current if self._ties(current) and not self.advised_against(
                current.settings) else self.best
            self._target = keep.settings
            self.status = (f"settled on {describe(keep.settings)}: "
                           f"{keep.samples_per_s:.4g} samples/s, stall "
                           f"{keep.stall_fraction:.0%} ({why}; {len(self.trials)} "
                           f"setting{'s' if len(self.trials) > 1 else ''} tried)")
            return None if keep is current else dict(keep.settings)
        self._target = candidate
        self.status = (f"exploring {describe(candidate)} (trial {len(self.trials) + 1} of at "
                       f"most {self.max_trials})")
        return dict(candidate)
