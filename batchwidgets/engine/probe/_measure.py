"""Measuring on this device: real steps at the sizes the search picks (fake ones first where they
run: NOTE [ A free first guess ] in _loop.py), under the meter and the state guard, the answer
verified by a size that fits and the next that does not; the what-ifs the per-op model predicts,
and with ``what_if=True`` each change measured the same way."""

from __future__ import annotations

import dataclasses

from ...results import BatchSizeReport
from . import _what_if
from ._core import report_of, traced
from ._loop import Search
from ._setup import ProbeSetup


def measure(setup: ProbeSetup) -> BatchSizeReport:
    """The search on this device's real steps, its report, and the what-if rows."""
    search = traced(setup)
    report = report_of(setup, search)
    rows = _predicted_what_ifs(setup, report, search)
    if setup.what_if and setup.model is not None:
        rows += _what_if.measured(lambda **change: measure(setup.with_change(**change)),
                                  setup.optimizer, setup.amp, setup.model)
    return dataclasses.replace(report, what_if=tuple(rows)) if rows else report


def _predicted_what_ifs(setup: ProbeSetup, report: BatchSizeReport, search: Search) -> list:
    """The what-if rows the per-op model predicts (see probe/_what_if.py), where it was fitted."""
    if search.model is None or search.limit_bytes is None:
        return []
    modules = _what_if.checkpoint_candidates(setup.owner) if setup.owner is not None else {}
    # On CUDA the tensors' bytes are not what runs out: the boundary found says where, in
    # tensor bytes, the reserved memory ran out, and the rows are predicted against that.
    row_limit = (search.model.peak_bytes(report.max_batch_size)
                 if search.replays and report.max_batch_size
                 else search.limit_bytes - search.overhead_bytes)
    rows = _what_if.predicted(search.model, row_limit, multiple_of=setup.multiple_of,
                              ceiling=setup.ceiling, modules=modules)
    if search.replays:  # the allocator's segments and rounding gone: tensors and workspaces
        rows += _what_if.expandable(search.model, search.limit_bytes - search.unseen_bytes,
                                    report.max_batch_size, multiple_of=setup.multiple_of,
                                    ceiling=setup.ceiling)
    return rows
