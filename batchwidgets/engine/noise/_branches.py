"""The branches ``critical_batch`` runs: one snapshot of the weights and optimizer state, a run
from it at a batch and learning rate until a target loss (``_Runner``), the default target
(``_default_target``), one rung of the ladder with its learning-rate search (``_rung``), the fit
of S(B) (``_fit``) and Merrill et al.'s equal-examples criterion (``_loss_criterion``). The rules
are NOTE [ The critical batch, measured ] in ``_critical.py``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...results import Branch
from .._batches import batch_length, collate_items, forward_and_loss
from .._called import called_at, calling, describe, scalar_hint
from .._util import to_device

MAX_BACKOFFS = 4  # a diverging branch runs again at half the learning rate, this many times
UPWARD = 3  # a branch that reached the target at its first rate tries twice it, this many times
BLOWUP = 2.0  # a branch whose evaluated loss passes BLOWUP x the starting loss has diverged
TARGET_SHARE = 0.9  # the default target: this share of the way to the base's loss after its run
FIT_GRID = 2000  # points of the log grid B_noise is fitted on (0.5% apart over 10^4 x ladder)
EVALS_PER_DOUBLING = 4  # the loss is evaluated at every step up to 4, then every step // 4
TAIL = 8  # the base's run that sets the target: the mean and spread of its last TAIL losses
NOISE_SIGMAS = 3.0  # ... whose descent must pass this many spreads, else it runs longer
LONGER = 4  # ... up to this many times base_steps
FASTEST = 4  # doubling the batch or the rate divides the steps by 2 at most: evaluations start
# at the steps of the batch below (or of the rate below) / FASTEST, a margin of 2


# What PyTorch's schedulers compute a rate from: in the param groups (OneCycleLR: initial_lr,
# max_lr, min_lr) and on the scheduler (LambdaLR and Hugging Face's warm-ups: base_lrs; CyclicLR:
# max_lrs), through SequentialLR and ChainedScheduler to the schedulers inside.
GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")
SCHEDULER_RATES = ("base_lrs", "max_lrs")


def _scale_rates(optimizer: torch.optim.Optimizer, scheduler, scale: float) -> None:
    """Every rate the optimizer and its schedule compute from, times ``scale``: a branch runs
    the user's schedule at ``scale`` x its rates (a LambdaLR scaled in its lr alone would put the
    user's rate back at its first step)."""
    for group in optimizer.param_groups:
        for key in GROUP_RATES:
            if isinstance(group.get(key), (float, int, torch.Tensor)):
                group[key] = group[key] * scale
    pending = [scheduler] if scheduler is not None else []
    while pending:
        current = pending.pop()
        pending += getattr(current, "_schedulers", [])
        for name in SCHEDULER_RATES:
            values = getattr(current, name, None)
            if isinstance(values, list):
                setattr(current, name, [v * scale for v in values])


class _Outcome(NamedTuple):
    steps: int | None  # the step whose evaluation first reached the target; None: not reached
    at: float | None  # the steps to the target, interpolated between the last two evaluations
    loss: float  # the last loss evaluated
    diverged: bool
    tail: tuple[float, ...] = ()  # the losses at the last steps, when asked for
    early: bool = False  # reached at the first evaluation after a floor: where is not known


