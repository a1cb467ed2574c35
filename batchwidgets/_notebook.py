"""The magics' flags, read from each function's declared options, and the names in the notebook
they take: each mistake is a one-line ``UsageError`` that says what was wrong and what is
available."""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring

from .engine import FLAGS, Option, SyntheticBatches, options_of, positive_integer
from .engine.noise import NoiseTracker
from .engine.probe import CellStep, FindBatchRequest, check_arguments, find_batch, names_in
from .results import BatchSizeReport


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
    "DATA": _Role("a map-style Dataset or a DataLoader over one", "datasets",
                  lambda v: isinstance(v, (torch.utils.data.Dataset,
                                           torch.utils.data.DataLoader)),
                  lambda v: isinstance(v, (torch.utils.data.Dataset,
                                           torch.utils.data.DataLoader))),
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
    "--step": _Role("a step(batch_size) function", "functions", _is_function,
                    lambda v: isinstance(v, _FUNCTIONS)),
    "--model": _Role("a torch.nn.Module", "models", lambda v: isinstance(v, torch.nn.Module),
                     lambda v: isinstance(v, torch.nn.Module)),
    "--probe": _Role("a find_batch report (BatchSizeReport)", "probe reports",
                     lambda v: isinstance(v, BatchSizeReport),
                     lambda v: isinstance(v, BatchSizeReport)),
    "--noise": _Role("a batchwidgets.NoiseTracker", "noise trackers",
                     lambda v: isinstance(v, NoiseTracker), lambda v: isinstance(v, NoiseTracker)),
}


def available(shell: Any, role: str) -> str:
    hidden = shell.user_ns_hidden
    names = sorted(name for name, value in shell.user_ns.items()
                   if not name.startswith("_") and name not in hidden
                   and _ROLES[role].listed(value))
    plural = _ROLES[role].plural
    return f"{plural} in the notebook: {', '.join(names)}" if names else f"no {plural} there"


def resolve(shell: Any, text: str | None, role: str) -> Any:
    """The object a (dotted) notebook name refers to; a one-line UsageError if there is none."""
    if text is None:
        return None
    root, *attributes = text.split(".")
    if root not in shell.user_ns:
        close = difflib.get_close_matches(root, [n for n in shell.user_ns if n[:1] != "_"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise UsageError(f"{role}: name {root!r} is not defined in the notebook{hint} "
                         f"{available(shell, role)}.")
    value = shell.user_ns[root]
    for depth, attribute in enumerate(attributes):
        if not hasattr(value, attribute):
            owner = ".".join([root, *attributes[:depth]])
            raise UsageError(f"{role}: {owner} (a {type(value).__name__}) has no attribute "
                             f"{attribute!r}.")
        value = getattr(value, attribute)
    if not _ROLES[role].accepts(value):
        raise UsageError(f"{role} should be {_ROLES[role].expected}, but got {role}={text} "
                         f"(a {type(value).__name__}); {available(shell, role)}.")
    return value


# -- flags: each declared option's @argument, and what a line gave --------------------------------

def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from an engine parser: its error is argparse's one line, after the flag
    (``argument --budget: budget should be a size such as ...``)."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    typed.__name__ = getattr(parse, "__name__", "value")
    return typed


def _argument(option: Option) -> Callable[[Callable], Callable]:
    """The @argument of one option's flag (NOTE [ Options declared once ] in engine/_options.py);
    argparse %-formats help."""
    text = option.help_line.replace("%", "%%")
    if option.flag == "switch":
        return argument(option.flag_name, action="store_true", help=text)
    if option.flag == "negated":
        return argument(option.flag_name, dest=option.name, action="store_const", const=False,
                        help=text)
    if option.flag == "name":
        return argument(option.flag_name, metavar="NAME", help=text)
    if option.flag == "positional":
        return argument(option.name, nargs="?", type=flag_type(option.parse),
                        metavar=option.metavar, choices=option.choices, help=text)
    return argument(option.flag_name, type=flag_type(option.parse), metavar=option.metavar,
                    choices=option.choices, help=text)


def flags(request: type) -> Callable[[Callable], Callable]:
    """A magic's flags for the options of a request dataclass that have one, in their
    declaration's order (under the magic's positionals, above its own flags)."""
    def add(magic: Callable) -> Callable:
        for option in reversed([option for option in options_of(request) if option.flag]):
            magic = _argument(option)(magic)
        return magic
    return add


def in_flags(message: str, flag_names: dict[str, str]) -> str:
    """A function's message that names its keywords, in a magic's words (``seeds=0`` ->
    ``--seeds 0``), for a function whose checks do not take a Spelling yet (critical_batch:
    its checks are in engine/noise). ``flag_names``: keyword -> flag."""
    for name, flag in flag_names.items():
        message = message.replace(f"{name}=", f"{flag} ")
        if "_" in name:  # batch_sizes is the keyword wherever it stands
            message = re.sub(rf"\b{name}\b", flag, message)
        elif message.startswith(f"{name} "):  # a plain word (seeds) only as the subject
            message = flag + message[len(name):]
    return message


def given(shell: Any, request: type, args: argparse.Namespace) -> dict[str, Any]:
    """The options of a request dataclass a line gave, as the function's keywords (the others
    keep the function's defaults): values as parsed, notebook names resolved."""
    found = {}
    for option in options_of(request):
        value = getattr(args, option.name, None) if option.flag else None
        if value is None or (value is False and option.flag == "switch"):  # not given
            continue
        found[option.name] = (resolve(shell, value, option.flag_name) if option.flag == "name"
                              else value)
    return found


# -- argument types of the magics' own flags and positionals -------------------------------------

positive_int = flag_type(positive_integer)


def example_shape(text: str) -> tuple[int, ...]:
    parts = text.replace("x", ",").strip("()").split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"should be the shape of one example such as 3,32,32, "
                                         f"but got {text!r}.")
    return tuple(int(part) for part in parts)


def parse(magic: Callable, line: str) -> argparse.Namespace:
    """``parse_argstring``, naming the nearest flag when one is misspelt."""
    try:
        return parse_argstring(magic, line)
    except ValueError as error:  # shlex: an unterminated quote
        raise UsageError(f"the line should be valid shell words, but got {line.strip()!r}: "
                         f"{error}; close the quote, or quote the name.") from None
    except UsageError as error:
        unknown = [word for word in str(error).split() if word.startswith("-")]
        if not str(error).startswith("unrecognized arguments") or not unknown:
            raise
        known = sorted(flag for flag in magic.parser._option_string_actions if flag[:2] == "--")
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"{error}; {hint}flags: {', '.join(known)} "
                         f"(see %{magic.__name__}?).") from None


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


