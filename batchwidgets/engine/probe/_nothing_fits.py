"""``NoBatchSizeFits``: not even the smallest batch trains, said in one line with what would help
(here: a smaller micro-batch, amp, a larger budget; on a target: which states do not fit)."""

from __future__ import annotations

from collections.abc import Callable

from ...results import BatchSizeReport
from .. import memory


class NoBatchSizeFits(RuntimeError):
    """Even the smallest batch size ran out of memory; ``.report`` holds every attempt."""

    def __init__(self, report: BatchSizeReport) -> None:
        self.report = report
        if report.target is not None:
            super().__init__(_nothing_fits_on_target(report))
            return
        real = [a for a in report.attempts if not a.fake]  # not the fake search's
        ran_out = [a for a in real if not memory.cannot_train_alone(a.error)]
        smallest = min(ran_out or real, key=lambda a: a.batch_size)
        alone = ("; batch_size=1 cannot train this model (BatchNorm needs more than one value "
                 "per channel)" if len(ran_out) < len(real) else "")
        budget = (f"a budget of {report.budget_bytes} bytes" if report.budget_bytes
                  else "the whole device")
        peak = (f" (peak {smallest.peak_memory_bytes} bytes or more)"
                if smallest.peak_memory_bytes else "")
        super().__init__(
            f"No batch size fits: batch_size={smallest.batch_size} ran out of memory on "
            f"{report.device} with {budget}{peak}{alone}. Try amp='bf16' (or 'fp16'), a smaller "
            f"micro-batch with gradient accumulation (batchwidgets.accumulate), a larger budget, "
            f"or a smaller model. Last error: {smallest.error}")


def _nothing_fits_on_target(report: BatchSizeReport) -> str:
    """A target plan where not even one sample fits: what does not, and what would help."""
    split, usable = report.memory_split, report.limit_bytes or 0
    gb = lambda nbytes: (f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9  # noqa: E731
                         else f"{nbytes / 1e6:.1f} MB")
    if report.parallel is not None:
        return _nothing_fits_on_ranks(report, gb)
    if split is None:
        held = "the step at batch size 1"
    else:
        states = split.parameters_bytes + split.gradients_bytes + split.optimizer_bytes
        parts = ", ".join(f"{name} {gb(value)}" for name, value in (
            ("weights", split.parameters_bytes), ("gradients", split.gradients_bytes),
            ("optimizer state", split.optimizer_bytes)) if value)
        held = (f"the model's states alone ({parts}) need {gb(states)}" if states > usable
                else f"batch size 1 needs more than the states' {gb(states)} ({parts or 'none'}) "
                     f"and the GPU libraries' workspaces (cuBLAS: 65 MiB on a Hopper) leave")
    return (f"No batch size fits on {report.target} (predicted, not run): {held}, of "
            f"{gb(usable)} usable. Try training in bf16 (model.to(torch.bfloat16)), freezing "
            f"the base weights (requires_grad=False, as LoRA does), an optimizer with less "
            f"state (SGD), or more GPUs that shard the states (FSDP, ZeRO).")


def _nothing_fits_on_ranks(report: BatchSizeReport, gb: Callable[[int], str]) -> str:
    """A plan for N GPUs where not one sample fits on a rank: what a rank holds, and which
    strategies would fit."""
    split, usable = report.memory_split, report.limit_bytes or 0
    parts = ", ".join(f"{name} {gb(value)}" for name, value in (
        ("weights", split.parameters_bytes), ("gradients", split.gradients_bytes),
        ("optimizer state", split.optimizer_bytes),
        ("communication buffers", split.communication_bytes)) if value)
    fitting = [f"parallel={row.parallel!r} (batch {row.max_batch_size} per rank)"
               for row in report.parallel_plans if row.max_batch_size > 0]
    would = (f"These fit: {', '.join(fitting)}." if fitting else
             "No strategy fits on this many GPUs: plan more GPUs (a larger count in target=), "
             "train in bf16, or freeze the base weights.")
    return (f"No batch size fits on each of {report.world_size}x{report.target} under "
            f"parallel={report.parallel!r} (predicted, not run): a rank holds {parts} of "
            f"{gb(usable)} usable, and the step needs more with one sample. {would}")
