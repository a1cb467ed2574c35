"""``CriticalBatchReport``: the critical batch measured from branched runs (``critical_batch``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _html
from ._noise_theory import verdict
from ._text import Short, TextForm


@dataclass(frozen=True)
class Branch(Short):
    """One run from the same weights at ``batch_size`` with learning rate ``lr``, to the target
    loss: ``steps`` and ``examples`` (steps x batch size) to reach it, None if it did not
    within the step limit; ``diverged``: the loss blew up (the branch is run again at half the
    learning rate, a row each). ``micro_batches``: how many each step accumulated (above
    ``fits_batch_size``); ``loss``: the last loss evaluated (None when it diverged);
    ``steps_to_target``: the steps interpolated between the last two evaluations, where the
    loss crossed the target (what the fit uses; ``steps`` is the evaluated step at or past
    it)."""

    batch_size: int
    lr: float
    steps: int | None
    examples: int | None
    diverged: bool
    seed: int
    micro_batches: int = 1
    loss: float | None = None
    steps_to_target: float | None = None

    def row(self) -> tuple[object, ...]:
        outcome = ("diverged" if self.diverged else "-" if self.steps is None else
                   f"{self.steps} ({_html.format_number(self.steps_to_target, 3)})"
                   if self.steps_to_target is not None else self.steps)
        batch = (f"{self.batch_size} ({self.micro_batches} × "
                 f"{-(-self.batch_size // self.micro_batches)})" if self.micro_batches > 1
                 else self.batch_size)
        return (batch, _html.format_number(self.lr, 3), outcome,
                self.examples if self.examples is not None else "-",
                _html.format_number(self.loss) if self.loss is not None else "-", self.seed)


@dataclass(frozen=True)
class CriticalBatchReport(TextForm):
    """The critical batch from the current weights: the batch that needs twice the fewest
    examples (and twice the fewest steps) to reach ``target_loss``, from S(B) = S_min (1 +
    B_noise / B) fitted on the steps each batch of the ladder took (McCandlish et al. 2018).

    ``critical_batch_size`` is B_noise (the mean over seeds) with ``critical_batch_size_error``
    its standard error over seeds, None with the ``reason`` when it is not measurable.
    ``examples`` counts every example spent: training in every branch, the loss evaluations
    (``examples_eval``, forward passes only) and the examples ``measure_noise`` read
    (``examples_noise``). ``b_simple`` is the gradient noise scale measured at the same
    weights, for comparison: ``ratio`` = critical / B_simple.

    With ``criterion="loss"``, ``loss_criterion_batch_size`` is Merrill et al.'s (2025) answer
    to another question: the largest batch whose loss after the base's examples stays within
    ``loss_tolerance`` of the base batch's (how far the batch grows before a fixed budget of
    examples buys less); its branches are ``loss_ladder``."""

    critical_batch_size: float | None
    critical_batch_size_error: float | None
    target_loss: float
    start_loss: float
    examples: int
    ladder: tuple[Branch, ...]
    base_batch_size: int
    s_min: float | None
    e_min: float | None
    lr_scaling: str
    reason: str = ""
    b_simple: float | None = None
    b_simple_error: float | None = None
    extra_memory_bytes: int = 0  # the copy of weights and optimizer state the branches start from
    seeds_fitted: int = 0  # seeds whose steps fell with the batch (the error needs two)
    examples_noise: int = 0  # of ``examples``: those measure_noise read for b_simple
    examples_eval: int = 0  # of ``examples``: the loss evaluations' (forward passes only)
    fits_batch_size: int | None = None  # larger batches accumulated micro-batches of this size
    criterion: str = "steps"  # "loss": also Merrill et al.'s loss-tolerance batch
    loss_criterion_batch_size: int | None = None  # the largest batch within loss_tolerance
    loss_tolerance: float = 0.01
    loss_ladder: tuple[Branch, ...] = ()  # the equal-examples branches of criterion="loss"
    # not measurable because B_noise lies past the ladder: "above" or "below" bound_batch_size
    bound: str = ""
    bound_batch_size: float | None = None
    warnings: tuple[str, ...] = ()  # what makes the number less exact (e.g. S_min of a step)
    optimizer_lr: float | None = None  # the optimizer's (first group's) rate it started from
    # the base batch's steps that set the default target (base_steps, or more where its descent
    # was within the noise of the start); None for a target_loss given
    target_steps: int | None = None

    def lr_scale_at(self, batch_size: float) -> float | None:
        """The learning rate that reached the target fastest at the largest batch of the ladder
        not above ``batch_size`` (the smallest, below them all), the lowest over seeds, as a
        multiple of ``optimizer_lr``: a rate measured stable there, which a schedule going to
        that batch should not exceed. None without a branch that reached the target."""
        if not self.optimizer_lr:
            return None
        fastest: dict[tuple[int, int], Branch] = {}
        for branch in self.ladder:
            key = (branch.seed, branch.batch_size)
            if branch.steps_to_target is not None and (
                    key not in fastest
                    or branch.steps_to_target < fastest[key].steps_to_target):
                fastest[key] = branch
        if not fastest:
            return None
        sizes = sorted({size for _, size in fastest})
        rung = max((size for size in sizes if size <= batch_size), default=sizes[0])
        return min(b.lr for (_, size), b in fastest.items() if size == rung) / self.optimizer_lr

    def schedule_options(self) -> dict[str, object]:
        """What ``plan_batch`` takes from this report: the measured batch, or the bound."""
        if self.measurable:
            return {"critical_batch_size": self.critical_batch_size,
                    "critical_batch_size_error": self.critical_batch_size_error}
        if self.bound and self.bound_batch_size is not None:
            return {"critical_bound": (self.bound, self.bound_batch_size)}
        return {}

    @property
    def measurable(self) -> bool:
        return self.critical_batch_size is not None

    @property
    def ratio(self) -> float | None:
        """critical_batch_size / b_simple: how far the noise scale is from the measured batch."""
        if self.critical_batch_size is None or not self.b_simple or not math.isfinite(
                self.b_simple):
            return None
        return self.critical_batch_size / self.b_simple

    @property
    def n_branches(self) -> int:
        """Runs to the target loss, every batch, seed and learning rate tried."""
        return len(self.ladder)

    @property
    def ratio_error(self) -> float | None:
        """The standard error of ``ratio``, from both errors (delta method, independent)."""
        ratio = self.ratio
        if ratio is None or self.critical_batch_size_error is None or (
                self.b_simple_error is None):
            return None
        return ratio * math.hypot(self.critical_batch_size_error / self.critical_batch_size,
                                  self.b_simple_error / self.b_simple)

    @property
    def b_simple_basis(self) -> str:
        """What ``b_simple`` rests on, in words: "from 512 examples" (measure_noise's)."""
        return f"from {self.examples_noise} examples"

    @property
    def b_simple_text(self) -> str:
        """``b_simple`` with its error and the examples behind it: "67.3 ± 7.3 from 512
        examples"; "-" when not measured."""
        if self.b_simple is None:
            return "-"
        return f"{_html.format_estimate(self.b_simple, self.b_simple_error)} {self.b_simple_basis}"

    @property
    def agreement(self) -> str:
        """Whether the critical batch and B_simple differ by more than their errors ('' without
        both): B_simple estimates the critical batch (NOTE [ The batch-size schedule ])."""
        if self.ratio is None:
            return ""
        return verdict(self.critical_batch_size, self.critical_batch_size_error,
                       self.b_simple, self.b_simple_error)

    def summary(self) -> str:
        number = _html.format_number
        target = (f"to loss {number(self.target_loss)} from {number(self.start_loss)}")
        if not self.measurable:
            return f"critical batch: not measurable ({self.reason}); {target}"
        noise = (f"; B_simple {self.b_simple_text} at the same weights (ratio "
                 f"{_html.format_estimate(self.ratio, self.ratio_error)}: {self.agreement})"
                 if self.ratio is not None else "")
        estimate = _html.format_estimate(self.critical_batch_size,
                                         self.critical_batch_size_error)
        merrill = (f"; loss within {number(100 * self.loss_tolerance)}% of the base's at equal "
                   f"examples up to batch {self.loss_criterion_batch_size}"
                   if self.loss_criterion_batch_size is not None else "")
        warned = "".join(f"; warning: {w}" for w in self.warnings)
        return (f"critical batch {estimate} samples {target}, "
                f"measured from {self.n_branches} branches, {self.seeds_fitted} seed(s) fitted "
                f"({self.examples} examples){noise}{merrill}{warned}")

    def rows(self) -> list[tuple[str, object]]:
        number = _html.format_number
        rows: list[tuple[str, object]] = [
            ("critical batch (B_noise)", "not measurable: " + self.reason if not self.measurable
             else _html.format_estimate(self.critical_batch_size,
                                        self.critical_batch_size_error)),
            ("target loss (from)", f"{number(self.target_loss)} (from {number(self.start_loss)})"),
            ("S_min, E_min", f"{number(self.s_min)} steps, {number(self.e_min)} examples"
             if self.s_min is not None else "-"),
            ("B_simple at these weights", self.b_simple_text),
            ("examples spent", f"{self.examples:,} (loss evaluations {self.examples_eval:,}, "
                               f"measure_noise {self.examples_noise:,})"
             if self.examples_eval or self.examples_noise else self.examples),
            ("learning rate", f"{self.lr_scaling} scaling from batch {self.base_batch_size}"),
            *[("warning", w) for w in self.warnings],
        ]
        if self.fits_batch_size:
            rows.append(("accumulation", f"batches above {self.fits_batch_size} (what fits) "
                                         f"accumulate micro-batches"))
        if self.criterion == "loss":
            rows.append((f"largest batch within {number(100 * self.loss_tolerance)}% of the "
                         f"base's loss at equal examples (Merrill et al. 2025)",
                         self.loss_criterion_batch_size
                         if self.loss_criterion_batch_size is not None else "-"))
        return rows

    def _repr_html_(self) -> str:
        header = ("batch", "lr", "steps", "examples", "last loss", "seed")
        ladder = _html.table([b.row() for b in self.ladder], header=header,
                             caption="branches to the target loss") if self.ladder else ""
        equal = _html.table([b.row() for b in self.loss_ladder], header=header,
                            caption="branches on equal examples (criterion='loss')"
                            ) if self.loss_ladder else ""
        return _html.report_html(self, "batchwidgets: critical_batch", self.rows(), ladder,
                                 equal, plot=False)
