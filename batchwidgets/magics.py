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
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from ._notebook import (
    available,
    budget_size,
    device_name,
    example_shape,
    find_one,
    flags,
    fraction,
    gpu_target,
    lengths,
    noise_tracker,
    parse,
    positive_int,
    probe_call,
    resolve,
    training_model,
)
from .engine.accumulate import accumulate
from .engine.noise import NoiseTracker, critical_batch
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
        return {"steps": args.steps or 4}
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
    return {"batch_size": args.batch_size, "micro_batch_size": probe.recommended_batch_size}


def _steps_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


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
    @argument("model", metavar="MODEL",
              help="the model (torch.nn.Module), or a step(batch_size) function that runs one "
                   "whole training step itself")
    @argument("make_batch", metavar="MAKE_BATCH", nargs="?",
              help="a make_batch(batch_size) function, a Dataset, a DataLoader or one example "
                   "tensor (leave out with --input-shape, or with a step function)")
    @argument("--loss-fn", metavar="NAME",
              help="loss_fn(output, target) (default: the output's .loss, or its mean)")
    @argument("--optimizer", metavar="NAME",
              help="a torch.optim.Optimizer (default: a fresh AdamW)")
    @argument("--device", type=device_name, help="cpu, cuda, cuda:1 or mps (default: the model's)")
    @argument("--budget", type=budget_size, metavar="SIZE",
              help="memory cap such as 512MB or 16GiB; on CUDA it emulates a smaller GPU "
                   "(default: the whole GPU; half of the available RAM on the CPU)")
    @argument("--amp", choices=["bf16", "fp16"], help="probe under autocast")
    @argument("--max-batch-size", type=positive_int, metavar="N",
              help="largest batch size to try")
    @argument("--multiple-of", type=positive_int, metavar="N",
              help="try only multiples of N (default: 1)")
    @argument("--headroom", type=fraction, metavar="F",
              help="recommend at most F x max_batch_size (default: 0.9)")
    @argument("--scheduler", metavar="NAME", help="an LR scheduler to restore afterwards")
    @argument("--scaler", metavar="NAME", help="a GradScaler to use and restore afterwards")
    @argument("--steps-per-trial", type=positive_int, metavar="N",
              help="training steps at each batch size (default: 2)")
    @argument("--start", type=positive_int, metavar="N", help="first batch size tried")
    @argument("--input-shape", type=example_shape, metavar="SHAPE",
              help="instead of MAKE_BATCH: random inputs with one example of this shape, "
                   "e.g. 3,32,32")
    @argument("--num-classes", type=positive_int, metavar="N",
              help="with --input-shape: random labels in [0, N) too, and cross-entropy as the "
                   "loss unless --loss-fn is given")
    @argument("--step", metavar="NAME",
              help="your own step(batch_size) that trains MODEL: MODEL is then protected and "
                   "counted (leave MAKE_BATCH out)")
    @argument("--seq-len", type=lengths, metavar="N,N,...",
              help="sequence lengths, e.g. 128,256,512: MAKE_BATCH is make_batch(batch_size, "
                   "seq_len) and the report's frontier maps each length to its largest batch")
    @argument("--target", type=gpu_target, metavar="GPU",
              help="predict for a GPU that is not here: T4, L4, A10G, V100-16GB, A100-40GB, "
                   "A100-80GB, H100-80GB, H200, or a size such as 24GiB; 8xA100-80GB for "
                   "8 of them with --parallel (predicted, not run)")
    @argument("--parallel", choices=("ddp", "zero1", "zero2", "zero3", "fsdp", "compare"),
              help="with --target NxGPU (e.g. 8xA100-80GB): plan each rank under DDP, ZeRO "
                   "stage 1-3 or FSDP2, or compare them; the answer is per rank")
    @argument("--trace", choices=("fake", "real"),
              help="how a --target plan traces its small sizes: on fake tensors (nothing runs; "
                   "the default, and the only way for a model on the meta device) or by real "
                   "steps")
    @argument("--what-if", action="store_true",
              help="also probe under bf16, fp16, SGD and foreach=False (report.what_if)")
    @argument("-q", "--quiet", action="store_true",
              help="no panel: only the static report (a trailing ';' shows nothing)")
    @line_magic
    def find_batch(self, line: str) -> BatchSizeReport:
        """Find the largest batch size that trains: the same as ``batchwidgets.find_batch``.

        Each flag is a keyword argument of find_batch with '_' written '-', so
        ``%find_batch model data --max-batch-size 512`` is
        ``find_batch(model, data, max_batch_size=512)``. MODEL, MAKE_BATCH and the NAMEs are
        names in the notebook (dotted names such as ``trainer.model`` work too).

        The report is the value of the line: it is shown in the cell, kept in ``_``, and
        ``report = %find_batch ...`` keeps it. Where widgets run, a panel shows the progress,
        then memory and samples/s against the batch size, a headroom slider and a line of code.

        Examples::

          %find_batch model train_dataset --budget 16GiB --amp bf16
          %find_batch model --input-shape 3,32,32 --num-classes 10 --optimizer opt
          %find_batch model make_tokens --seq-len 128,256,512 --budget 16GiB
          %find_batch model train_dataset --target T4 --what-if
          %find_batch meta_llama make_tokens --target A100-80GB    # built on the meta device
          %find_batch meta_llama make_tokens --target 8xA100-80GB --parallel compare
          report = %find_batch model make_batch --headroom 0.8 -q
        """
        line, silenced = _without_semicolon(line)
        args = parse(self.find_batch, line)
        probe = probe_call(self.shell, args)
        panel = not (args.quiet or silenced) and _has_widgets(self.shell)
        if panel:
            self._keep(shown := ProbePanel(probe=probe))
            report = shown.run()
        else:
            report = probe()
        if isinstance(probe.args[0], torch.nn.Module):
            self.probed = {key: ref for key, ref in self.probed.items() if ref() is not None}
            self.probed[id(report)] = weakref.ref(probe.args[0])
        if panel or silenced:  # the panel shows the report already; ';' shows nothing
            self.hide_once.arm(report)
        return report

    @magic_arguments()
    @argument("steps", metavar="N", nargs="?", type=_steps_or_auto,
              help="micro-steps per optimizer update (default: 4), or auto: follow the noise "
                   "tracker's batch-size schedule (implies --noise)")
    @argument("--optimizer", metavar="NAME",
              help="the optimizer the cell steps (default: the only one in the notebook)")
    @argument("--scaler", metavar="NAME",
              help="the cell's GradScaler (default: the only one in the notebook, if any)")
    @argument("--scheduler", metavar="NAME",
              help="the LR scheduler to step once per update (default: the only one on the "
                   "optimizer, if any)")
    @argument("--model", metavar="NAME",
              help="the model (default: the one the optimizer trains); needed for DDP")
    @argument("--remainder", choices=["apply", "drop"],
              help="micro-steps left at the end: one smaller step (apply, the default) or none")
    @argument("--track-grad-norms", action="store_true",
              help="record each micro-batch's gradient norm in the report")
    @argument("--batch-size", type=positive_int, metavar="B",
              help="instead of N: the batch each update should see; the micro-batch is the "
                   "probe report's recommended_batch_size and N = ceil(B / micro-batch)")
    @argument("--probe", metavar="NAME",
              help="with --batch-size: the find_batch report (default: the only one, or _)")
    @argument("--noise", metavar="NAME", nargs="?", const="",
              help="also track the gradient noise scale and per-batch losses, in a live panel: "
                   "a new NoiseTracker kept as noise_tracker, or the NoiseTracker NAME")
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
        line, silenced = _without_semicolon(line)
        args = parse(self.accumulate, line)
        if args.steps == "auto" and args.noise is None:
            args.noise = ""  # the schedule needs a tracker: a new one
        optimizer = find_one(self.shell, args.optimizer, "--optimizer", True)
        model = training_model(self.shell, args.model, optimizer)
        options = _micro_batch(self.shell, args, model, self.probed)
        options.update(
            scaler=find_one(self.shell, args.scaler, "--scaler", False),
            scheduler=find_one(self.shell, args.scheduler, "--scheduler", False,
                                lambda v: getattr(v, "optimizer", None) is optimizer),
            model=model,
            remainder=args.remainder or "apply", track_grad_norms=args.track_grad_norms,
            noise=noise_tracker(self.shell, args.noise))
        code = compile(self.shell.transform_cell(cell), "<%%accumulate cell>", "exec")
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
    @argument("--loss-fn", metavar="NAME",
              help="loss_fn(output, target) (default: the output's .loss)")
    @argument("--scheduler", metavar="NAME", help="an LR scheduler stepped in the branches")
    @argument("--target-loss", type=float, metavar="X",
              help="the loss every branch runs to (default: 90%% of the way to the loss the "
                   "base batch reaches in --base-steps steps)")
    @argument("--base-batch-size", type=positive_int, metavar="N",
              help="the ladder's first batch (default: the DataLoader's, else 8)")
    @argument("--batch-sizes", type=lengths, metavar="N,N,...",
              help="the ladder, e.g. 8,16,32,64,128 (default: the base x 1, 2, 4 ... 32)")
    @argument("--base-steps", type=positive_int, metavar="N",
              help="steps of the base batch that set the target (default: 64)")
    @argument("--max-steps", type=positive_int, metavar="N",
              help="steps a branch may take (default: 4 x --base-steps)")
    @argument("--seeds", type=positive_int, metavar="N",
              help="draws of the batches; two or more give an error bar (default: 2)")
    @argument("--lr-scaling", choices=("linear", "sqrt", "none"),
              help="how each branch's learning rate follows its batch (default: sqrt for the "
                   "Adam family, linear otherwise)")
    @argument("--criterion", choices=("steps", "loss"),
              help="loss: also Merrill et al.'s largest batch within 1%% of the base's loss at "
                   "equal examples")
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
        options: dict[str, Any] = {
            name: getattr(args, name) for name in (
                "target_loss", "base_batch_size", "batch_sizes", "base_steps", "max_steps",
                "seeds", "lr_scaling", "criterion") if getattr(args, name) is not None}
        options.update(loss_fn=resolve(self.shell, args.loss_fn, "--loss-fn"),
                       scheduler=resolve(self.shell, args.scheduler, "--scheduler"),
                       fits_batch_size=resolve(self.shell, args.probe, "--probe"))
        tracker = resolve(self.shell, args.noise, "--noise")
        try:
            report = critical_batch(model, data, optimizer=optimizer, **options)
        except (TypeError, ValueError) as error:
            message = str(error)
            named = [name for name in options if message.startswith(f"{name} should")]
            if "\n" in message or not named:  # not about a flag: the engine's own error
                raise
            raise UsageError(flags(message, named)) from None
        if tracker is not None:
            tracker.critical = report
        return None if silenced else report


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