def find_one(shell: Any, text: str | None, role: str, required: bool,
              belongs: Callable[[Any], bool] = lambda v: True) -> Any:
    """The object named by ``text``, else the single one in the notebook (UsageError if several)."""
    if text is not None:
        return resolve(shell, text, role)
    return _only(_candidates(shell, role, belongs), role, required)


def _only(found: dict, role: str, required: bool) -> Any:
    if len(found) > 1:
        raise UsageError(f"{len(found)} {_ROLES[role].plural} in the notebook could be meant: "
                         f"{', '.join(sorted(found))}; pick one with {role} NAME.")
    if not found and required:
        raise UsageError(f"no {_ROLES[role].plural} in the notebook ({_ROLES[role].expected}); "
                         f"create one or pass {role} NAME.")
    return next(iter(found.values()), None)


def training_model(shell: Any, text: str | None, optimizer: Any) -> Any:
    """--model, else the model whose parameters the optimizer trains (a DDP wrapper first)."""
    if text is not None:
        return resolve(shell, text, "--model")
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def trains(module: Any) -> bool:
        params = list(module.parameters())
        return bool(params) and all(id(p) in trained for p in params)

    found = _candidates(shell, "--model", trains)
    wrappers = {n: m for n, m in found.items()
                if isinstance(m, torch.nn.parallel.DistributedDataParallel)}
    return _only(wrappers or _outermost(found, trained), "--model", False)


def _outermost(found: dict, trained: set[int]) -> dict:
    """The models that are not a part of another one found (``m`` left by ``for m in
    model.modules()`` is a part of ``model``), and of those the ones the optimizer trains
    all of, when there are such."""
    inner = {id(part) for module in found.values() for part in list(module.modules())[1:]}
    outer = {n: m for n, m in found.items() if id(m) not in inner}
    whole = {n: m for n, m in outer.items()
             if {id(p) for p in m.parameters()} == trained}
    return whole or outer


NEW_TRACKER_NAME = "noise_tracker"  # where a bare --noise keeps the tracker it creates


def noise_tracker(shell: Any, text: str | None, steps: Any = None) -> NoiseTracker | None:
    """--noise NAME: that tracker; a bare --noise: a new one, kept as ``noise_tracker``.
    ``steps``: the N the line gave, if any (a number after --noise is then not a second N)."""
    if text is None:
        return None
    if text.isdigit():
        fix = (f"give N first: %%accumulate {text} --noise" if steps is None else
               f"leave {text} out (%%accumulate {steps} --noise) or name a tracker")
        raise UsageError(f"--noise takes the name of a NoiseTracker, but got --noise {text}; "
                         f"{fix}.")
    if text:
        return resolve(shell, text, "--noise")
    tracker = shell.user_ns[NEW_TRACKER_NAME] = NoiseTracker()
    return tracker


# ---- %find_batch's line as a find_batch call ----------------------------------------------

