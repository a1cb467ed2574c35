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
from matplotlib.ticker import ScalarFormatter

from .results import (
    AccumulationReport,
    BatchSizeReport,
    LiveLoaderReport,
    LoaderReport,
    NoiseReport,
    NoiseTrackerReport,
)

MIB = 2**20
LIVE_BARS = 24  # the settings a live loader's picture shows: the last ones run


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
    ran = sorted((a for a in report.attempts if a.fits and not a.fake),
                 key=lambda a: a.batch_size)
    traced = [a for a in report.attempts if a.fits and a.fake]
    failed = [a for a in report.attempts if not a.fits]
    memory_ax.plot([a.batch_size for a in ran], [(a.peak_memory_bytes or 0) / MIB for a in ran],
                   "o", color="tab:blue", label="ran")
    if traced:  # fake tensors: traced, not run
        memory_ax.plot([a.batch_size for a in traced],
                       [(a.peak_memory_bytes or 0) / MIB for a in traced], "o",
                       markerfacecolor="none", color="tab:blue", label="traced (fake)")
    memory_ax.plot([a.batch_size for a in failed],
                   [(a.peak_memory_bytes or 0) / MIB for a in failed],
                   "x", color="tab:red", markersize=9, label="out of memory")
    sizes = [a.batch_size for a in report.attempts]
    if report.target_peaks:  # a target plan: the target's replayed peaks, up to twice the answer
        memory_ax.plot([size for size, _ in report.target_peaks],
                       [peak / MIB for _, peak in report.target_peaks], "-", color="tab:gray",
                       alpha=0.8, label=f"predicted on {report.target}")
    elif report.peak_segments:  # the per-op model: piecewise linear, a kink per change of op
        kinks = sorted({1, *(s.batch_size for s in report.peak_segments), max(sizes)})
        memory_ax.plot(kinks, [report.predict_peak_bytes(x) / MIB for x in kinks], "-",
                       color="tab:gray", alpha=0.8, label="per-op model")
        inner = kinks[1:-1]
        memory_ax.plot(inner, [report.predict_peak_bytes(x) / MIB for x in inner], "|",
                       color="tab:gray", markersize=12)
    elif report.memory_model is not None:
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
    where = f"{report.target} (predicted)" if report.target else report.device
    memory_ax.set_title(f"memory on {where}: max batch {report.max_batch_size}")
    memory_ax.legend(fontsize="small", loc="lower right")
    timed = [a for a in ran if a.samples_per_s]  # out-of-memory and fake ones have no time
    if len(timed) > 1 or ax is not None:
        speed_ax.plot([a.batch_size for a in timed], [a.samples_per_s for a in timed], "o-",
                      color="tab:orange")
        speed_ax.set(xlabel="batch size", ylabel="samples/s", title="throughput")
    else:  # one point is no curve: its value, said
        _said_instead(speed_ax, "throughput", f"{timed[0].samples_per_s:.4g} samples/s at batch "
                      f"size {timed[0].batch_size}\n(the one size timed)" if timed else
                      "no size timed" + (" (a plan: nothing ran)" if report.target else ""))
    if ax is None and (report.memory_split is not None or report.frontier):
        _draw_probe_extras(figure, report)
    return figure


def _said_instead(ax: Axes, title: str, text: str) -> None:
    """A panel with one point (or none) says its value instead of plotting a lone marker."""
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize="large", transform=ax.transAxes)


