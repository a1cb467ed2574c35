"""IPython magics, each sugar over the public function of the same name (``%find_batch``,
``%%accumulate``).

Loaded by ``%load_ext batchwidgets``; nothing here is imported by ``import batchwidgets``.

Usage:
    %load_ext batchwidgets
    %find_batch model train_dataset --budget 16GiB --amp bf16
    %%accumulate 8
    %%accumulate 4 --noise
    report = %find_batch model --input-shape 3,32,32 --num-classes 10 -q
    %critical_batch model train_dataset --optimizer opt --noise noise_tracker
"""

from __future__ import annotations

import argparse
import collections
import weakref
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from ._notebook import (
    available,
    cell_call,
    example_shape,
    find_one,
    flags,
    given,
    in_flags,
    noise_tracker,
    parse,
    positive_int,
    probe_call,
    resolve,
    training_model,
)
from .engine import called_where, declared
from .engine.accumulate import AccumulateRequest, accumulate
from .engine.noise import CriticalBatchRequest, NoiseTracker, critical_batch
from .engine.probe import FindBatchRequest
from .results import AccumulationReport, BatchSizeReport, CriticalBatchReport
from .widgets import ProbePanel
from .widgets.noise import NoisePanel


def _has_widgets(shell: Any) -> bool:
    """A kernel with a front end (Jupyter, VS Code, Colab); not the terminal IPython."""
    return getattr(shell, "kernel", None) is not None


def _without_semicolon(line: str) -> tuple[str, bool]:
    stripped = line.rstrip()
    return (stripped[:-1], True) if stripped.endswith(";") else (line, False)


class _HideOnce:
    """Skips the next display of one report in the current cell: the panel above already shows
    it, or the line ended in ';', which IPython cannot see once the line is inside a magic."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.report: BatchSizeReport | None = None
        formatters = shell.display_formatter
        self._printers = ((formatters.ipython_display_formatter, self._display),  # kernels
                          (formatters.formatters["text/plain"], self._plain))  # IPython 7 terminal
        shell.events.register("post_run_cell", self.disarm)

    def arm(self, report: BatchSizeReport) -> None:
        self.report = report
        for formatter, printer in self._printers:
            formatter.for_type(BatchSizeReport, printer)

    def disarm(self, *_result: Any) -> None:
        self.report = None
        for formatter, _ in self._printers:
            formatter.pop(BatchSizeReport, None)

    def close(self) -> None:
        self.disarm()
        self.shell.events.unregister("post_run_cell", self.disarm)

    def _display(self, report: BatchSizeReport) -> None:
        if report is self.report:
            self.disarm()
            return
        formatter = self.shell.display_formatter.ipython_display_formatter
        formatter.pop(BatchSizeReport, None)
        try:  # another report: shown as usual
            display(report)
        finally:
            formatter.for_type(BatchSizeReport, self._display)

    def _plain(self, report: BatchSizeReport, printer: Any, _cycle: bool) -> None:
        if report is self.report:
            self.disarm()
        else:
            printer.text(str(report))  # the text form, as any report shows (issue 41)


def _noise_panel(shell: Any, tracker: NoiseTracker | None) -> NoisePanel | None:
    """A live NoisePanel shown above the cell's output, where widgets run."""
    if tracker is None or not _has_widgets(shell):
        return None
    panel = NoisePanel(tracker)
    display(panel)
    return panel


def _micro_batch(shell: Any, args: argparse.Namespace, model: Any = None,
                 probed: dict | None = None) -> dict[str, int]:
    """--batch-size B: the probe's recommended size is the micro-batch, N = ceil(B / micro)."""
    if args.batch_size is None:
        if args.probe is not None:
            raise UsageError("--probe goes with --batch-size, e.g. %%accumulate --batch-size "
                             "4096 --probe report.")
        return {}
    if args.steps is not None:
        raise UsageError(f"give N or --batch-size, not both, but got N={args.steps} and "
                         f"--batch-size {args.batch_size}.")
    probe = find_one(shell, args.probe, "--probe", False)
    if probe is None and isinstance(shell.user_ns.get("_"), BatchSizeReport):
        probe = shell.user_ns["_"]
        probed_model = (probed or {}).get(id(probe), lambda: None)()
        if model is not None and probed_model is not model:
            raise UsageError("--batch-size takes the micro-batch from a find_batch report, but "
                             "the last one (_) was not made by %find_batch for this cell's "
                             "model; run %find_batch on it first, or pass --probe NAME.")
    if probe is None:
        raise UsageError("--batch-size needs a find_batch report to take the micro-batch from: "
                         "run %find_batch first, or pass --probe NAME.")
    return {"micro_batch_size": probe.recommended_batch_size}


