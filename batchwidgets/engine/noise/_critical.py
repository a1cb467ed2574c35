"""critical_batch: the critical batch measured by its definition, from short branched runs.

Usage:
    >>> report = bw.critical_batch(model, dataset, optimizer=optimizer,      # doctest: +SKIP
    ...                            loss_fn=torch.nn.functional.cross_entropy)
    >>> report.critical_batch_size, report.examples                          # doctest: +SKIP
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ...results import Branch, CriticalBatchReport
from .._batches import batch_length, forward_and_loss
from .._state import TrainingState
from .._util import to_device
from ._measure import measure_noise

LossFn = Callable[..., torch.Tensor]
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
            "Adafactor", "SparseAdam")
MAX_BACKOFFS = 4  # a diverging branch runs again at half the learning rate, this many times
BLOWUP = 2.0  # a branch whose evaluated loss passes BLOWUP x the starting loss has diverged
TARGET_SHARE = 0.9  # the default target: this share of the way to the base's loss after its run
BEYOND = 2.0  # a fitted B_noise past the ladder by this factor is a bound, not a measurement
EVALS_PER_DOUBLING = 16  # the loss is evaluated at every step up to 16, then every step // 16

# NOTE [ The critical batch, measured ]
# McCandlish et al. (2018): the steps and examples to reach a loss follow S = S_min (1 + B_noise
# / B) and E = E_min (1 + B / B_noise); the critical batch B_noise needs twice the fewest steps
# and twice the fewest examples. Measured here by that definition, from the current weights:
# - the base batch runs ``base_steps`` steps with the optimizer's learning rate; 90% of the way
#   from the starting loss to the loss it reaches (on a fixed evaluation sample of the data) is
#   the target, unless one is given: a target inside the descent, not on a plateau where
#   reaching it is a matter of the noise;
# - each batch of a ladder (the base times 1, 2, 4, ...) runs from the same weights and
#   optimizer state (restored between branches: one copy, the TrainingState snapshot) with its
#   learning rate scaled by the optimizer's rule (linear for SGD, square root for the Adam
#   family) until the evaluated loss reaches the target; a branch that blows up runs again at
#   half the learning rate (the stability edge moves down as the batch grows less than the
#   rule says), and so does one that took more steps than the batch below it (with a learning
#   rate tuned per batch, steps never grow with the batch: more is a rate past the edge that
#   oscillates without blowing up); the fewest steps of its tries count;
# - S(B) is fitted by least squares on 1/B: S = S_min + S_min B_noise / B, and B_noise =
#   slope / intercept; over seeds (different draws of the batches) the mean and its standard
#   error. A B_noise past the ladder (twice its largest batch, half its smallest) is reported as
#   that bound with critical_batch_size None: no number is made from an extrapolation.
#   The loss is evaluated at every step up to the 16th, then every step // 16 steps: steps to
#   the target are counted to about 6%, whatever the batch, at 16 evaluations per doubling.
# Nothing of the user's changes: weights, optimizer state, scheduler and RNGs are restored.


def _items(data: Dataset | DataLoader) -> list:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError("data should be a map-style Dataset (or a DataLoader over one), but got "
                        f"an iterable {type(dataset).__name__}; critical_batch draws batches at "
                        "random: pass a Dataset, e.g. a TensorDataset of a sample.")
    return [dataset[i] for i in range(len(dataset))]


def _scaling(optimizer: torch.optim.Optimizer, rule: str | Callable | None) -> tuple[Callable, str]:
    if callable(rule):
        return rule, getattr(rule, "__name__", "custom")
    if rule is None:
        rule = "sqrt" if type(optimizer).__name__ in ADAPTIVE else "linear"
    rules = {"linear": lambda k: k, "sqrt": math.sqrt, "none": lambda k: 1.0}
    if rule not in rules:
        raise ValueError(f"lr_scaling should be 'linear', 'sqrt', 'none' or a callable of the "
                         f"batch ratio, but got lr_scaling={rule!r}; e.g. lr_scaling='sqrt'.")
    return rules[rule], rule


class _Runner:
    """Branches from one snapshot: train at a batch and learning rate until a target loss."""

    def __init__(self, model, optimizer, loss_fn, scheduler, items, eval_items, device):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.scheduler, self.items, self.device = scheduler, items, device
        self.eval_batches = [to_device(default_collate(eval_items[i:i + 256]), device)
                             for i in range(0, len(eval_items), 256)]
        self.eval_size = len(eval_items)
        self.lrs = [group["lr"] for group in optimizer.param_groups]
        self.examples = 0

    def loss(self) -> float:
        self.examples += self.eval_size
        with torch.no_grad():
            total = sum(float(forward_and_loss(self.model, batch, self.loss_fn, surrogate=False))
                        * batch_length(batch) for batch in self.eval_batches)
        return total / self.eval_size

    def run(self, batch_size: int, scale: float, seed: int, max_steps: int, every: int,
            target: float | None, start: float) -> tuple[int | None, float, bool]:
        """(steps to reach ``target`` or None, the last evaluated loss, diverged)."""
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            group["lr"] = lr * scale
        generator = torch.Generator().manual_seed(seed)
        order: list[int] = []
        last = start
        for step in range(1, max_steps + 1):
            if len(order) < batch_size:
                order += torch.randperm(len(self.items), generator=generator).tolist()
            picked, order = order[:batch_size], order[batch_size:]
            batch = to_device(default_collate([self.items[i] for i in picked]), self.device)
            self.optimizer.zero_grad(set_to_none=True)
            loss = forward_and_loss(self.model, batch, self.loss_fn, surrogate=False)
            if not torch.isfinite(loss):
                return None, math.inf, True
            loss.backward()
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.examples += batch_size
            # every step up to ``every``, then every step // every (about 1/every resolution);
            # every=0: only at the end
            if (every and step % max(1, step // every) == 0) or step == max_steps:
                last = self.loss()
                if not math.isfinite(last) or last > BLOWUP * start:
                    return None, last, True
                if target is not None and last <= target:
                    return step, last, False
        return None, last, False


def _fit(points: Sequence[tuple[int, int]]) -> tuple[float, float] | None:
    """(S_min, B_noise) from (batch, steps) by least squares of S on 1/B; None if the steps do
    not fall as the batch grows (no positive intercept and slope)."""
    if len({b for b, _ in points}) < 2:
        return None
    xs, ys = [1 / b for b, _ in points], [float(s) for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if intercept <= 0 or slope <= 0:
        return None
    return intercept, slope / intercept


def critical_batch(model: torch.nn.Module, data: Dataset | DataLoader, *,
                   optimizer: torch.optim.Optimizer, loss_fn: LossFn | None = None,
                   target_loss: float | None = None, base_batch_size: int | None = None,
                   batch_sizes: Sequence[int] | None = None, base_steps: int = 64,
                   lr_scaling: str | Callable[[float], float] | None = None,
                   scheduler: Any = None, seeds: int = 2, max_steps: int | None = None,
                   eval_examples: int = 256, noise: bool = True,
                   device: torch.device | str | None = None) -> CriticalBatchReport:
    """Measure the critical batch from the current weights (NOTE [ The critical batch,
    measured ]): short branched runs at a ladder of batch sizes, each to the same target loss.

    Parameters
    ----------
    model, optimizer : the model and its optimizer, at the point of training to measure from;
        both (and ``scheduler``, and the RNGs) are as they were afterwards.
    data : Dataset or DataLoader over one (map-style): batches are drawn from it at random.
    loss_fn : ``loss_fn(model(x), y)``; None for models whose output has ``.loss``.
    target_loss : float, optional
        The loss each branch runs to; default: the one the base batch reaches in
        ``base_steps`` steps.
    base_batch_size : int, optional
        The ladder's first rung (default: the DataLoader's batch size, else 8).
    batch_sizes : sequence of int, optional
        The ladder (default: the base batch times 1, 2, 4, ... 32, as far as the data goes).
    lr_scaling : "linear", "sqrt", "none" or a callable of B / base
        How each branch's learning rate follows its batch (default: square root for the Adam
        family, linear otherwise).
    seeds : int
        Draws of the batches; the error is the standard error over them.
    max_steps : int, optional
        Steps a branch may take (default 4 x ``base_steps``).
    noise : bool
        Also measure B_simple at the same weights (``measure_noise``) for comparison.

    Returns
    -------
    CriticalBatchReport
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer should be the model's torch.optim.Optimizer, but got "
                        f"optimizer={optimizer!r}; e.g. torch.optim.SGD(model.parameters(), "
                        f"lr=0.1).")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model should have trainable parameters (requires_grad=True), but got "
                         f"none in {type(model).__name__}; critical_batch trains branches of it.")
    for name, value in (("base_steps", base_steps), ("seeds", seeds),
                        ("eval_examples", eval_examples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} should be a positive int, but got {name}={value!r}.")
    items = _items(data)
    base = base_batch_size or (data.batch_size if isinstance(data, DataLoader)
                               and data.batch_size else 8)
    ladder = sorted(set(batch_sizes)) if batch_sizes is not None else [
        base * 2**k for k in range(6) if base * 2**k <= len(items)]
    if len(ladder) < 3:
        raise ValueError(f"data should hold enough examples for a ladder of at least 3 batch "
                         f"sizes, but {len(items)} examples allow {ladder} from "
                         f"base_batch_size={base}; pass more data, a smaller base_batch_size or "
                         f"batch_sizes=[...].")
    if max(ladder) > len(items):
        raise ValueError(f"batch_sizes should be at most the {len(items)} examples of data, but "
                         f"got {max(ladder)}; pass more data or smaller batch_sizes.")
    base = ladder[0] if batch_sizes is not None else base
    scale_of, rule = _scaling(optimizer, lr_scaling)
    max_steps = max_steps or 4 * base_steps
    device = torch.device(device) if device is not None else next(model.parameters()).device
    eval_items = [items[i * len(items) // min(eval_examples, len(items))]
                  for i in range(min(eval_examples, len(items)))]
    state = TrainingState(model, optimizer, (scheduler,) if scheduler is not None else ())
    extra = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        if torch.is_tensor(v))
    b_simple = b_simple_error = None
    if noise:
        measured = measure_noise(model, data, loss_fn, batch_sizes=(1,), max_examples=512)
        if measured.measurable:
            b_simple, b_simple_error = measured.b_simple, measured.b_simple_error
    runner = _Runner(model, optimizer, loss_fn, scheduler, items, eval_items, device)
    branches: list[Branch] = []
    fits: list[tuple[float, float]] = []
    reason = ""
    try:
        with torch.enable_grad():
            start = runner.loss()
            target = target_loss
            stable = 1.0  # the base's learning rate, halved while its run does not descend
            for seed in range(seeds):
                points = []
                for batch in ladder:
                    scale = stable * scale_of(batch / base)
                    best = None  # the fewest steps of the tries that reached the target
                    for _ in range(MAX_BACKOFFS + 1):
                        state.restore()
                        every = EVALS_PER_DOUBLING
                        if target is None:  # the base branch sets the target
                            steps, reached, diverged = runner.run(
                                batch, scale, seed, base_steps, 0, None, start)
                            diverged = diverged or not reached < start
                            if diverged:
                                stable /= 2
                            else:  # 90% of its way: not on a plateau's noise
                                target = reached + (1 - TARGET_SHARE) * (start - reached)
                                state.restore()
                                steps, _, diverged = runner.run(batch, scale, seed, max_steps,
                                                                every, target, start)
                        else:
                            steps, _, diverged = runner.run(batch, scale, seed, max_steps,
                                                            every, target, start)
                        lr = runner.lrs[0] * scale
                        branches.append(Branch(batch, lr, steps, steps * batch if steps else
                                               None, diverged, seed))
                        slower = bool(points) and steps is not None and steps > points[-1][1]
                        if not diverged and not slower:
                            break
                        if slower:  # past the stability edge without blowing up: see NOTE
                            best = steps if best is None else min(best, steps)
                        scale /= 2
                    if best is not None:
                        steps, diverged = min(best, steps or best), False
                    if steps is not None and not diverged:
                        points.append((batch, steps))
                if target is None:
                    reason = (f"the base batch did not lower the loss at any learning rate "
                              f"tried (down to {runner.lrs[0] * stable * 2:.3g})")
                    break
                fitted = _fit(points)
                if fitted is not None:
                    fits.append(fitted)
    finally:
        state.restore()
    if target is not None and target >= start:
        reason = (f"the base batch did not lower the loss in {base_steps} steps (from "
                  f"{start:.4g} to {target:.4g}): nothing to reach; give target_loss= or more "
                  f"base_steps")
        fits = []
    elif not fits and not reason:
        reached = sum(b.steps is not None for b in branches)
        reason = (f"the steps to the target did not fall as the batch grew ({reached} of "
                  f"{len(branches)} branches reached it): no S_min (1 + B_noise / B) to fit; "
                  f"try a larger max_steps or a lower target_loss")
    critical = error = s_min = e_min = None
    if fits and statistics.fmean(b for _, b in fits) > BEYOND * max(ladder):
        reason = (f"the steps still fall as fast as the batch grows up to the largest batch "
                  f"tried ({max(ladder)}): the critical batch is above it; try larger "
                  f"batch_sizes (with accumulation past what fits)")
        fits = []
    elif fits and statistics.fmean(b for _, b in fits) < min(ladder) / BEYOND:
        reason = (f"the steps hardly fall as the batch grows from the smallest batch tried "
                  f"({min(ladder)}): the critical batch is below it; try smaller batch_sizes")
        fits = []
    if fits:
        noises = [b for _, b in fits]
        critical = statistics.fmean(noises)
        error = statistics.stdev(noises) / math.sqrt(len(noises)) if len(noises) > 1 else None
        s_min = statistics.fmean(s for s, _ in fits)
        e_min = s_min * critical
    return CriticalBatchReport(
        critical_batch_size=critical, critical_batch_size_error=error,
        target_loss=target if target is not None else math.nan, start_loss=start,
        examples=runner.examples, ladder=tuple(branches), base_batch_size=base, s_min=s_min,
        e_min=e_min, lr_scaling=rule, reason=reason, b_simple=b_simple,
        b_simple_error=b_simple_error, extra_memory_bytes=extra, seeds_fitted=len(fits))
