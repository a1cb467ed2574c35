"""Pure functions from a report to a matplotlib Figure (never pyplot: nothing global or shown).

Usage:
    >>> from batchwidgets.plots import plot_probe
    >>> figure = plot_probe(report)          # doctest: +SKIP
    >>> figure.savefig("probe.png")          # doctest: +SKIP
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .results import AccumulationReport, BatchSizeReport

MIB = 2**20


def _axes_pair(ax: Axes | None) -> tuple[Figure, Axes, Axes]:
    if ax is not None:
        return ax.figure, ax, ax.twinx()
    figure = Figure(figsize=(9, 3.4), layout="constrained")
    memory_ax, speed_ax = figure.subplots(1, 2)
    return figure, memory_ax, speed_ax


def plot_probe(report: BatchSizeReport, *, ax: Axes | None = None) -> Figure:
    """Memory vs batch size (attempts, fitted line, limit) and samples/s vs batch size.

    With ``ax`` both panels share it (throughput on a twin axis); otherwise a new 1x2 Figure.
    """
    figure, memory_ax, speed_ax = _axes_pair(ax)
    ran = sorted((a for a in report.attempts if a.fits), key=lambda a: a.batch_size)
    failed = [a for a in report.attempts if not a.fits]
    memory_ax.plot([a.batch_size for a in ran], [(a.peak_memory_bytes or 0) / MIB for a in ran],
                   "o", color="tab:blue", label="ran")
    memory_ax.plot([a.batch_size for a in failed],
                   [(a.peak_memory_bytes or 0) / MIB for a in failed],
                   "x", color="tab:red", markersize=9, label="out of memory")
    sizes = [a.batch_size for a in report.attempts]
    if report.memory_model is not None:
        xs = [0, max(sizes)]
        memory_ax.plot(xs, [report.memory_model.predict_bytes(x) / MIB for x in xs], "--",
                       color="tab:gray", label="fitted model")
    if report.limit_bytes is not None:
        label = "budget" if report.budget_bytes else "device limit"
        memory_ax.axhline(report.limit_bytes / MIB, color="tab:red", linestyle=":", label=label)
    memory_ax.axvline(report.recommended_batch_size, color="tab:green", alpha=0.6,
                      label=f"recommended {report.recommended_batch_size}")
    memory_ax.set_xlabel("batch size")
    memory_ax.set_ylabel("peak memory (MiB)")
    memory_ax.set_title(f"memory on {report.device}: max batch {report.max_batch_size}")
    memory_ax.legend(fontsize="small", loc="lower right")
    speed_ax.plot([a.batch_size for a in ran], [a.samples_per_s or 0 for a in ran], "o-",
                  color="tab:orange")
    speed_ax.set_xlabel("batch size")
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_title("throughput")
    return figure


def plot_accumulate(report: AccumulationReport, *, ax: Axes | None = None) -> Figure:
    """Each micro-batch's loss (and gradient norm, if tracked), with the real updates marked."""
    if ax is None:
        figure = Figure(figsize=(7, 3.2), layout="constrained")
        ax = figure.subplots()
    figure = ax.figure
    steps = range(1, len(report.losses) + 1)
    ax.plot(steps, report.losses, ".-", color="tab:blue", label="micro-batch loss")
    for update in range(report.steps, report.micro_steps + 1, report.steps):
        ax.axvline(update + 0.5, color="tab:gray", alpha=0.3)
    ax.set_xlabel(f"micro-step (grey: an optimizer update every {report.steps})")
    ax.set_ylabel("loss")
    ax.set_title(f"accumulate: {report.micro_steps} micro-steps, {report.real_steps} updates")
    if report.grad_norms:
        norm_ax = ax.twinx()
        norm_ax.plot(range(1, len(report.grad_norms) + 1), report.grad_norms, ".",
                     color="tab:orange", label="gradient norm")
        norm_ax.set_ylabel("gradient norm")
    ax.legend(fontsize="small", loc="upper right")
    return figure


_PLOTTERS = {BatchSizeReport: plot_probe, AccumulationReport: plot_accumulate}


def plot(report: object, *, ax: Axes | None = None) -> Figure:
    """The plot for any report type (used by ``_repr_html_``)."""
    plotter = _PLOTTERS.get(type(report))
    if plotter is None:
        raise TypeError(f"report should be one of {[t.__name__ for t in _PLOTTERS]}, but got "
                        f"{type(report).__name__}.")
    return plotter(report, ax=ax)