# NOTE [ The magics, a long module ]
# Every magic is a method of one Magics class (IPython registers them per class, and they share
# its panels and the reports %find_batch made), and each one's flags, with their help, are its
# manual (%critical_batch?): the argument lists are most of the module. The notebook lookups
# they share live in _notebook.py.
@magics_class
class BatchMagics(Magics):
    """``%find_batch``, ``%%accumulate`` and ``%critical_batch``; registered by
    ``%load_ext batchwidgets``."""

    LIVE_PANELS = 3  # %find_batch panels kept live; older ones are closed (static report stays)

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.hide_once = _HideOnce(shell)
        self.panels: collections.deque = collections.deque()
        # id(report) -> the model it probed, for %%accumulate --batch-size taking _
        self.probed: dict[int, weakref.ref] = {}

    def _keep(self, panel: ProbePanel) -> None:
        self.panels.append(panel)
        while len(self.panels) > self.LIVE_PANELS:
            self.panels.popleft().close()

    @magic_arguments()
    @argument("model", metavar="MODEL", nargs="?",
              help="the model (torch.nn.Module), or a step(batch_size) function that runs one "
                   "whole training step itself (leave out with %%%%find_batch)")
    @argument("make_batch", metavar="MAKE_BATCH", nargs="?",
              help="a make_batch(batch_size) function, a Dataset, a DataLoader or one example "
                   "tensor (leave out with --input-shape, or with a step function)")
    @flags(FindBatchRequest)  # every option of find_batch that has a flag (probe/_options.py)
    @argument("--input-shape", type=example_shape, metavar="SHAPE",
              help="instead of MAKE_BATCH: random inputs with one example of this shape, "
                   "e.g. 3,32,32")
    @argument("--num-classes", type=positive_int, metavar="N",
              help="with --input-shape: random labels in [0, N) too, and cross-entropy as the "
                   "loss unless --loss-fn is given")
    @argument("--var", metavar="NAME",
              help="%%%%find_batch: the cell's batch-size variable; the cell is your training "
                   "code for one step (or a loop, stopped after one step) at that size")
    @argument("-q", "--quiet", action="store_true",
              help="no panel: only the static report (a trailing ';' shows nothing)")
    @line_cell_magic
    def find_batch(self, line: str, cell: str | None = None) -> BatchSizeReport:
        """Find the largest batch size that trains: the same as ``batchwidgets.find_batch``.

        Each flag is a keyword argument of find_batch with '_' written '-', so
        ``%find_batch model data --max-batch-size 512`` is
        ``find_batch(model, data, max_batch_size=512)``. MODEL, MAKE_BATCH and the NAMEs are
        names in the notebook (dotted names such as ``trainer.model`` work too).

        The report is the value of the line: it is shown in the cell, kept in ``_``, and
        ``report = %find_batch ...`` keeps it. The same line again gives the answer it
        measured back at once (``report.remembered`` says when and where; ``--refresh``
        measures again, ``--no-cache`` neither reads nor writes). Where widgets run, a panel
        shows the progress, then memory and samples/s against the batch size, a headroom
        slider and a line of code.

        Examples::

          %find_batch model train_dataset --budget 16GiB --amp bf16
          %find_batch model --input-shape 3,32,32 --num-classes 10 --optimizer opt
          %find_batch model make_tokens --seq-len 128,256,512 --budget 16GiB
          %find_batch model train_dataset --target T4 --what-if
          %find_batch meta_llama make_tokens --target A100-80GB    # built on the meta device
          %find_batch meta_llama make_tokens --target 8xA100-80GB --parallel compare
          report = %find_batch model make_batch --headroom 0.8 -q
          %find_batch model train_dataset --budget 16GiB --refresh    # not the remembered one

        As a cell magic, the cell is your own training code for one step (or your loop, which
        the magic stops after one optimizer step), written with the batch-size variable that
        ``--var`` names: it runs at each size the search picks, under the same meter (fake
        tensors first, where the cell runs on them), and whatever your loop keeps, frees,
        clips, logs or accumulates is measured, not modelled. Every ``nn.Module``, optimizer,
        LR scheduler and ``GradScaler`` the cell names, and the RNGs, are as they were
        afterwards; names the cell rebinds get their values back, names it creates go. It is
        ``find_batch(model, step=<the cell>, optimizer=...)`` with the largest module the cell
        names; what the cell prints while it is probed is not shown::

          %%find_batch --var bs --budget 16GiB
          batch = {k: v[:bs] for k, v in examples.items()}
          outputs = model(**batch)
          outputs.loss.backward()
          optimizer.step()
          optimizer.zero_grad()
        """
        __tracebackhide__ = True  # IPython: the user's cell's frames, not the magic's
        line, silenced = _without_semicolon(line)
        args = parse(self.find_batch, line)
        probe = (probe_call(self.shell, args) if cell is None
                 else cell_call(self.shell, args, cell))
        panel = not (args.quiet or silenced) and _has_widgets(self.shell)
        try:
            if panel:
                self._keep(shown := ProbePanel(probe=probe))
                report = shown.run()
            else:
                report = probe()
        except Exception as error:
            if cell is None or not called_where(error):
                raise
            raise in_the_cell(error) from None
        if isinstance(probe.args[0], torch.nn.Module):
            self.probed = {key: ref for key, ref in self.probed.items() if ref() is not None}
            self.probed[id(report)] = weakref.ref(probe.args[0])
        if panel or silenced:  # the panel shows the report already; ';' shows nothing
            self.hide_once.arm(report)
        return report

    @magic_arguments()
    @flags(AccumulateRequest)  # N and the flags that are accumulate's keywords (its _options.py)
    @argument("--optimizer", metavar="NAME",
              help="the optimizer the cell steps (default: the only one in the notebook)")
    @argument("--scaler", metavar="NAME",
              help="the cell's GradScaler (default: the only one in the notebook, if any)")
    @argument("--scheduler", metavar="NAME",
              help="the LR scheduler to step once per update (default: the only one on the "
                   "optimizer, if any)")
    @argument("--model", metavar="NAME",
              help="the model (default: the one the optimizer trains); needed for DDP")
    @argument("--probe", metavar="NAME",
              help="with --batch-size: the find_batch report whose recommended_batch_size is "
                   "the micro-batch (default: the only one, or _)")
    @argument("--noise", metavar="NAME", nargs="?", const="",
              help="also track the gradient noise scale and per-batch losses, in a live panel: "
                   "a new NoiseTracker kept as noise_tracker, or the NoiseTracker NAME (auto "
                   "implies it)")
    @cell_magic
    def accumulate(self, line: str, cell: str) -> AccumulationReport:
        """Gradient accumulation around the cell: the same as ``batchwidgets.accumulate``.

        The cell is an ordinary training loop that calls ``loss.backward()``,
        ``optimizer.step()`` and ``optimizer.zero_grad()`` every iteration; inside, updates
        happen every N micro-steps and equal one update on a batch N times larger. The
        optimizer, scaler, scheduler and model are found in the notebook when there is one of
        each; with several, name the one to use. The report is the cell's value.

        ``--noise`` also follows the per-batch losses and the gradient noise scale from the
        micro-batches (``accumulate(..., noise=tracker)``): a bare ``--noise`` makes a new
        ``NoiseTracker`` and keeps it in the notebook as ``noise_tracker``; ``--noise NAME``
        goes on with the tracker NAME. Where widgets run, a ``NoisePanel`` above the output
        draws it while the cell runs; ``noise_tracker.report`` has the numbers and the advice.

        Examples::

          %%accumulate 8
          %%accumulate 4 --optimizer opt --scheduler warmup --model ddp_model
          %%accumulate --batch-size 4096 --probe report
          %%accumulate 4 --noise
          %%accumulate 4 --noise noise_tracker
          %%accumulate auto --noise noise_tracker

        ``auto`` (``accumulate(steps="auto", noise=tracker)``) ramps the micro-batches per
        update up to the tracker's schedule (``noise_tracker.report.schedule``) and scales the
        learning rate with it; the report lists every change. When the batch is well above the
        measured critical batch size, the report says that accumulating does not pay.
        """
        __tracebackhide__ = True  # IPython: the user's cell's frames, not the magic's
        line, silenced = _without_semicolon(line)
        args = parse(self.accumulate, line)
        if args.steps == "auto" and args.noise is None:
            args.noise = ""  # the schedule needs a tracker: a new one
        optimizer = find_one(self.shell, args.optimizer, "--optimizer", True)
        model = training_model(self.shell, args.model, optimizer)
        options = given(self.shell, AccumulateRequest, args)  # N, --remainder, ... as given
        options.update(
            _micro_batch(self.shell, args, model, self.probed),
            scaler=find_one(self.shell, args.scaler, "--scaler", False),
            scheduler=find_one(self.shell, args.scheduler, "--scheduler", False,
                                lambda v: getattr(v, "optimizer", None) is optimizer),
            model=model, noise=noise_tracker(self.shell, args.noise, args.steps))
        transformed = self.shell.transform_cell(cell)  # registered: tracebacks show its lines
        name = self.shell.compile.cache(transformed, self.shell.execution_count, raw_code=cell)
        code = self.shell.compile(transformed, name, "exec")
        panel = _noise_panel(self.shell, options["noise"])
        try:
            with accumulate(optimizer, **options) as acc:
                exec(code, self.shell.user_ns)  # the user's errors keep their traceback
        finally:
            if panel is not None:  # the last numbers, also in the saved notebook; then let go
                panel.refresh()
                panel.detach()
        return None if silenced else acc.report


    @magic_arguments()
    @argument("model", metavar="MODEL", help="the model (torch.nn.Module) at the weights to "
                                             "measure from")
    @argument("data", metavar="DATA", help="a map-style Dataset, or a DataLoader over one "
                                           "(its collate_fn builds the batches)")
    @argument("--optimizer", metavar="NAME",
              help="the model's optimizer (default: the only one in the notebook that trains "
                   "MODEL); its learning rate is the base batch's")
    @flags(CriticalBatchRequest)  # the flags that are critical_batch's keywords (noise/_options.py)
    @argument("--probe", metavar="NAME",
              help="a find_batch report: batches above what fits accumulate micro-batches")
    @argument("--noise", metavar="NAME",
              help="a NoiseTracker whose schedule (and %%%%accumulate auto) follows the "
                   "measured batch from now on")
    @line_magic
    def critical_batch(self, line: str) -> CriticalBatchReport | None:
        """Measure the critical batch from the model's current weights: the same as
        ``batchwidgets.critical_batch``. Short branched runs at a ladder of batch sizes, each
        to one target loss; the batch that needs twice the fewest examples (and twice the
        fewest steps) to get there, with an error bar over seeds, beside the noise scale
        B_simple at the same weights. The model, optimizer, scheduler and RNGs are as they
        were afterwards.

        Examples::

          %critical_batch model train_dataset --optimizer opt --loss-fn F.cross_entropy
          %critical_batch model loader --criterion loss --probe report
          %critical_batch model train_dataset --noise noise_tracker    # the schedule follows it
        """
        line, silenced = _without_semicolon(line)
        args = parse(self.critical_batch, line)
        model = resolve(self.shell, args.model, "MODEL")
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"MODEL should be a torch.nn.Module, but got MODEL={args.model} "
                             f"(a {type(model).__name__}); "
                             f"{available(self.shell, '--model')}.")
        data = resolve(self.shell, args.data, "DATA")
        optimizer = find_one(self.shell, args.optimizer, "--optimizer", False,
                             lambda o: _trains(o, model))
        if optimizer is None:
            raise UsageError(f"--optimizer is needed: no optimizer in the notebook trains "
                             f"{args.model}; {available(self.shell, '--optimizer')}.")
        options = given(self.shell, CriticalBatchRequest, args)
        if args.probe is not None:
            options["fits_batch_size"] = resolve(self.shell, args.probe, "--probe")
        tracker = resolve(self.shell, args.noise, "--noise")
        try:
            report = critical_batch(model, data, optimizer=optimizer, **options)
        except (TypeError, ValueError) as error:
            message = str(error)
            named = {name: "--probe" if name == "fits_batch_size" else
                     declared(CriticalBatchRequest, name).flag_name for name in options}
            if "\n" in message or not any(message.startswith(f"{name} should")
                                          for name in named):
                raise  # not about a flag: the engine's own error
            raise UsageError(in_flags(message, named)) from None
        if tracker is not None:
            tracker.critical = report
        return None if silenced else report


def in_the_cell(error: BaseException) -> BaseException:
    """A %%find_batch cell's error as the cell raised it (its traceback trimmed to the cell's
    frames), with one line saying at which batch size it ran (a PEP 678 note)."""
    cause = error.__cause__ if error.__cause__ is not None else error
    if cause is not error:
        cause.add_note(called_where(error))
    return cause


def _trains(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    """Whether ``optimizer`` steps the parameters of ``model``."""
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return any(id(p) in trained for p in model.parameters())


def load(ipython: Any) -> None:
    ipython.register_magics(BatchMagics)


def unload(ipython: Any) -> None:
    """Remove what ``load`` registered (IPython has no call for it)."""
    magics = ipython.magics_manager.registry.pop(BatchMagics.__name__, None)
    if magics is None:
        return
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    magics.hide_once.close()
    while magics.panels:
        magics.panels.popleft().close()
