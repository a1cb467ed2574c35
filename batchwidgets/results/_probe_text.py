"""The find_batch report's lines that take some arithmetic to say: the fitted line with the
decimals it needs (``line_text``) and the what-if rows with those that change nothing folded
(``what_if_rows``, ``what_if_line``). Standard library."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .probe import BatchSizeReport, MemoryModel, WhatIf

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _unit(n: float) -> int:
    """The power of 1024 format_bytes writes ``n`` in."""
    power = 0
    while abs(n) >= 1024 ** (power + 1) and power < len(_UNITS) - 1:
        power += 1
    return power


def line_text(model: MemoryModel, at: int) -> str:
    """``"3.347 MiB + 1.449 MiB per sample"``: the fitted line, with as many decimals as its
    numbers need, as shown, to give its peak at ``at`` again to the table's 0.1 (issue 46: the
    demo's "3.3 MiB + 1.4 MiB per sample" gave 247 MiB at 174, where its table said 255.5)."""
    at = max(at, 1)
    target = model.predict_bytes(at)
    tolerance = 0.05 * 1024 ** _unit(target)
    parts = [(value, 1024 ** _unit(value)) for value in (model.fixed_bytes,
                                                         model.per_sample_bytes)]
    for decimals in range(1, 7):
        shown = [round(value / unit, decimals) for value, unit in parts]
        if abs(shown[0] * parts[0][1] + shown[1] * parts[1][1] * at - target) <= tolerance:
            break
    fixed, slope = (f"{number:.{decimals}f} {_UNITS[_unit(value)]}" if unit > 1 else
                    f"{value:.0f} B" for number, (value, unit) in zip(shown, parts))
    return f"{fixed} + {slope} per sample"


def no_gain(report: BatchSizeReport) -> tuple[WhatIf, ...]:
    """The what-if rows that leave the answer as it is (each stays in ``report.what_if``)."""
    return tuple(row for row in report.what_if if row.max_batch_size == report.max_batch_size)


def what_if_rows(report: BatchSizeReport) -> list[tuple[object, ...]]:
    """The what-if table's rows: each change that moves the answer, then those that do not,
    folded into one row ("no gain: checkpoint h.0.attn, checkpoint h.1.attn")."""
    same = no_gain(report)
    rows = [row.row() for row in report.what_if if row not in same]
    if same:
        how = {"measured" if row.measured else "predicted" for row in same}
        rows.append((f"no gain: {', '.join(row.name for row in same)}", report.max_batch_size,
                     "/".join(sorted(how)), "-", "the answer stays as it is"))
    return rows


def what_if_line(report: BatchSizeReport) -> str:
    """The what-if rows in one line of text, those that do not move the answer folded."""
    if not report.what_if:
        return ""
    same = no_gain(report)
    said = [f"{row.name} -> {row.max_batch_size} ({'measured' if row.measured else 'predicted'})"
            for row in report.what_if if row not in same]
    if same:
        said.append(f"no gain: {', '.join(row.name for row in same)}")
    return "what if: " + "; ".join(said)
