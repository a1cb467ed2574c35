"""``AccumulationReport``: what ``accumulate`` did."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _html


@dataclass(frozen=True)
class AccumulationReport:
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

    @property
    def effective_batch_size(self) -> int | None:
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.steps * self.world_size

    def summary(self) -> str:
        return (f"{self.micro_steps} micro-steps -> {self.real_steps} optimizer steps "
                f"(steps={self.steps}, effective batch {self.effective_batch_size or '?'}, "
                f"remainder {self.remainder})")

    def _repr_html_(self) -> str:
        rows = [
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
        table = _html.table(rows, caption="batchwidgets: accumulate")
        return f"<div>{table}{_html.inline_plot(self)}</div>"
