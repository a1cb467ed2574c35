"""Pure functions from a report to a matplotlib Figure (never pyplot: nothing global or shown).

Usage:
    >>> from batchwidgets.plots import plot_probe
    >>> figure = plot_probe(report)          # doctest: +SKIP
    >>> figure.savefig("probe.png")          # doctest: +SKIP
"""

from __future__ import annotations

import textwrap

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .results import AccumulationReport, BatchSizeReport, NoiseReport, NoiseTrackerReport

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


def plot_noise(report: NoiseReport, *, ax: Axes | None = None) -> Figure:
    """Variance (trace) of the mini-batch gradient against the batch size, on log axes, with
    the 1/B line it follows when examples are drawn with replacement."""
    if ax is None:
        figure = Figure(figsize=(6, 3.4), layout="constrained")
        ax = figure.subplots()
    figure = ax.figure
    variances = report.grad_variance
    sizes = sorted(b for b in variances if variances[b] > 0)
    ax.plot(sizes, [variances[b] for b in sizes], "o-", color="tab:blue",
            label="measured (" + ("with" if report.replacement else "without") + " replacement)")
    if sizes:
        ax.plot(sizes, [report.trace_cov / b for b in sizes], "--", color="tab:gray",
                label="tr(Σ) / B")
        ax.axhline(report.grad_norm_sq, color="tab:red", linestyle=":", label="|G|²")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("gradient variance (trace)")
    ax.set_title(f"gradient noise: B_simple = {report.b_simple:.3g}")
    ax.legend(fontsize="small")
    return figure


def plot_noise_tracker(report: NoiseTrackerReport, *, ax: Axes | None = None) -> Figure:
    """Per-batch loss, and the noise scale B_simple over the updates (where measurable)."""
    if ax is not None:
        figure, loss_ax, noise_ax = ax.figure, ax, ax.twinx()
    else:
        figure = Figure(figsize=(9, 3.2), layout="constrained")
        loss_ax, noise_ax = figure.subplots(1, 2)
    loss_ax.plot(range(1, len(report.losses) + 1), report.losses, ".", color="tab:blue",
                 markersize=3)
    loss_ax.set_xlabel("batch")
    loss_ax.set_ylabel("loss")
    points = [(update, value) for update, value, _g2, _s in report.history if value is not None]
    noise_ax.plot([u for u, _ in points], [v for _, v in points], "-", color="tab:orange")
    noise_ax.set_xlabel("update")
    noise_ax.set_ylabel(f"B_simple ({report.unit})")
    noise_ax.set_title("noise scale B_simple" if report.measurable
                       else "noise scale: not measurable yet")
    if not report.measurable:
        noise_ax.text(0.5, 0.5, textwrap.fill(report.reason, 45), transform=noise_ax.transAxes,
                      ha="center", va="center", fontsize="small", color="tab:gray")
    return figure


_PLOTTERS = {BatchSizeReport: plot_probe, AccumulationReport: plot_accumulate,
             NoiseReport: plot_noise, NoiseTrackerReport: plot_noise_tracker}


def plot(report: object, *, ax: Axes | None = None) -> Figure:
    """The plot for any report type (used by ``_repr_html_``)."""
    plotter = _PLOTTERS.get(type(report))
    if plotter is None:
        raise TypeError(f"report should be one of {[t.__name__ for t in _PLOTTERS]}, but got "
                        f"{type(report).__name__}.")
    return plotter(report, ax=ax)