def _draw_probe_extras(figure: Figure, report: BatchSizeReport) -> None:
    """Below the two panels: where the memory goes (one step over its ops, stacked by kind, or
    a stacked bar at the peak) and the length frontier."""
    figure.set_size_inches(9, 6.4)
    memory_ax, speed_ax = figure.axes[:2]
    grid = figure.add_gridspec(2, 2)
    memory_ax.set_subplotspec(grid[0, 0])
    speed_ax.set_subplotspec(grid[0, 1])
    split = report.memory_split
    if report.memory_timeline is not None:
        _draw_timeline(figure.add_subplot(grid[1, 0]), report)
    elif split is not None:
        bar_ax = figure.add_subplot(grid[1, 0])
        left = 0.0
        parts = (("parameters", split.parameters_bytes), ("gradients", split.gradients_bytes),
                 ("optimizer", split.optimizer_bytes), ("activations", split.activations_bytes),
                 ("temporaries", split.temporaries_bytes))
        for name, value in parts:
            bar_ax.barh([0], [value / MIB], left=left, label=name)
            left += value / MIB
        bar_ax.set_yticks([])
        bar_ax.set_xlabel("MiB at the peak")
        bar_ax.set_title(f"where the memory goes at batch size {split.batch_size}")
        bar_ax.legend(fontsize="small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if report.frontier:
        frontier_ax = figure.add_subplot(grid[1, 1])
        lengths = list(report.frontier)
        if len(lengths) == 1:
            _said_instead(frontier_ax, "the (batch, length) frontier",
                          f"batch size {report.frontier[lengths[0]]} at length {lengths[0]}\n"
                          f"(the one length probed)")
            return
        frontier_ax.plot(lengths, list(report.frontier.values()), "o-", color="tab:purple")
        frontier_ax.set_xscale("log", base=2)
        frontier_ax.set(xlabel="sequence length", ylabel="largest batch size",
                        title="the (batch, length) frontier")


TIMELINE_LABELS = {"parameter": "parameters", "optimizer": "optimizer state",
                   "gradient": "gradients", "activation": "activations (saved)",
                   "temporary": "temporaries"}


def _draw_timeline(ax: Axes, report: BatchSizeReport) -> None:
    """One step's live memory over its ops, stacked by kind (as PyTorch's memory timeline),
    with the forward, backward and optimizer step, the peak and the limit marked."""
    timeline = report.memory_timeline
    ax.stackplot(timeline.ops, *[[b / MIB for b in timeline.by_kind[kind]]
                                 for kind in timeline.by_kind],
                 labels=[TIMELINE_LABELS.get(kind, kind) for kind in timeline.by_kind])
    for name, first, last in timeline.phases:
        if name in ("forward", "backward", "optimizer step") and last > first:
            ax.axvline(first, color="tab:gray", linewidth=0.6, alpha=0.6)
            ax.annotate(name, (first, 1), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", ha="left", va="top", fontsize="x-small")
    ax.plot([timeline.peak_op], [timeline.peak_bytes / MIB], "v", color="black",
            label=f"peak {timeline.peak_bytes / MIB:.1f} MiB")
    if report.limit_bytes is not None:
        ax.axhline(report.limit_bytes / MIB, color="tab:red", linestyle=":",
                   label="budget" if report.budget_bytes else "device limit")
    ax.set_xlim(0, max(timeline.n_ops - 1, 1))
    ax.set_xlabel("op of the step")
    ax.set_ylabel("live memory (MiB)")
    ax.set_title(f"one step at batch size {timeline.batch_size}, over its ops")
    ax.legend(fontsize="x-small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))


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


def _draw_losses(ax: Axes, report: NoiseTrackerReport) -> None:
    """Each batch's loss, its rolling mean and a band of one rolling standard deviation."""
    n_seen = report.n_losses_seen
    batches = range(n_seen - len(report.losses) + 1, n_seen + 1)
    ax.plot(batches, report.losses, ".", color="tab:blue", markersize=3, alpha=0.5,
            label="per batch")
    means, stds = report.rolling_loss()
    if len(means) > 1:
        ax.plot(batches, means, "-", color="tab:blue",
                label=f"rolling mean ({report.loss_window} batches)")
        ax.fill_between(batches, [m - s for m, s in zip(means, stds)],
                        [m + s for m, s in zip(means, stds)], color="tab:blue", alpha=0.2,
                        linewidth=0, label="± 1 std")
        ax.legend(fontsize="small", loc="upper right")
    ax.set(xlabel="batch", ylabel="loss", title="per-batch loss")


def _draw_noise_scale(ax: Axes, report: NoiseTrackerReport) -> None:
    """B_simple over the updates with a band of one standard error, and the current batch."""
    errors = report.history_errors or (None,) * len(report.history)
    points = [(entry[0], entry[1], error) for entry, error in zip(report.history, errors)
              if entry[1] is not None]
    ax.plot([u for u, _, _ in points], [b for _, b, _ in points], "-", color="tab:orange",
            label="B_simple")
    banded = [(u, b, e) for u, b, e in points if e is not None]
    if banded:
        ax.fill_between([u for u, _, _ in banded], [b - e for _, b, e in banded],
                        [b + e for _, b, e in banded], color="tab:orange", alpha=0.25,
                        linewidth=0, label="± 1 standard error")
    if points and report.current_batch_size:
        ax.axhline(report.current_batch_size, color="tab:gray", linestyle="--",
                   label=f"current batch {report.current_batch_size}")
    if points and report.measurable and report.schedule.changes:
        ax.axhline(report.schedule.batch_size, color="tab:green", linestyle=":",
                   label=f"schedule from here {report.schedule.batch_size}")
    if points:
        ax.legend(fontsize="small", loc="lower right")
    ax.set_xlabel("update")
    ax.set_ylabel(f"B_simple ({report.unit})")
    ax.set_title("noise scale B_simple" if report.measurable
                 else "noise scale: not measurable yet")
    if not report.measurable:
        ax.text(0.5, 0.97, textwrap.fill(report.reason, 50), transform=ax.transAxes,
                ha="center", va="top", fontsize="small", color="tab:gray",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})


def plot_noise_tracker(report: NoiseTrackerReport, *, ax: Axes | None = None) -> Figure:
    """Per-batch loss, and the noise scale B_simple over the updates (where measurable)."""
    if ax is not None:
        figure, loss_ax, noise_ax = ax.figure, ax, ax.twinx()
    else:
        figure = Figure(figsize=(9, 3.2), layout="constrained")
        loss_ax, noise_ax = figure.subplots(1, 2)
    _draw_losses(loss_ax, report)
    _draw_noise_scale(noise_ax, report)
    return figure


def _draw_variance(ax: Axes, report: NoiseTrackerReport, noise_report: NoiseReport | None) -> None:
    """Mini-batch gradient variance against B: the tracker's tr(Σ)/B through the two batch sizes
    it measured, and measure_noise's variance at each of its batch sizes, on log axes."""
    sizes: list[float] = []
    if noise_report is not None:
        variances = noise_report.grad_variance
        measured = sorted(b for b in variances if variances[b] > 0)
        ax.plot(measured, [variances[b] for b in measured], "o", color="tab:blue",
                label="measure_noise")
        if measured:
            ax.plot(measured, [noise_report.trace_cov / b for b in measured], "--",
                    color="tab:blue", alpha=0.6, label="measure_noise tr(Σ)/B")
        sizes += measured
    tracked = (report.trace_cov is not None and report.trace_cov > 0
               and report.micro_batch_size is not None and report.n_micro is not None)
    if tracked:
        small, big = report.micro_batch_size, report.micro_batch_size * report.n_micro
        crossing = (report.trace_cov / report.grad_norm_sq  # where |G|^2 = tr(Σ)/B
                    if report.grad_norm_sq is not None and report.grad_norm_sq > 0 else big)
        span = [min([small, *sizes]), max([big, *sizes, min(crossing, 100 * big)])]
        ax.plot(span, [report.trace_cov / b for b in span], "-", color="tab:orange",
                label="tracker tr(Σ)/B")
        ax.plot([small, big], [report.trace_cov / small, report.trace_cov / big], "s",
                color="tab:orange", label=f"measured at B = {small}, {big}")
        if report.grad_norm_sq is not None and report.grad_norm_sq > 0:
            ax.axhline(report.grad_norm_sq, color="tab:red", linestyle=":",
                       label="|G|² (crosses at B_simple)")
    if tracked or sizes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_yscale("log")
        ax.legend(fontsize="small", loc="lower left")
    else:
        ax.text(0.5, 0.5, "no variance measured yet", transform=ax.transAxes, ha="center",
                va="center", fontsize="small", color="tab:gray")
    ax.set(xlabel=f"batch size B ({report.unit})", ylabel="gradient variance (trace)",
           title="variance falls as 1/B")


def plot_noise_panel(report: NoiseTrackerReport,
                     noise_report: NoiseReport | None = None) -> Figure:
    """What ``NoisePanel`` shows, in three axes: the per-batch loss with its rolling mean and a
    band of one standard deviation; the gradient variance against the batch size with the 1/B
    line (the tracker's, and ``noise_report``'s points from ``measure_noise`` if given); the
    noise scale B_simple over the updates with a band of one standard error."""
    figure = Figure(figsize=(13, 3.6))
    # fixed margins: constrained layout would double the time of each live redraw
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.92, wspace=0.22)
    loss_ax, variance_ax, noise_ax = figure.subplots(1, 3)
    _draw_losses(loss_ax, report)
    _draw_variance(variance_ax, report, noise_report)
    _draw_noise_scale(noise_ax, report)
    return figure


_PLOTTERS = {BatchSizeReport: plot_probe, AccumulationReport: plot_accumulate,
             NoiseReport: plot_noise, NoiseTrackerReport: plot_noise_tracker}
_FIGURES = {NoiseTrackerReport: plot_noise_panel}  # a whole figure, where no ax is given


def plot(report: object, *, ax: Axes | None = None) -> Figure:
    """The plot for any report type (used by ``_repr_html_``)."""
    plotter = _PLOTTERS.get(type(report))
    if plotter is None:
        raise TypeError(f"report should be one of {[t.__name__ for t in _PLOTTERS]}, but got "
                        f"{type(report).__name__}.")
    if ax is None and type(report) in _FIGURES:
        return _FIGURES[type(report)](report)
    return plotter(report, ax=ax)


def plot_loader(report: LoaderReport, *, ax: Axes | None = None) -> Figure:
    """samples/s of each DataLoader setting tried, in the order measured: the best in green,
    failed settings in red, the current one outlined, each with its time to the first batch."""
    trials = report.trials
    if ax is None:
        figure = Figure(figsize=(7, 1.2 + 0.42 * len(trials)), layout="constrained")
        ax = figure.subplots()
    figure = ax.figure
    colors = ["tab:green" if i == report.best_index else "tab:blue" if t.ok else "tab:red"
              for i, t in enumerate(trials)]
    rows = range(len(trials))
    bars = ax.barh(rows, [t.samples_per_s for t in trials], color=colors)
    bars[report.current_index].set(edgecolor="black", linewidth=1.5)
    ax.set_yticks(list(rows), [t.label for t in trials], fontsize="small")
    ax.invert_yaxis()  # first measured on top
    for i, t in enumerate(trials):
        note = f" first batch {t.first_batch_s:.2f} s" if t.ok else f" failed: {t.error}"
        ax.text(t.samples_per_s, i, textwrap.shorten(note, 60), va="center", fontsize="small")
    ax.set_xlabel("samples/s (steady state, warm-up excluded)")
    ax.margins(x=0.35)
    ax.set_title(f"input pipeline on {report.device}: {len(trials)} of {report.grid_size} "
                 f"settings tried")
    return figure


_PLOTTERS[LoaderReport] = plot_loader


def plot_live_loader(report: LiveLoaderReport, *, ax: Axes | None = None) -> Figure:
    """The training loop's own samples/s with each of the last ``LIVE_BARS`` settings a live
    loader ran (one bar each, in the order run; the one in force outlined), with its data stall."""
    segments = report.segments[-LIVE_BARS:]
    if ax is None:
        figure = Figure(figsize=(7, 1.2 + 0.42 * max(1, len(segments))), layout="constrained")
        ax = figure.subplots()
    rows = range(len(segments))
    bars = ax.barh(rows, [s.samples_per_s for s in segments], color="tab:blue")
    if segments:
        bars[-1].set(edgecolor="black", linewidth=1.5)
    ax.set_yticks(list(rows), [f"{s.label} (from {s.epoch}:{s.batch})" for s in segments],
                  fontsize="small")
    ax.invert_yaxis()  # first run on top
    for i, s in enumerate(segments):
        ax.text(s.samples_per_s, i, f" {s.stall_fraction:.0%} waiting, {s.n_batches} batches",
                va="center", fontsize="small")
    ax.set_xlabel("samples/s of the training loop (its steps and its waits for data)")
    ax.margins(x=0.45)
    switches, run = len(report.switches), len(report.segments)
    more = f" (the last {len(segments)} of {run} settings run)" if run > LIVE_BARS else ""
    ax.set_title(f"the running loop, {switches} switch{'' if switches == 1 else 'es'}{more}")
    return ax.figure


_PLOTTERS[LiveLoaderReport] = plot_live_loader
