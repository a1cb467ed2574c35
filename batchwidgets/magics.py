"""IPython magics, each sugar over the public function of the same name (``%find_batch``,
``%%accumulate``).

Loaded by ``%load_ext batchwidgets``; nothing here is imported by ``import batchwidgets``.

Usage:
    %load_ext batchwidgets
    %find_batch model train_dataset --budget 16GiB --amp bf16
    %%accumulate 8
    report = %find_batch model --input-shape 3,32,32 --num-classes 10 -q
"""

from __future__ import annotations

import argparse
import difflib
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from .engine import find_batch, parse_bytes
from .engine.accumulate import accumulate
from .results import AccumulationReport, BatchSizeReport
from .widgets import ProbePanel

# find_batch options given as values (the rest name objects in the notebook; see _ROLES)
_VALUE_OPTIONS = ("device", "budget", "amp", "max_batch_size", "multiple_of", "headroom",
                  "steps_per_trial", "start")
_NAMED_OPTIONS = {"loss_fn": "--loss-fn", "optimizer": "--optimizer",
                  "scheduler": "--scheduler", "scaler": "--scaler"}


def _is_function(value: Any) -> bool:
    return callable(value) and not isinstance(value, type)


def _is_batch_source(value: Any) -> bool:  # what find_batch accepts; map-style data included
    return (isinstance(value, _DATA) or _is_function(value)
            or (hasattr(value, "__getitem__") and hasattr(value, "__len__")
                and not isinstance(value, (str, bytes, dict, type))))


@dataclass(frozen=True)
class _Role:
    """What the name given for one argument may be, and which notebook names to suggest."""

    expected: str
    plural: str
    accepts: Callable[[Any], bool]
    listed: Callable[[Any], bool]


_DATA = (torch.Tensor, torch.utils.data.Dataset, torch.utils.data.DataLoader)
_FUNCTIONS = (types.FunctionType, functools.partial)
_ROLES = {
    "MODEL": _Role("a torch.nn.Module or a step(batch_size) function", "models", _is_function,
                   lambda v: isinstance(v, torch.nn.Module)),
    "MAKE_BATCH": _Role("a make_batch(batch_size) function, a Dataset, a DataLoader or an "
                        "example tensor", "batch sources", _is_batch_source,
                        lambda v: isinstance(v, (*_DATA, *_FUNCTIONS))),
    "--loss-fn": _Role("a loss function, loss_fn(output, target)", "loss functions",
                       _is_function, lambda v: isinstance(v, _FUNCTIONS)
                       or type(v).__name__.endswith("Loss")),
    "--optimizer": _Role("a torch.optim.Optimizer", "optimizers",
                         lambda v: isinstance(v, torch.optim.Optimizer),
                         lambda v: isinstance(v, torch.optim.Optimizer)),
    "--scheduler": _Role("a learning-rate scheduler", "schedulers",
                         lambda v: hasattr(v, "get_last_lr"), lambda v: hasattr(v, "get_last_lr")),
    "--scaler": _Role("a torch.amp.GradScaler", "scalers", lambda v: hasattr(v, "unscale_"),
                      lambda v: hasattr(v, "unscale_")),
    "--model": _Role("a torch.nn.Module", "models", lambda v: isinstance(v, torch.nn.Module),
                     lambda v: isinstance(v, torch.nn.Module)),
    "--probe": _Role("a find_batch report (BatchSizeReport)", "probe reports",
                     lambda v: isinstance(v, BatchSizeReport),
                     lambda v: isinstance(v, BatchSizeReport)),
}


def _available(shell: Any, role: str) -> str:
    hidden = shell.user_ns_hidden
    names = sorted(name for name, value in shell.user_ns.items()
                   if not name.startswith("_") and name not in hidden
                   and _ROLES[role].listed(value))
    plural = _ROLES[role].plural
    return f"{plural} in the notebook: {', '.join(names)}" if names else f"no {plural} there"


