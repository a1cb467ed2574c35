"""``AccumulationReport``: what ``accumulate`` did."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _html
from ._text import TextForm
from .schedule import ScheduleChange


@dataclass(frozen=True)
class AccumulationReport(TextForm):
    """What ``accumulate`` did: micro-steps, real optimizer steps, and per micro-batch numbers."""

    steps: int  # micro-steps per real optimizer step
    micro_steps: int
    real_steps: int  # optimizer updates made, the remainder step included
    skipped_steps: int = 0  # real steps a GradScaler skipped for inf/NaN gradients
    remainder: str = "none"  # none | applied | dropped: micro-steps left when the block ended
    remainder_micro_steps: int = 0
    micro_batch_size: int | None = None  # first dimension of the model's input, else as planned
    world_size: int = 1
    target_batch_size: int | None = None  # the batch_size asked for, when steps was derived
    skips_allreduce: bool = False  # DDP all-reduce skipped on the first steps-1 micro-steps
    losses: tuple[float, ...] = ()  # per micro-batch, from loss.backward()
    grad_norms: tuple[float, ...] = ()  # L2 norm of each micro-batch's own gradient
    # steps="auto": the micro-batches per update followed the noise tracker's schedule; every
    # change, and the learning-rate factor in force at the end (1.0: the loop's own)
    auto: bool = False
    schedule_changes: tuple[ScheduleChange, ...] = ()
    lr_factor: float = 1.0
    advice: str = ""  # the noise tracker's: when accumulating to this batch does not pay

    @property
    def effective_batch_size(self) -> int | None:
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.steps * self.world_size

    def summary(self) -> str:
        auto = (f", auto: {len(self.schedule_changes)} changes, learning rate "
                f"×{_html.format_number(self.lr_factor)}" if self.auto else "")
        text = (f"{self.micro_steps} micro-steps -> {self.real_steps} optimizer steps "
                f"(steps={self.steps}{auto}, effective batch "
                f"{self.effective_batch_size or '?'}, remainder {self.remainder})")
        return f"{text}. {self.advice}" if self.advice else text

    def rows(self) -> list[tuple[str, object]]:
        """The rows of the report's table (label, value)."""
        rows: list[tuple[str, object]] = [
            ("micro-steps per update", self.steps),
            ("micro-steps", self.micro_steps),
            ("optimizer steps", self.real_steps),
            ("skipped by the GradScaler", self.skipped_steps),
            ("left over at the end", f"{self.remainder_micro_steps} ({self.remainder})"),
            ("micro-batch size", self.micro_batch_size or "-"),
            ("world size", self.world_size),
            ("effective batch size", self.effective_batch_size or "-"),
            ("asked for", self.target_batch_size or "-"),
            ("DDP all-reduce on micro-steps", "skipped" if self.skips_allreduce else "-"),
            ("last loss", _html.format_number(self.losses[-1] if self.losses else None)),
        ]
        if self.auto:
            def followed(c: ScheduleChange) -> str:
                if c.source == "critical_batch":
                    return f"measured critical batch {_html.format_number(c.critical_batch_size)}"
                return f"B_simple {_html.format_number(c.b_simple)}"

            rows.append(("schedule (steps='auto')", "; ".join(
                f"update {c.update}: {c.steps_before} -> {c.steps_after} micro-batches "
                f"({followed(c)}, learning rate "
                f"×{_html.format_number(c.lr_factor)})" for c in self.schedule_changes)
                or "no change"))
        if self.advice:
            rows.append(("advice", self.advice))
        return rows

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: accumulate", self.rows())
