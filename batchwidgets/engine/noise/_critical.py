"""critical_batch: the critical batch measured by its definition, from short branched runs.
One object, one module: the measurement and its branches, one snapshot of the weights and
optimizer state, a run from it at a batch and learning rate until a target loss (``_Runner``),
the default target, one rung of the ladder with its learning-rate search (``_rung``), the fit of
S(B) (``_fit``) and Merrill et al.'s equal-examples criterion (``_loss_criterion``).

Usage:
    >>> report = bw.critical_batch(model, dataset, optimizer=optimizer,      # doctest: +SKIP
    ...                            loss_fn=torch.nn.functional.cross_entropy)
    >>> report.critical_batch_size, report.examples                          # doctest: +SKIP
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ...results import BatchSizeReport, Branch, CriticalBatchReport
from .._batches import batch_length, collate_items, collate_of, forward_and_loss
from .._called import called_at, calling, describe, is_said, own_steps, scalar_hint
from .._state import TrainingState, restored
from .._util import check_int, check_number, to_device, usable_device
from ._measure import measure_noise
from ._options import CRITICAL_BATCH

LossFn = Callable[..., torch.Tensor]
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
            "Adafactor", "SparseAdam")
BEYOND = 2.0  # a fitted B_noise past the ladder by this factor is a bound, not a measurement
DEFAULT_RUNGS = 6  # the default ladder: the base times 1, 2, 4, ... 32
FEW_STEPS = 2.0  # a fitted S_min below this many steps is resolved coarsely: said in warnings
EXTRA_RUNGS = 3  # a B_noise past the default ladder adds a rung at twice the top, this many times

# NOTE [ The critical batch, measured ]
# McCandlish et al. (2018): the steps and examples to reach a loss follow S = S_min (1 + B_noise
# / B) and E = E_min (1 + B / B_noise); the critical batch B_noise needs twice the fewest steps
# and twice the fewest examples. Measured here by that definition, from the current weights:
# - the target, unless one is given: the base batch runs ``base_steps`` steps with the
#   optimizer's learning rate (halved while it blows up or does not descend); the loss at its
#   last TAIL steps (on a fixed evaluation sample of the data, in eval mode: no dropout masks)
#   gives where it got (their mean)
#   and how much the loss wanders there (their spread). 90% of the way from the start to that
#   mean is the target, a point inside the descent. A descent within NOISE_SIGMAS spreads is
#   noise, not progress (late in training, on a plateau, branches reach such a target by luck):
#   the base runs twice as long, up to LONGER x base_steps, then it is said, with no number;
# - each batch of a ladder (the base times 1, 2, 4, ... 32) runs from the same weights and
#   optimizer state (restored between branches: one copy, the TrainingState snapshot) until the
#   evaluated loss reaches the target. Its first learning rate is the one that counted at the
#   batch below, scaled by the optimizer's rule (linear for SGD, square root for the Adam
#   family); the definition assumes the best rate at every batch, and neither the user's rate
#   nor the rule is it, so each rate is searched from there: halved while it blows up (the
#   stability edge moves down as the batch grows less than the rule says) or takes more steps
#   than the batch below (with a rate tuned per batch, steps never grow with the batch: more is
#   a rate past the edge that oscillates without blowing up), stopping when a halving is slower
#   still; doubled, from a first rate that reached the target, while that takes fewer steps (up
#   to UPWARD times, each try cut off at the steps it has to beat), at the base and wherever the
#   rung below went up too (where it did not, the rule's rate was already as fast as twice it:
#   on the benchmark no such second try ever won, and each cost a run); at the base, where no
#   batch below says a rate oscillates, then halved while that takes fewer steps. A rate only
#   lowered biases B_noise up: with AdamW 4x below its best, the small batches ran far from
#   their best rate and the large ones near it, and B_noise came out 2.6x the tuned curves';
#   a base rate only raised does too (on the LM's plateau the user's rate was 4x past the best
#   at the base: 5.6x before the base was searched down, 0.62x after). The fewest steps of its
#   tries count. A run is seeded (its batches and the global generator: dropout's masks), and
#   evaluations draw nothing from it: a run again is the same run;
# - S(B) = S_min (1 + B_noise / B) is fitted by least squares in log S (B_noise on a log grid,
#   S_min the geometric mean of the rest), each batch's steps being the interpolated point
#   where the loss crossed the target between its last two evaluations (at large batches the
#   steps are few: counted in whole steps they would be off by up to one); over seeds
#   (different draws of the batches) the mean and its standard error. While the fit lands past
#   the top of the default ladder, a rung at twice the top is added (EXTRA_RUNGS at most, as
#   far as the data goes); a B_noise still past the ladder (twice its largest batch, half its
#   smallest) is reported as that bound with critical_batch_size None: no number is made from
#   an extrapolation. S_min under FEW_STEPS is said in warnings (coarse at the top).
#   The loss is evaluated at every step up to the 4th, then every step // 4 steps, and
#   interpolated between evaluations: the evaluations (forward passes of eval_examples) are
#   most of the examples spent (80% on the benchmark), so no more of them than the
#   interpolation needs (4 per doubling gave the same answers as 8 and 16 for 15% fewer
#   examples), and none before they can matter: a doubled batch (or rate) at most halves the
#   steps, so a rung's evaluations start at a quarter of the steps of the batch below (of the
#   rate below, of an earlier seed at the same batch); a run already at the target at its
#   first evaluation runs again from step 1. A blow-up between evaluations shows in the
#   training batch's loss (free): past BLOWUP x the start's (or the first batch's, if higher:
#   dropout or train-mode noise can keep every batch above the evaluated start, and would
#   otherwise make every step an evaluation; tested) it is evaluated there and then.
#   The same branches as evaluating every run from its first step (tested), for 20-35% fewer
#   examples on the benchmark with the rate search above.
# - criterion="loss" adds Merrill et al.'s (2025) answer: every batch of the ladder trains on
#   the base's examples (base_steps x base) at the learning rate its branch above used; the
#   largest batch from the base up whose loss (mean over seeds) stays within loss_tolerance of
#   the base's. It answers another question (how far the batch grows before a fixed budget of
#   examples buys less loss) and moves with the base batch and the budget.
# - Batches above fits_batch_size accumulate micro-batches of at most that size: the same
#   gradient (each micro-batch's loss weighted by its share), the memory of what fits.
# - scheduler= steps with every branch, at the branch's scale of every rate it computes from
#   (param groups' lr, initial_lr, max_lr, min_lr; the schedulers' base_lrs, max_lrs): LambdaLR
#   (Hugging Face's warm-ups) sets the rate from base_lrs at each step, so scaling lr alone
#   would put the user's rate back at the first step (tested: a LambdaLR of 1 changes no
#   branch). ReduceLROnPlateau steps on a metric: refused, in one line.
# Nothing of the user's changes: weights, optimizer state, scheduler and RNGs are restored.


def _climb(runner: _Runner, ladder: list[int], seeds: int, first: float,
           scale_of: Callable[[int], float], target: float, start: float, max_steps: int,
           extend_to: int) -> tuple[list[Branch], dict[tuple[int, int], float],
                                    list[tuple[float, float]]]:
    """Every rung of ``ladder`` for every seed, each to ``target`` (NOTE [ The critical batch,
    measured ]); rungs at twice the top are appended to ``ladder`` while the fit lands past it
    (up to ``extend_to`` examples, 0: never). (The branches, (seed, batch) -> the learning
    rate that counted, the (S_min, B_noise) fits of the seeds.)"""
    branches: list[Branch] = []
    used: dict[tuple[int, int], float] = {}
    points: list[list[tuple[int, float]]] = [[] for _ in range(seeds)]  # (batch, steps) a seed
    carried: list[tuple[int, float] | None] = [None] * seeds  # the rung below's (batch, scale)
    climbing = [True] * seeds  # whether the rung below's rate was raised above its first
    rungs = list(ladder)
    while True:
        for seed in range(seeds):
            for batch in rungs:
                below = carried[seed]
                scale = (first * scale_of(batch) if below is None else
                         below[1] * scale_of(batch) / scale_of(below[0]))
                best, calm = _rung(runner, branches, batch, scale, seed, max_steps, target, start,
                                   points[seed][-1][1] if points[seed] else None,
                                   climbing[seed], _steps_at(points, batch))
                climbing[seed] = best is not None and best[1] > scale
                if best is not None:
                    points[seed].append((batch, best[0]))
                    used[(seed, batch)] = runner.lrs[0] * best[1]
                    carried[seed] = (batch, best[1])
                elif calm is not None:  # no target reached: its calm rate, for "loss"
                    used[(seed, batch)] = runner.lrs[0] * calm
        fits = [f for f in map(_fit, points) if f is not None]
        top = max(ladder)
        if not (fits and len(ladder) < DEFAULT_RUNGS + EXTRA_RUNGS and 2 * top <= extend_to
                and statistics.fmean(b for _, b in fits) > BEYOND * top):
            return branches, used, fits
        rungs = [2 * top]  # past the ladder: one rung more, and fit again
        ladder.append(2 * top)


def _steps_at(points: list[list[tuple[int, float]]], batch: int) -> float | None:
    """The steps an earlier seed took at ``batch`` (None: none has run it)."""
    return next((s for seed in points for b, s in seed if b == batch), None)


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


def critical_batch(model: torch.nn.Module, data: Dataset | DataLoader, *,
                   optimizer: torch.optim.Optimizer,
                   loss_fn: LossFn | None = CRITICAL_BATCH.loss_fn,
                   target_loss: float | None = CRITICAL_BATCH.target_loss,
                   base_batch_size: int | None = CRITICAL_BATCH.base_batch_size,
                   batch_sizes: Sequence[int] | None = CRITICAL_BATCH.batch_sizes,
                   base_steps: int = CRITICAL_BATCH.base_steps,
                   lr_scaling: str | Callable[[float], float] | None = CRITICAL_BATCH.lr_scaling,
                   scheduler: Any = CRITICAL_BATCH.scheduler, seeds: int = CRITICAL_BATCH.seeds,
                   max_steps: int | None = CRITICAL_BATCH.max_steps,
                   eval_examples: int = CRITICAL_BATCH.eval_examples,
                   noise: bool = CRITICAL_BATCH.noise,
                   fits_batch_size: int | BatchSizeReport | None = CRITICAL_BATCH.fits_batch_size,
                   criterion: str = CRITICAL_BATCH.criterion,
                   loss_tolerance: float = CRITICAL_BATCH.loss_tolerance,
                   device: torch.device | str | None = CRITICAL_BATCH.device,
                   ) -> CriticalBatchReport:
    """Measure the critical batch from the current weights (NOTE [ The critical batch,
    measured ]): short branched runs at a ladder of batch sizes, each to the same target loss.

    Parameters
    ----------
    model, optimizer : the model and its optimizer, at the point of training to measure from;
        both (and ``scheduler``, and the RNGs) are as they were afterwards.
    scheduler : LR scheduler, optional
        Stepped once per step in every branch, every rate it computes from scaled by the
        branch's (a LambdaLR warm-up, OneCycleLR, SequentialLR); not ReduceLROnPlateau.
    data : Dataset or DataLoader over one (map-style): batches are drawn from it at random
        (with the DataLoader's ``collate_fn`` when it is one: dict batches, padded text).
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
    fits_batch_size : int or BatchSizeReport, optional
        The largest batch that fits in memory (``find_batch``'s report: its
        ``recommended_batch_size``): larger batches of the ladder accumulate micro-batches of
        at most this size (the same gradient; the branch's ``micro_batches`` says how many).
    criterion : "steps" or "loss"
        "loss" adds Merrill et al.'s answer as a second number,
        ``loss_criterion_batch_size``: the largest batch whose loss after the base's examples
        (``base_steps`` x base) is within ``loss_tolerance`` of the base batch's. A different
        question (how far the batch grows before a fixed budget of examples buys less loss);
        it moves with the base batch and the budget.
    loss_tolerance : float
        For ``criterion="loss"``: relative, 0.01 is 1%.

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
        check_int(name, value, 1)
    check_int("base_batch_size", base_batch_size, 1, optional=True, hint="; e.g. 8")
    check_int("max_steps", max_steps, 1, optional=True, hint="; e.g. 256")
    if criterion not in ("steps", "loss"):
        raise ValueError(f"criterion should be 'steps' (the critical batch by its definition) "
                         f"or 'loss' (also Merrill et al.'s loss-tolerance batch), but got "
                         f"criterion={criterion!r}.")
    check_number("loss_tolerance", loss_tolerance, lambda v: 0 < v < 1, "a share in (0, 1)",
                 "; e.g. 0.01 for 1%")
    if isinstance(fits_batch_size, BatchSizeReport):
        if fits_batch_size.recommended_batch_size is None:
            raise ValueError(f"fits_batch_size should be a find_batch report with an answer, but "
                             f"this one found none ({fits_batch_size.stop_reason}); pass an int.")
        fits_batch_size = fits_batch_size.recommended_batch_size
    check_int("fits_batch_size", fits_batch_size, 1, optional=True,
              hint="; e.g. fits_batch_size=bw.find_batch(model, make_batch)")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("scheduler should be stepped once per optimizer step without arguments "
                        "(LambdaLR, OneCycleLR, a Hugging Face warm-up), but got "
                        "ReduceLROnPlateau, which steps on a metric; leave it out "
                        "(scheduler=None): its rate holds within the short branches.")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler should be the optimizer's learning-rate scheduler (with "
                        f".step()), but got {type(scheduler).__name__}; e.g. "
                        f"scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, warmup).")
    if target_loss is not None:
        check_number("target_loss", target_loss, math.isfinite, "a finite number",
                     "; e.g. target_loss=0.5, or None for the base batch's")
    items = _items(data)
    collate = collate_of(data)
    base = base_batch_size or (data.batch_size if isinstance(data, DataLoader)
                               and data.batch_size else 8)
    if batch_sizes is not None:
        for value in batch_sizes:
            check_int("batch_sizes", value, 1, hint="; e.g. batch_sizes=[8, 16, 32, 64]")
    ladder = sorted(set(batch_sizes)) if batch_sizes is not None else [
        base * 2**k for k in range(DEFAULT_RUNGS) if base * 2**k <= len(items)]
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
    device = usable_device(device) if device is not None else next(model.parameters()).device
    eval_items = [items[i * len(items) // min(eval_examples, len(items))]
                  for i in range(min(eval_examples, len(items)))]
    state = TrainingState(model, optimizer, (scheduler,) if scheduler is not None else (),
                          loss_fn=loss_fn)
    extra = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        if torch.is_tensor(v))
    b_simple = b_simple_error = None
    noise_examples = 0
    if noise:
        try:
            with own_steps():
                measured = measure_noise(model, data, loss_fn, batch_sizes=(1,),
                                         max_examples=512)
        except ValueError as error:  # its advice in the words of the call the user made
            said = str(error).replace("measure_noise(...", "critical_batch(...")
            if said == str(error):
                raise
            raise ValueError(said) from None
        noise_examples = measured.n_examples
        if measured.measurable:
            b_simple, b_simple_error = measured.b_simple, measured.b_simple_error
    runner = _Runner(model, optimizer, loss_fn, scheduler, items, eval_items, device, collate,
                     fits_batch_size, state.restore)
    branches: list[Branch] = []
    used: dict[tuple[int, int], float] = {}  # (seed, batch) -> the learning rate that counted
    fits: list[tuple[float, float]] = []
    reason = ""
    loss_batch: int | None = None
    loss_rows: tuple[Branch, ...] = ()
    target_steps = None
    try:  # the user's errors said in our words, raised from here
        with restored(state), torch.enable_grad(), own_steps():  # not accumulate's micro-steps
            start = runner.loss()
            target, first = target_loss, 1.0
            if target is None:
                target, first, reason, target_steps = _default_target(runner, base,
                                                                      base_steps, start)
            reachable = target is not None and target < start  # else: said below
            if reachable:
                branches, used, fits = _climb(
                    runner, ladder, seeds, first, lambda b: scale_of(b / base), target, start,
                    max_steps or 4 * (target_steps or base_steps),
                    len(items) if batch_sizes is None else 0)
            if criterion == "loss" and reachable:
                loss_batch, loss_rows = _loss_criterion(
                    runner, ladder, base, base_steps * base, used, seeds, start,
                    loss_tolerance)
    except Exception as error:
        if not is_said(error):
            raise
        raise error.with_traceback(None) from error.__cause__
    if target is not None and target >= start:
        reason = (f"target_loss={target:.4g} is not below the loss at the current weights "
                  f"({start:.4g}): nothing to reach; give a lower target_loss")
        fits = []
    elif not fits and not reason:
        reached = sum(b.steps is not None for b in branches)
        reason = (f"fewer than two batch sizes reached the target ({reached} of "
                  f"{len(branches)} branches did): no S_min (1 + B_noise / B) to fit; "
                  f"try a larger max_steps or a higher target_loss")
    critical = error = s_min = e_min = None
    bound, bound_batch = "", None
    warnings: list[str] = []
    if fits and statistics.fmean(b for _, b in fits) > BEYOND * max(ladder):
        bound, bound_batch = "above", BEYOND * max(ladder)
        reason = (f"the steps still fall as fast as the batch grows up to the largest batch "
                  f"tried ({max(ladder)}): the critical batch is above it; try larger "
                  f"batch_sizes (with accumulation past what fits)")
        fits = []
    elif fits and statistics.fmean(b for _, b in fits) < min(ladder) / BEYOND:
        bound, bound_batch = "below", min(ladder) / BEYOND
        reason = (f"the steps hardly fall as the batch grows from the smallest batch tried "
                  f"({min(ladder)}): the critical batch is below it; try smaller batch_sizes")
        fits = []
    if fits:
        noises = [b for _, b in fits]
        critical = statistics.fmean(noises)
        error = statistics.stdev(noises) / math.sqrt(len(noises)) if len(noises) > 1 else None
        s_min = statistics.fmean(s for s, _ in fits)
        e_min = s_min * critical
        if s_min < FEW_STEPS:
            warnings.append(f"the fewest steps to the target are {s_min:.2g}: the largest "
                            f"batches reach it in a step or two, where whole steps count "
                            f"coarsely; a target further away (a lower target_loss, or more "
                            f"base_steps) measures it better")
    return CriticalBatchReport(
        critical_batch_size=critical, critical_batch_size_error=error,
        target_loss=target if target is not None else math.nan, start_loss=start,
        examples=runner.examples + noise_examples, ladder=tuple(branches), base_batch_size=base,
        s_min=s_min,
        e_min=e_min, lr_scaling=rule, reason=reason, b_simple=b_simple,
        b_simple_error=b_simple_error, extra_memory_bytes=extra, seeds_fitted=len(fits),
        examples_noise=noise_examples, examples_eval=runner.examples_eval,
        fits_batch_size=fits_batch_size, criterion=criterion,
        loss_criterion_batch_size=loss_batch, loss_tolerance=loss_tolerance,
        loss_ladder=loss_rows, bound=bound, bound_batch_size=bound_batch,
        warnings=tuple(warnings), optimizer_lr=runner.lrs[0], target_steps=target_steps)


# -- the branches ---------------------------------------------------------------------------------

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
