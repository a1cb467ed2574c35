"""Measuring on this device, as a function of the traces a probe made of real steps (fake ones
first where they run: NOTE [ A free first guess ] in _probe.py), the answer verified by a size
that fits and the next that does not: the what-ifs the per-op model predicts, and with
``what_if=True`` each change measured again through ``again``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...results import BatchSizeReport
from . import _what_if
from ._setup import ProbeSetup, Traced


def measure(setup: ProbeSetup, traced: Traced,
            again: Callable[..., BatchSizeReport]) -> BatchSizeReport:
    """The search's report on this device, and the what-if rows; ``again(**change)``: the
    probe with one change, measured (``what_if=True``)."""
    report = traced.report
    rows = _predicted_what_ifs(setup, traced)
    if setup.what_if and setup.model is not None:
        rows += _what_if.measured(again, setup.optimizer, setup.amp, setup.model)
    return dataclasses.replace(report, what_if=tuple(rows)) if rows else report


def _predicted_what_ifs(setup: ProbeSetup, traced: Traced) -> list:
    """The what-if rows the per-op model predicts (see probe/_what_if.py), where it was fitted."""
    if traced.model is None or traced.limit_bytes is None:
        return []
    modules = _what_if.checkpoint_candidates(setup.owner) if setup.owner is not None else {}
    found = traced.report.max_batch_size
    # On CUDA the tensors' bytes are not what runs out: the boundary found says where, in
    # tensor bytes, the reserved memory ran out, and the rows are predicted against that.
    row_limit = (traced.model.peak_bytes(found) if traced.replays and found
                 else traced.limit_bytes - traced.overhead_bytes)
    rows = _what_if.predicted(traced.model, row_limit, multiple_of=setup.multiple_of,
                              ceiling=setup.ceiling, modules=modules)
    if traced.replays:  # the allocator's segments and rounding gone: tensors and workspaces
        rows += _what_if.expandable(traced.model, traced.limit_bytes - traced.unseen_bytes,
                                    found, multiple_of=setup.multiple_of, ceiling=setup.ceiling)
    return rows