class _Runner:
    """Branches from one snapshot: train at a batch and learning rate until a target loss."""

    def __init__(self, model, optimizer, loss_fn, scheduler, items, eval_items, device,
                 collate, fits, restore):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.restore = restore  # back to the snapshot every branch starts from
        self.scheduler, self.items, self.device = scheduler, items, device
        self.collate, self.fits = collate, fits
        chunk = min(256, fits or 256)
        self.eval_batches = [to_device(collate_items(collate, eval_items[i:i + chunk],
                                                     "critical_batch"), device)
                             for i in range(0, len(eval_items), chunk)]
        self.eval_size = len(eval_items)
        self.lrs = [group["lr"] for group in optimizer.param_groups]
        self.examples = self.examples_eval = 0  # all spent, and of them the evaluations'
        self.rng_devices = [device.index or 0] if device.type == "cuda" else []

    def loss(self) -> float:
        """The mean loss on the evaluation sample, in eval mode (dropout off: a loss that does
        not wander with its masks), the modules' modes put back after."""
        self.examples += self.eval_size
        self.examples_eval += self.eval_size
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        total = 0.0
        try:  # draws nothing from the training's generators: a run is the same, however looked at
            with torch.no_grad(), torch.random.fork_rng(self.rng_devices):
                for batch in self.eval_batches:
                    size = batch_length(batch)
                    with called_at("critical_batch", size, fake=False):
                        total += float(forward_and_loss(self.model, batch, self.loss_fn,
                                                        surrogate=False)) * size
        finally:
            for module, training in modes:
                module.training = training
        return total / self.eval_size

    def micro_batches(self, batch_size: int) -> int:
        return -(-batch_size // self.fits) if self.fits else 1

    def step(self, picked: list[int]) -> float:
        """The gradient of the batch ``picked`` into ``.grad``, in micro-batches of at most
        ``fits`` (each loss weighted by its share of the batch, as ``accumulate`` does); its
        loss (inf when not finite: the rest is not run)."""
        parts = self.micro_batches(len(picked))
        size = -(-len(picked) // parts)
        total = 0.0
        for start in range(0, len(picked), size):
            part = picked[start:start + size]
            batch = to_device(self.collate([self.items[i] for i in part]), self.device)
            with called_at("critical_batch", len(part), fake=False):
                loss = forward_and_loss(self.model, batch, self.loss_fn, surrogate=False)
                value = float(loss.detach()) if loss.numel() == 1 else 0.0
                if not math.isfinite(value):
                    return math.inf
                total += value * len(part) / len(picked)
                what, hint = f"loss.backward() on {describe(loss)}", scalar_hint(loss)
                with calling(lambda what=what: what, lambda error, hint=hint: hint):
                    (loss * (len(part) / len(picked)) if parts > 1 else loss).backward()
        return total

    def descend(self, batch_size: int, scale: float, seed: int, steps: int,
                start: float) -> tuple[float, ...] | None:
        """The losses evaluated at the last ``TAIL`` of ``steps`` steps (None: it blew up)."""
        outcome = self.run(batch_size, scale, seed, steps, 0, None, start, tail=TAIL)
        return None if outcome.diverged else outcome.tail

    def run(self, batch_size: int, scale: float, seed: int, max_steps: int, every: int,
            target: float | None, start: float, tail: int = 0, floor: int = 0) -> _Outcome:
        """Train from the restored state until the evaluated loss reaches ``target``; the loss
        is evaluated at every step up to ``every``, then every step // every (every=0: at the
        end only), from step ``floor`` on, and at each of the last ``tail`` steps."""
        self.restore()
        _scale_rates(self.optimizer, self.scheduler, scale)
        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # dropout's masks too: a run again is the same run
        order: list[int] = []
        last, before = start, (0, start)  # the last evaluation, and the one before it
        losses: list[float] = []
        for step in range(1, max_steps + 1):
            if len(order) < batch_size:
                order += torch.randperm(len(self.items), generator=generator).tolist()
            picked, order = order[:batch_size], order[batch_size:]
            self.optimizer.zero_grad(set_to_none=True)
            trained = self.step(picked)  # the batch's loss before this step: free
            if not math.isfinite(trained):
                return _Outcome(None, None, math.inf, True)
            if step == 1:  # in train mode (dropout) the batches' loss may sit above start's
                usual = max(start, trained)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.examples += batch_size
            if ((every and step >= floor and step % max(1, step // every) == 0)
                    or step == max_steps or step > max_steps - tail
                    or (every and trained > BLOWUP * usual)):  # blowing up? look now
                last = self.loss()
                if not math.isfinite(last) or last > BLOWUP * start:
                    return _Outcome(None, None, last, True)
                if step > max_steps - tail:
                    losses.append(last)
                if target is not None and last <= target:
                    # where the line between the last two evaluations crosses the target
                    (p, loss_p), drop = before, before[1] - last
                    at = p + (step - p) * (loss_p - target) / drop if drop > 0 else step
                    return _Outcome(step, at, last, False, early=p == 0 and step > 1)
                before = (step, last)
        return _Outcome(None, None, last, False, tuple(losses))


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(S_min, B_noise) of S = S_min (1 + B_noise / B) from (batch, steps), least squares in
    log S (each batch's steps counted to the same relative precision); None with fewer than
    two batches. B_noise is searched on a log grid from a hundredth of the smallest batch to a
    hundred times the largest: an answer at an end (steps that fall as fast as the batch
    grows, or do not fall) is past the ladder, which the caller reports as a bound."""
    if len({b for b, _ in points}) < 2:
        return None
    low, high = min(b for b, _ in points) / 100, max(b for b, _ in points) * 100
    best = (math.inf, 0.0, 0.0)
    for i in range(FIT_GRID + 1):
        b_noise = low * (high / low) ** (i / FIT_GRID)
        logs = [math.log(s) - math.log1p(b_noise / b) for b, s in points]
        log_min = statistics.fmean(logs)
        error = sum((v - log_min) ** 2 for v in logs)
        if error < best[0]:
            best = (error, b_noise, math.exp(log_min))
    return best[2], best[1]


def _default_target(runner: _Runner, base: int, base_steps: int,
                    start: float) -> tuple[float | None, float, str, int]:
    """(the target, the base's learning-rate scale, why there is none, the base's steps that
    set it): 90% of the way to the mean of the base's last ``TAIL`` losses after
    ``base_steps``, at the optimizer's rate halved while it blows up or does not descend, and
    run twice as long (up to ``LONGER`` times) while the descent is within ``NOISE_SIGMAS`` of
    the losses' spread (NOTE [ The critical batch, measured ])."""
    scale, steps = 1.0, base_steps
    for _ in range(MAX_BACKOFFS + 1):
        tail = runner.descend(base, scale, 0, steps, start)
        if tail is None or not statistics.fmean(tail) < start:
            scale /= 2
            continue
        reached, spread = statistics.fmean(tail), statistics.stdev(tail)
        if start - reached > NOISE_SIGMAS * spread:
            return reached + (1 - TARGET_SHARE) * (start - reached), scale, "", steps
        if steps >= LONGER * base_steps:
            return None, scale, (
                f"the base batch's loss after {steps} steps ({reached:.4g} ± {spread:.2g} over "
                f"its last {TAIL} steps) is within the noise of the start ({start:.4g}): no "
                f"target to measure against; give target_loss= below it, or a larger "
                f"base_steps"), steps
        steps *= 2
    return None, scale, (f"the base batch did not lower the loss at any learning rate tried "
                         f"(down to {runner.lrs[0] * scale * 2:.3g})"), steps


def _rung(runner: _Runner, branches: list[Branch], batch: int, scale: float, seed: int,
          max_steps: int, target: float, start: float, below: float | None,
          climb: bool = True, like: float | None = None
          ) -> tuple[tuple[float, float] | None, float | None]:
    """One batch of the ladder: ((steps to target, scale) of its fastest try or None, the
    scale of its last try that did not blow up). Halved while it blows up or takes more steps
    than the batch below (``below``); from a first try that reached the target, doubled while
    that takes fewer steps where ``climb`` (the rung below went up too, or the base), and at the
    base then halved while that takes fewer. Evaluations start at a quarter of ``below`` (or of
    ``like``, an earlier seed's steps at this batch). NOTE [ The critical batch, measured ]."""
    best: tuple[float, float] | None = None
    calm = None

    def attempt(rate: float, limit: int = max_steps, floor: int = 0) -> _Outcome:
        outcome = runner.run(batch, rate, seed, limit, EVALS_PER_DOUBLING, target, start,
                             floor=floor)
        if outcome.early:  # reached before the floor's first evaluation: again, from step 1
            outcome = runner.run(batch, rate, seed, limit, EVALS_PER_DOUBLING, target, start)
        branches.append(Branch(batch, runner.lrs[0] * rate, outcome.steps,
                               outcome.steps * batch if outcome.steps else None,
                               outcome.diverged, seed, runner.micro_batches(batch),
                               None if outcome.diverged else outcome.loss, outcome.at))
        return outcome

    known = below if below is not None else like  # steps this one is unlikely to beat by 2x
    floor = int(known / FASTEST) if known is not None else 0
    initial = scale
    for _ in range(MAX_BACKOFFS + 1):
        outcome = attempt(scale, max_steps, floor)
        calm = scale if not outcome.diverged else calm
        if outcome.at is not None and (best is None or outcome.at < best[0]):
            best = (outcome.at, scale)
        slower = below is not None and outcome.at is not None and outcome.at > below
        if not outcome.diverged and not slower:
            break
        if slower and best is not None and outcome.at > best[0]:  # halving made it slower
            break
        scale /= 2
    if climb and best is not None and best[1] == initial:  # reached at its first: twice faster?
        for _ in range(UPWARD):
            outcome = attempt(best[1] * 2, math.ceil(best[0]), int(best[0] / FASTEST))
            if outcome.diverged or outcome.at is None or outcome.at >= best[0]:
                break
            best = (outcome.at, best[1] * 2)
    if below is None and best is not None and best[1] == initial:  # the base: is half faster?
        for _ in range(MAX_BACKOFFS):
            outcome = attempt(best[1] / 2, math.ceil(best[0]), int(best[0] / FASTEST))
            if outcome.diverged or outcome.at is None or outcome.at >= best[0]:
                break
            best = (outcome.at, best[1] / 2)
    return best, calm


def _loss_criterion(runner: _Runner, ladder: Sequence[int], base: int,
                    examples: int, used: dict[tuple[int, int], float], seeds: int, start: float,
                    tolerance: float) -> tuple[int | None, tuple[Branch, ...]]:
    """Merrill et al.'s answer (NOTE [ The critical batch, measured ]): every batch of the
    ladder trains on the same ``examples`` at the learning rate its steps branch used; the
    largest batch from the base up whose mean loss over seeds stays within ``tolerance`` of the
    base's (relative)."""
    rows: list[Branch] = []
    losses: dict[int, list[float]] = {}
    for seed in range(seeds):
        for batch in ladder:
            if (seed, batch) not in used:
                continue
            lr = used[(seed, batch)]
            steps = max(1, round(examples / batch))
            outcome = runner.run(batch, lr / runner.lrs[0], seed, steps, 0, None, start)
            loss, diverged = outcome.loss, outcome.diverged
            rows.append(Branch(batch, lr, steps, steps * batch, diverged, seed,
                               runner.micro_batches(batch), None if diverged else loss))
            losses.setdefault(batch, []).append(math.inf if diverged else loss)
    if base not in losses or not all(math.isfinite(v) for v in losses[base]):
        return None, tuple(rows)
    reference = statistics.fmean(losses[base])
    largest = base
    for batch in ladder[1:]:
        if batch not in losses or len(losses[batch]) < len(losses[base]) or statistics.fmean(
                losses[batch]) > reference * (1 + tolerance):
            break
        largest = batch
    return largest, tuple(rows)