def _resolve(shell: Any, text: str | None, role: str) -> Any:
    """The object a (dotted) notebook name refers to; a one-line UsageError if there is none."""
    if text is None:
        return None
    root, *attributes = text.split(".")
    if root not in shell.user_ns:
        close = difflib.get_close_matches(root, [n for n in shell.user_ns if n[:1] != "_"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise UsageError(f"{role}: name {root!r} is not defined in the notebook{hint} "
                         f"{_available(shell, role)}.")
    value = shell.user_ns[root]
    for depth, attribute in enumerate(attributes):
        if not hasattr(value, attribute):
            owner = ".".join([root, *attributes[:depth]])
            raise UsageError(f"{role}: {owner} (a {type(value).__name__}) has no attribute "
                             f"{attribute!r}.")
        value = getattr(value, attribute)
    if not _ROLES[role].accepts(value):
        raise UsageError(f"{role} should be {_ROLES[role].expected}, but got {role}={text} "
                         f"(a {type(value).__name__}); {_available(shell, role)}.")
    return value


@dataclass(frozen=True)
class _SyntheticBatches:
    """``--input-shape``: random inputs of that shape, with random labels given ``num_classes``."""

    input_shape: tuple[int, ...]
    num_classes: int | None = None

    def __call__(self, batch_size: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(batch_size, *self.input_shape)
        if self.num_classes is None:
            return inputs
        return inputs, torch.randint(0, self.num_classes, (batch_size,))


def _make_batch(shell: Any, args: argparse.Namespace, model: Any) -> Any:
    if args.input_shape is not None:
        if args.make_batch is not None:
            raise UsageError(f"give MAKE_BATCH or --input-shape, not both, but got "
                             f"MAKE_BATCH={args.make_batch} and --input-shape "
                             f"{','.join(map(str, args.input_shape))}.")
        return _SyntheticBatches(args.input_shape, args.num_classes)
    if args.num_classes is not None:
        raise UsageError("--num-classes goes with --input-shape (synthetic batches), e.g. "
                         "--input-shape 3,32,32 --num-classes 10.")
    if args.make_batch is None and isinstance(model, torch.nn.Module):
        raise UsageError(f"MAKE_BATCH is needed with a model (or --input-shape 3,32,32 for "
                         f"synthetic batches); {_available(shell, 'MAKE_BATCH')}.")
    return _resolve(shell, args.make_batch, "MAKE_BATCH")


def _probe(shell: Any, args: argparse.Namespace) -> functools.partial:
    """``find_batch`` with the notebook's objects and only the options given (its defaults stay)."""
    model = _resolve(shell, args.model, "MODEL")
    make_batch = _make_batch(shell, args, model)
    options = {name: getattr(args, name) for name in _VALUE_OPTIONS
               if getattr(args, name) is not None}
    options.update({name: _resolve(shell, getattr(args, name), flag)
                    for name, flag in _NAMED_OPTIONS.items() if getattr(args, name) is not None})
    if args.num_classes is not None:
        options.setdefault("loss_fn", torch.nn.functional.cross_entropy)
    return functools.partial(find_batch, model, make_batch, **options)


# -- argument types: a bad value is a one-line UsageError naming what would do -------------------

def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"should be a positive integer, but got {text!r}.")
    return int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"should be in (0, 1], but got {text!r}; use e.g. 0.9 "
                                         f"to keep 10% of the memory free.")
    return value


def _budget(text: str) -> str:
    try:
        parse_bytes(text, "budget")
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text  # find_batch parses it again, exactly as when called with the string


def _shape(text: str) -> tuple[int, ...]:
    parts = text.replace("x", ",").strip("()").split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"should be the shape of one example such as 3,32,32, "
                                         f"but got {text!r}.")
    return tuple(int(part) for part in parts)


def _devices_here() -> list[str]:
    devices = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    return [*devices, "mps"] if torch.backends.mps.is_available() else devices


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    missing = device is not None and (
        (device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count())
        or (device.type == "mps" and not torch.backends.mps.is_available()))
    if device is None or missing:
        raise argparse.ArgumentTypeError(f"should be a device of this machine, but got {text!r}; "
                                         f"available here: {', '.join(_devices_here())}.")
    return text


