"""Simulated training loops over a loader whose samples/s is a known function of its settings:
what the autotune policy is tested on (tests/engine/loader/test_autotune.py) and what the loader
advice's reports are built from (tests/results/test_advice.py)."""

from __future__ import annotations

import random

from batchwidgets.engine.loader._autotune import Autotune
from batchwidgets.results import LoaderSegment

BATCH = 16


def start(num_workers=0, prefetch_factor=None, pin_memory=False, persistent_workers=False):
    return {"num_workers": num_workers, "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor if num_workers else None,
            "persistent_workers": persistent_workers if num_workers else False}


class SimLoop:
    """A training loop of ``step_s`` per step over a loader that costs ``cost(settings)`` seconds
    per batch in steady state (the loop's period: step and wait). As real workers do, a switch
    (and each epoch's start, every ``epoch`` batches) makes the next batch wait ``startup_s``
    more, and n workers deliver in bursts: the first batch of every n waits for all n, the
    other n - 1 come free. With ``every`` > 1 the waits come in lumps: one period in ``every``
    waits ``every`` times as long, the others not at all (the same mean). ``noise`` scales each
    wait by a random factor in [1 - noise, 1 + noise] (seeded)."""

    def __init__(self, cost, step_s=0.01, startup_s=0.2, noise=0.0, seed=0, epoch=None,
                 every=1):
        self.cost, self.step_s, self.startup_s = cost, step_s, startup_s
        self.noise, self.random = noise, random.Random(seed)
        self.epoch, self.every = epoch, every

    def wait(self, settings: dict, since: int) -> float:
        period = max(1, settings["num_workers"])
        if since % period:
            return 0.0
        lump = (since // period) % self.every == 0
        wait = (self.cost(settings) - self.step_s) * period * (self.every if lump else 0)
        return wait * (1 + self.random.uniform(-self.noise, self.noise))

    def run(self, tuner: Autotune, settings: dict, batches: int = 2000, first: int = 0):
        """Feed ``tuner`` a snapshot of the segment in force after every batch from batch
        ``first`` on, switching as it advises; the advice given, in order."""
        advice_given, since = [], 0
        segment = {"settings": dict(settings), "n_batches": 0, "n_samples": 0, "wall_s": 0.0,
                   "wait_s": 0.0, "epoch": 0, "batch": 0}
        for i in range(batches):
            position = i % self.epoch if self.epoch else i
            if position == 0 and i > 0:
                since = 0  # a new epoch: the workers' queue starts empty
            wait = self.wait(segment["settings"], since) + (
                self.startup_s if since == 0 and i > 0 else 0.0)
            since += 1
            segment.update(n_batches=segment["n_batches"] + 1,
                           n_samples=segment["n_samples"] + BATCH,
                           wall_s=segment["wall_s"] + wait + self.step_s,
                           wait_s=segment["wait_s"] + wait)
            if i < first:
                continue
            advice = tuner.advise(LoaderSegment(**dict(segment, settings=dict(
                segment["settings"]))), batch=position if self.epoch else None)
            if advice:
                advice_given.append(advice)
                since, j = 0, i + 1
                segment = {"settings": dict(advice), "n_batches": 0, "n_samples": 0,
                           "wall_s": 0.0, "wait_s": 0.0,
                           "epoch": j // self.epoch if self.epoch else 0,
                           "batch": j % self.epoch if self.epoch else j}
        return advice_given


def cpu_bound(load_s=0.08, cores=4, step_s=0.01):
    """Loading a batch takes ``load_s`` of one core: the main process does it between steps
    without workers; n workers share ``cores`` and feed one batch every load_s / n."""
    def cost(settings):
        workers = settings["num_workers"]
        if workers == 0:
            return step_s + load_s
        return max(step_s, load_s / min(workers, cores))
    return cost
