"""``BatchSplitReport``: what ``fit_trainer`` and Lightning's ``BatchSizeCallback`` set, the global
batch kept as per-device batch x accumulation steps x devices."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _html
from ._text import TextForm
from .probe import BatchSizeReport, Remembered


@dataclass(frozen=True)
class BatchSplitReport(TextForm):
    """A trainer's global batch as ``per_device_batch_size x accumulation_steps x world_size``,
    the per-device batch from ``probe`` (the largest divisor of the global batch per device that
    fits under ``max_per_device``)."""

    global_batch_size: int  # examples per optimizer update over all devices: the recipe's
    world_size: int  # data-parallel devices the global batch is spread over
    per_device_batch_size: int
    accumulation_steps: int
    max_per_device: int  # the largest batch the probe recommends on one device
    probe: BatchSizeReport

    @property
    def remembered(self) -> Remembered | None:
        """When and where the per-device answer was measured, if it was remembered."""
        return self.probe.remembered

    def summary(self) -> str:
        devices = "device" if self.world_size == 1 else "devices"
        said = (f"per_device_batch_size={self.per_device_batch_size} x accumulation_steps="
                f"{self.accumulation_steps} x {self.world_size} {devices} = global_batch_size "
                f"{self.global_batch_size} (up to {self.max_per_device} fits per device)")
        return said if self.remembered is None else f"{said}; remembered, {self.remembered}"

    def text_parts(self) -> list[str]:
        """After the split, the probe it rests on, in its own summary."""
        return [f"probe: {self.probe.summary()}"]

    def rows(self) -> list[tuple[str, object]]:
        return [
            ("global_batch_size", self.global_batch_size),
            ("per_device_batch_size", self.per_device_batch_size),
            ("accumulation_steps", self.accumulation_steps),
            ("devices", self.world_size),
            ("fits per device", f"{self.max_per_device} (find_batch's recommended_batch_size)"),
            ("learning rate", "unchanged: the global batch is"),
            ("probe", self.probe.summary()),
        ]

    def _repr_html_(self) -> str:
        return _html.report_html(self, "batchwidgets: the global batch kept", self.rows(),
                                 self.probe._repr_html_(), plot=False)