def _parse(magic: Callable, line: str) -> argparse.Namespace:
    """``parse_argstring``, naming the nearest flag when one is misspelt."""
    try:
        return parse_argstring(magic, line)
    except UsageError as error:
        unknown = [word for word in str(error).split() if word.startswith("-")]
        if not str(error).startswith("unrecognized arguments") or not unknown:
            raise
        flags = sorted(flag for flag in magic.parser._option_string_actions if flag[:2] == "--")
        close = difflib.get_close_matches(unknown[0], flags, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"{error}; {hint}flags: {', '.join(flags)} "
                         f"(see %{magic.__name__}?).") from None


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
            printer.text(repr(report))


# -- %%accumulate: find the one optimizer (scaler, scheduler, model) the cell trains with --------

def _candidates(shell: Any, role: str, belongs: Callable[[Any], bool] = lambda v: True) -> dict:
    hidden = shell.user_ns_hidden
    found: dict[int, tuple[str, Any]] = {}
    for name, value in shell.user_ns.items():
        if name.startswith("_") or name in hidden or not _ROLES[role].listed(value):
            continue
        if belongs(value) and id(value) not in found:  # one object under two names counts once
            found[id(value)] = (name, value)
    return dict(found.values())


def _find_one(shell: Any, text: str | None, role: str, required: bool,
              belongs: Callable[[Any], bool] = lambda v: True) -> Any:
    """The object named by ``text``, else the single one in the notebook (UsageError if several)."""
    if text is not None:
        return _resolve(shell, text, role)
    return _only(_candidates(shell, role, belongs), role, required)


def _only(found: dict, role: str, required: bool) -> Any:
    if len(found) > 1:
        raise UsageError(f"{len(found)} {_ROLES[role].plural} in the notebook could be meant: "
                         f"{', '.join(sorted(found))}; pick one with {role} NAME.")
    if not found and required:
        raise UsageError(f"no {_ROLES[role].plural} in the notebook ({_ROLES[role].expected}); "
                         f"create one or pass {role} NAME.")
    return next(iter(found.values()), None)


def _training_model(shell: Any, text: str | None, optimizer: Any) -> Any:
    """--model, else the model whose parameters the optimizer trains (a DDP wrapper first)."""
    if text is not None:
        return _resolve(shell, text, "--model")
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def trains(module: Any) -> bool:
        params = list(module.parameters())
        return bool(params) and all(id(p) in trained for p in params)

    found = _candidates(shell, "--model", trains)
    wrappers = {n: m for n, m in found.items()
                if isinstance(m, torch.nn.parallel.DistributedDataParallel)}
    return _only(wrappers or found, "--model", False)


def _micro_batch(shell: Any, args: argparse.Namespace) -> dict[str, int]:
    """--batch-size B: the probe's recommended size is the micro-batch, N = ceil(B / micro)."""
    if args.batch_size is None:
        if args.probe is not None:
            raise UsageError("--probe goes with --batch-size, e.g. %%accumulate --batch-size "
                             "4096 --probe report.")
        return {"steps": args.steps or 4}
    if args.steps is not None:
        raise UsageError(f"give N or --batch-size, not both, but got N={args.steps} and "
                         f"--batch-size {args.batch_size}.")
    probe = _find_one(shell, args.probe, "--probe", False)
    if probe is None and isinstance(shell.user_ns.get("_"), BatchSizeReport):
        probe = shell.user_ns["_"]
    if probe is None:
        raise UsageError("--batch-size needs a find_batch report to take the micro-batch from: "
                         "run %find_batch first, or pass --probe NAME.")
    return {"batch_size": args.batch_size, "micro_batch_size": probe.recommended_batch_size}


