"""One tiny helper that turns rows of values into an HTML table, escaping every value."""

from __future__ import annotations

import base64
import html
import importlib
import importlib.util
import io
from collections.abc import Iterable, Sequence

MAX_ROWS = 60  # a longer table shows its first and last rows, as pandas elides a long frame


def table(rows: Iterable[Sequence[object]], header: Sequence[object] | None = None,
          caption: str | None = None) -> str:
    """Return an HTML ``<table>``; every cell and the caption go through ``html.escape``. Over
    ``MAX_ROWS`` rows (a live loader switched at every batch), the first and last halves of that
    and one row saying how many are left out: every row stays in the report's fields."""
    parts = ['<table class="batchwidgets">']
    if caption is not None:
        parts.append(f"<caption>{html.escape(str(caption))}</caption>")
    if header is not None:
        parts.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    rows = list(rows)
    half = MAX_ROWS // 2
    left_out = len(rows) - 2 * half if len(rows) > MAX_ROWS else 0
    for i, row in enumerate(rows):
        if left_out and i == half:
            width = max(len(header or ()), len(row))
            parts.append(f'<tr><td colspan="{width}">… {left_out} rows more (every row is in '
                         f'the report\'s fields)</td></tr>')
        if left_out and half <= i < half + left_out:
            continue
        parts.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>")
    parts.append("</table>")
    return "".join(parts)


def report_html(report: object, caption: str, rows: Iterable[Sequence[object]],
                *parts: str, plot: bool = True) -> str:
    """Every report's ``_repr_html_``: its rows as a table, any further tables, its picture."""
    picture = inline_plot(report) if plot else ""
    return f"<div>{table(rows, caption=caption)}{''.join(parts)}{picture}</div>"


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; None -> ``'-'``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # unreachable; keeps the type checker calm


def format_number(x: float | None, digits: int = 3) -> str:
    """A float with ``digits`` significant digits; None -> ``'-'``."""
    return "-" if x is None else f"{x:.{digits}g}"


def format_estimate(x: float | None, error: float | None) -> str:
    """``'82.7 ± 3.5'``: ``x`` at 3 significant digits and its ``error`` at 2; ``'82.7'`` when
    the error is unknown (None)."""
    spread = f" ± {format_number(error, 2)}" if error is not None else ""
    return f"{format_number(x)}{spread}"


def inline_plot(report: object) -> str:
    """The report's plot as an ``<img>`` with an inline PNG, or ``''`` without matplotlib.

    Reports must render where widgets cannot (nbviewer, GitHub), so ``_repr_html_`` carries its
    own picture. matplotlib is imported here, on first display, never by ``import batchwidgets``.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return ""
    try:
        plots = importlib.import_module("batchwidgets.plots")
        figure = plots.plot(report)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    except Exception:  # a display hook must never raise; the tables above still show
        return ""
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="batchwidgets plot" src="data:image/png;base64,{data}"/>'