def _make_batch(shell: Any, args: argparse.Namespace, model: Any) -> Any:
    if args.input_shape is not None:
        if args.make_batch is not None:
            raise UsageError(f"give MAKE_BATCH or --input-shape, not both, but got "
                             f"MAKE_BATCH={args.make_batch} and --input-shape "
                             f"{','.join(map(str, args.input_shape))}.")
        return SyntheticBatches(args.input_shape, args.num_classes)
    if args.num_classes is not None:
        raise UsageError("--num-classes goes with --input-shape (synthetic batches), e.g. "
                         "--input-shape 3,32,32 --num-classes 10.")
    if args.make_batch is None and isinstance(model, torch.nn.Module) and args.step is None:
        raise UsageError(f"MAKE_BATCH is needed with a model (or --input-shape 3,32,32 for "
                         f"synthetic batches); {available(shell, 'MAKE_BATCH')}.")
    if args.make_batch is None:
        return None
    return resolve(shell, args.make_batch, "MAKE_BATCH")


def probe_call(shell: Any, args: argparse.Namespace) -> functools.partial:
    """``%find_batch``'s line as a ``find_batch`` call with the notebook's objects and only the
    options given (its defaults stay); checked as find_batch checks it, in the line's words
    (one UsageError); not run yet."""
    if args.model is None:
        raise UsageError(f"MODEL is needed: %find_batch MODEL MAKE_BATCH [flags], or a cell "
                         f"of your training code under %%find_batch --var NAME; "
                         f"{available(shell, 'MODEL')}.")
    if args.var is not None:
        raise UsageError(f"--var goes with %%find_batch (a cell of your training code at batch "
                         f"size {args.var}), not with the line magic %find_batch.")
    model = resolve(shell, args.model, "MODEL")
    make_batch = _make_batch(shell, args, model)
    options = given(shell, FindBatchRequest, args)
    if args.num_classes is not None:
        options.setdefault("loss_fn", torch.nn.functional.cross_entropy)
    try:
        check_arguments(model, make_batch, said=FLAGS, **options)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    return functools.partial(find_batch, model, make_batch, **options)


# ---- %%find_batch: the cell as find_batch's step ------------------------------------------

_ONE_EACH = {"optimizer": torch.optim.Optimizer, "scheduler": "get_last_lr",
             "scaler": "unscale_"}  # the keywords a cell's objects fill, when given once


def _largest(modules: list) -> Any:
    """The module the cell trains: the one with the most parameters (a part of another, or an
    EMA copy, has no more)."""
    return max(modules, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def cell_call(shell: Any, args: argparse.Namespace, cell: str) -> functools.partial:
    """``%%find_batch --var NAME``'s cell as ``find_batch(model, step=<the cell>, optimizer=...)``
    (NOTE [ A cell as the step ] in engine/probe/_cell.py): the module it trains, and its one
    optimizer, scheduler and scaler unless a flag names them; every other object it names is
    put back too (``step.touches``). Not run yet."""
    if args.var is None or not args.var.isidentifier():
        raise UsageError(f"%%find_batch needs --var NAME, the batch-size variable of the cell, "
                         f"but got {'no --var' if args.var is None else '--var ' + args.var}; "
                         f"e.g. %%find_batch --var bs --budget 16GiB.")
    if args.model is not None or args.make_batch is not None or args.input_shape is not None:
        raise UsageError("%%find_batch probes the cell itself: leave MODEL, MAKE_BATCH and "
                         "--input-shape out (the cell names its model and makes its batches).")
    transformed = shell.transform_cell(cell)
    name = shell.compile.cache(transformed, shell.execution_count, raw_code=cell)
    code = shell.compile(transformed, name, "exec")  # its tracebacks show the cell's lines
    step = CellStep(code, shell.user_ns, args.var)
    if args.var not in names_in(code):
        raise UsageError(f"--var {args.var} should be the batch size the cell uses, but the cell "
                         f"never reads {args.var}; write the cell's batch with it, e.g. "
                         f"x = torch.randn({args.var}, 3, 224, 224).")
    modules = [o for o in step.touches if isinstance(o, torch.nn.Module)]
    if not modules:
        raise UsageError("%%find_batch should probe a cell that trains a model, but the cell "
                         "names no torch.nn.Module; name the model in the cell (not only inside "
                         "a function it calls).")
    options = given(shell, FindBatchRequest, args)
    for name, kind in _ONE_EACH.items():
        found = [o for o in step.touches if (isinstance(o, kind) if isinstance(kind, type)
                                             else hasattr(o, kind))]
        if name not in options and len(found) == 1:
            options[name] = found[0]
    try:
        check_arguments(_largest(modules), None, said=FLAGS, step=step, **options)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    return functools.partial(find_batch, _largest(modules), step=step, **options)