@magics_class
class BatchMagics(Magics):
    """``%find_batch`` and ``%%accumulate``; registered by ``%load_ext batchwidgets``."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.hide_once = _HideOnce(shell)

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
    @argument("--device", type=_device, help="cpu, cuda, cuda:1 or mps (default: the model's)")
    @argument("--budget", type=_budget, metavar="SIZE",
              help="memory cap such as 512MB or 16GiB; on CUDA it emulates a smaller GPU "
                   "(default: the whole GPU; half of the available RAM on the CPU)")
    @argument("--amp", choices=["bf16", "fp16"], help="probe under autocast")
    @argument("--max-batch-size", type=_positive_int, metavar="N",
              help="largest batch size to try")
    @argument("--multiple-of", type=_positive_int, metavar="N",
              help="try only multiples of N (default: 1)")
    @argument("--headroom", type=_fraction, metavar="F",
              help="recommend at most F x max_batch_size (default: 0.9)")
    @argument("--scheduler", metavar="NAME", help="an LR scheduler to restore afterwards")
    @argument("--scaler", metavar="NAME", help="a GradScaler to use and restore afterwards")
    @argument("--steps-per-trial", type=_positive_int, metavar="N",
              help="training steps at each batch size (default: 2)")
    @argument("--start", type=_positive_int, metavar="N", help="first batch size tried")
    @argument("--input-shape", type=_shape, metavar="SHAPE",
              help="instead of MAKE_BATCH: random inputs with one example of this shape, "
                   "e.g. 3,32,32")
    @argument("--num-classes", type=_positive_int, metavar="N",
              help="with --input-shape: random labels in [0, N) too, and cross-entropy as the "
                   "loss unless --loss-fn is given")
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
          report = %find_batch model make_batch --headroom 0.8 -q
        """
        line, silenced = _without_semicolon(line)
        args = _parse(self.find_batch, line)
        probe = _probe(self.shell, args)
        panel = not (args.quiet or silenced) and _has_widgets(self.shell)
        report = ProbePanel(probe=probe).run() if panel else probe()
        if panel or silenced:  # the panel shows the report already; ';' shows nothing
            self.hide_once.arm(report)
        return report


    @magic_arguments()
    @argument("steps", metavar="N", nargs="?", type=_positive_int,
              help="micro-steps per optimizer update (default: 4)")
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
    @argument("--batch-size", type=_positive_int, metavar="B",
              help="instead of N: the batch each update should see; the micro-batch is the "
                   "probe report's recommended_batch_size and N = ceil(B / micro-batch)")
    @argument("--probe", metavar="NAME",
              help="with --batch-size: the find_batch report (default: the only one, or _)")
    @cell_magic
    def accumulate(self, line: str, cell: str) -> AccumulationReport:
        """Gradient accumulation around the cell: the same as ``batchwidgets.accumulate``.

        The cell is an ordinary training loop that calls ``loss.backward()``,
        ``optimizer.step()`` and ``optimizer.zero_grad()`` every iteration; inside, updates
        happen every N micro-steps and equal one update on a batch N times larger. The
        optimizer, scaler, scheduler and model are found in the notebook when there is one of
        each; with several, name the one to use. The report is the cell's value.

        Examples::

          %%accumulate 8
          %%accumulate 4 --optimizer opt --scheduler warmup --model ddp_model
          %%accumulate --batch-size 4096 --probe report
        """
        line, silenced = _without_semicolon(line)
        args = _parse(self.accumulate, line)
        optimizer = _find_one(self.shell, args.optimizer, "--optimizer", True)
        options = _micro_batch(self.shell, args)
        options.update(
            scaler=_find_one(self.shell, args.scaler, "--scaler", False),
            scheduler=_find_one(self.shell, args.scheduler, "--scheduler", False,
                                lambda v: getattr(v, "optimizer", None) is optimizer),
            model=_training_model(self.shell, args.model, optimizer),
            remainder=args.remainder or "apply", track_grad_norms=args.track_grad_norms)
        code = compile(self.shell.transform_cell(cell), "<%%accumulate cell>", "exec")
        with accumulate(optimizer, **options) as acc:
            exec(code, self.shell.user_ns)  # the user's errors keep their traceback
        return None if silenced else acc.report

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
