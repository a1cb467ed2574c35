"""Where one step's memory goes: ``MemorySplit`` (by part at the peak) and ``MemoryTimeline`` (by
kind over the step's ops), fields of a ``BatchSizeReport``."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _html
from ._text import Short, TextForm


@dataclass(frozen=True)
class MemorySplit(TextForm):
    """Where the memory goes at the peak of a step at ``batch_size``: the parts add up to the
    peak. ``activations_bytes`` are tensors saved for backward, ``temporaries_bytes`` everything
    else alive at the peak (outputs not saved, gradients in flight, optimizer temporaries);
    ``by_module`` the activation bytes each module saved, largest first."""

    batch_size: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    by_module: dict[str, int]
    where: str = ""  # the op at the peak
    # a plan for N GPUs (parallel=): the buffers a rank's strategy adds (DDP's gradient buckets,
    # ZeRO's and FSDP's gathered weights and reduce buckets); the other parts are one rank's share
    communication_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.temporaries_bytes + self.communication_bytes)

    @property
    def parts_bytes(self) -> dict[str, int]:
        """The parts of the peak by name (communication buffers only where a plan has them)."""
        parts = {"parameters": self.parameters_bytes, "gradients": self.gradients_bytes,
                 "optimizer state": self.optimizer_bytes,
                 "activations (saved for backward)": self.activations_bytes,
                 "temporaries": self.temporaries_bytes}
        if self.communication_bytes:
            parts["communication buffers"] = self.communication_bytes
        return parts

    @property
    def shares(self) -> dict[str, float]:
        """Each part's share of the peak, in [0, 1]."""
        total = self.total_bytes or 1
        return {name: value / total for name, value in self.parts_bytes.items()}

    def summary(self) -> str:
        """The peak and its largest parts, in one line."""
        parts = ", ".join(f"{name} {value}" for name, value in self.rows())
        return (f"{_html.format_bytes(self.total_bytes)} at the peak of a step at batch size "
                f"{self.batch_size}{f' ({self.where})' if self.where else ''}: {parts}")

    def rows(self) -> list[tuple[str, str]]:
        shares = self.shares
        return [(name, f"{_html.format_bytes(value)} ({shares[name]:.0%})")
                for name, value in self.parts_bytes.items()]

    def _repr_html_(self) -> str:
        modules = _html.table([(name, _html.format_bytes(value)) for name, value in
                               list(self.by_module.items())[:10]],
                              caption="activations by module, the largest",
                              header=("module", "bytes"))
        return (_html.table(self.rows(), caption=f"memory at the peak, batch size "
                                                 f"{self.batch_size}") + modules)


TIMELINE_KINDS = ("parameter", "optimizer", "gradient", "activation", "temporary")


@dataclass(frozen=True)
class MemoryTimeline(Short):
    """The live bytes of one step at ``batch_size`` over its ops, by kind, as PyTorch's memory
    timeline draws them: ``by_kind`` maps each of TIMELINE_KINDS to the bytes alive at each of
    ``ops`` (op indices, at most a few hundred: the op of largest total in each window, so the
    peak is kept); ``phases`` are (name, first op, last op) of the forward, the backward and
    the optimizer step; ``peak_op`` the op at the step's peak, of ``n_ops``."""

    batch_size: int
    ops: tuple[int, ...]
    by_kind: dict[str, tuple[int, ...]]
    phases: tuple[tuple[str, int, int], ...]
    peak_op: int
    n_ops: int

    @property
    def peak_bytes(self) -> int:
        return max((sum(values) for values in zip(*self.by_kind.values())), default=0)
