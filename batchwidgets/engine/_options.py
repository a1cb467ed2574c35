"""Options declared once: a public function's keyword options are the fields of one frozen
dataclass (find_batch's ``FindBatchRequest``), each field's metadata carrying its help line,
check, flag and cache-key membership; ``option()`` declares one, ``options_of()`` reads them
back for the checks, a magic's flags, the flag names in its errors and a panel's controls
(NOTE [ Options declared once ]).

And the engine's vocabulary beside them: one name for each kind of argument, used in every
signature (NOTE [ One vocabulary ]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

# NOTE [ Options declared once ]
# Each keyword option of a public function is one field of that function's request dataclass, in its
# signature's order, declared by ``option()``: the default (the field's), the help line, the check
# (one rule on the value alone; rules between options stay in the function's checks), how a magic
# reads it (``flag``: a value parsed from its text, a name in the notebook, a switch; no flag for a
# callable, or where the magic's flag means more than the keyword: %%accumulate finds the scaler in
# the notebook), and whether it enters a remembered answer's key (``keyed``). Everything else reads
# the fields (``options_of``): the function's checks, a magic's @argument lines and "(default: ...)"
# in its help, a panel's control's value and tooltip, the cache key. The function's signature spells
# its defaults as the request's (``headroom: float = OPTIONS.headroom``) for help(), IDEs and type
# checkers, and builds the request from its keywords by name (never ``locals()``); the stages read
# ``request.headroom``, so a misspelt option fails where it is written, not as a KeyError deep in a
# stage. tests/engine/test_options.py holds the two equal, fails on a default written again in the
# code that serves the function (its room, the magics, its panel), and on a keyword without its
# field or a flag without its keyword. Adding an option is one field, one keyword, and what it does.
#
# A check names options as the caller wrote them, through a ``Spelling``: ``max_batch_size=4``
# in Python, ``--max-batch-size 4`` on a magic's line. So a magic's mistake is the function's
# own message in the magic's words, never an engine message rewritten afterwards.

Flag = Literal["value", "positional", "name", "switch", "negated", ""]


@dataclass(frozen=True)
class Spelling:
    """How the caller wrote the options. ``said("max_batch_size")`` is the option's name and
    ``said("max_batch_size", 4)`` the option given that value: ``max_batch_size=4`` in Python
    (``PYTHON``), ``--max-batch-size 4`` on a magic's line (``FLAGS``; None: ``no --target``)."""

    flags: bool = False

    def __call__(self, name: str, *value: Any) -> str:
        if not self.flags:
            return f"{name}={value[0]!r}" if value else name
        flag = "--" + name.replace("_", "-")
        if not value:
            return flag
        return f"no {flag}" if value[0] is None else f"{flag} {_typed(value[0])}"


def _typed(value: Any) -> str:
    """A value as it is typed on a magic's line (``128,256`` for a list of lengths)."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value) if isinstance(value, (str, int, float)) else repr(value)


PYTHON = Spelling()
FLAGS = Spelling(flags=True)
Check = Callable[[Any, Spelling], None]  # check(value, said): a TypeError or ValueError


def option(default: Any, help: str, *, check: Check | None = None, flag: Flag = "value",
           metavar: str | None = None, parse: Callable[[str], Any] = str,
           choices: tuple[str, ...] | None = None, offered: tuple[str, ...] = (),
           keyed: bool = True) -> Any:
    """One field of a request dataclass: its default, and what every front end needs to know
    about it in the field's metadata (read back as an ``Option`` by ``options_of``)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "check": check, "flag": flag, "metavar": metavar, "parse": parse,
        "choices": choices, "offered": offered, "keyed": keyed})


@dataclass(frozen=True)
class Option:
    """One keyword option as its field declares it: what every front end needs to know."""

    name: str
    default: Any
    help: str  # one line: the magic's help (its default is added) and the panel's tooltip
    check: Check | None = None  # never called with None where None is the default
    # "value": --name VALUE; "positional": the magic's optional VALUE after its positionals;
    # "name": --name NAME, an object in the notebook; "switch": --name; "negated": --no-name
    # sets False (an option whose default is True); "": no flag
    flag: Flag = "value"
    metavar: str | None = None
    parse: Callable[[str], Any] = str  # a flag's text -> the value (ValueError if it is not one)
    choices: tuple[str, ...] | None = None  # what a magic's flag accepts (argparse's choices)
    offered: tuple[str, ...] = ()  # what a panel's dropdown offers, where it has one
    keyed: bool = True  # it decides what is measured: a remembered answer's key holds it

    @classmethod
    def of(cls, field: dataclasses.Field) -> Option:
        return cls(name=field.name, default=field.default, **field.metadata)

    @property
    def flag_name(self) -> str:
        return FLAGS("no_" + self.name if self.flag == "negated" else self.name)

    @property
    def help_line(self) -> str:
        """The help with the default, when there is one to say (a magic's flag, a tooltip)."""
        if self.default is None or self.default is False:
            return self.help
        return f"{self.help} (default: {_typed(self.default)})"


def options_of(request: Any) -> tuple[Option, ...]:
    """A request dataclass's (or instance's) options, in its signature's order."""
    return tuple(Option.of(field) for field in dataclasses.fields(request))


def declared(request: Any, name: str) -> Option:
    """One option of a request dataclass, by its field's name (a panel's control)."""
    found = [option for option in options_of(request) if option.name == name]
    if not found:
        raise AttributeError(f"{getattr(request, '__name__', type(request).__name__)} has no "
                             f"option {name!r}")
    return found[0]


def check_options(request: Any, said: Spelling = PYTHON) -> None:
    """Each option's own rule on a request's values (None stands for "not given" where it is
    the default)."""
    for option in options_of(request):
        value = getattr(request, option.name)
        if option.check is not None and not (value is None and option.default is None):
            option.check(value, said)


# -- a flag's text as a value (a magic's argparse type; the option's check follows) -------------

def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"should be an integer, but got {text!r}.") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"should be a number, but got {text!r}.") from None


def integers(text: str) -> list[int]:
    """``128,256,512`` -> [128, 256, 512]."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"should be integers such as 128,256,512, but got {text!r}.") from None


def positive_integer(text: str) -> int:
    """A count on a magic's line whose function checks it itself (or not in the same words)."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"should be a positive integer, but got {text!r}.")
    return int(text)


# NOTE [ One vocabulary ]
# The same thing has the same name across the API:
# - Data. ``make_batch`` (find_batch) makes a batch of a given size: a callable
#   ``make_batch(batch_size)``, or a Dataset, DataLoader or example tensor it is built from;
#   ``data`` (measure_noise) is the examples themselves, a Dataset or DataLoader;
#   ``loader_or_dataset`` (tune_loader, measure_loader, make_loader, LoaderPanel) is what a
#   DataLoader is built from or is; ``batch`` (NoiseTracker.measure, a TrainStep) is one batch.
#   Positional names are kept as they were: renaming one breaks every keyword call.
# - Steps. A ``ProbeStep`` is ``step(batch_size)``: it builds its own batch and trains once
#   (find_batch(step), find_batch(model, step=...)); a ``TrainStep`` is ``step(batch)``: one
#   training step on the batch it is given (tune_loader(step=...), data_stall).
# - Progress and cancelling. A long measurement calls back on the measuring thread with each
#   row its report will hold, as soon as it exists: find_batch's ``on_step(attempt)``,
#   tune_loader's ``on_progress(trial)`` (the names the guides teach). A NoiseTracker, which
#   lives across a whole training run, takes listeners instead (``add_listener``).
#   ``should_stop()`` is polled between units of work to cancel.
# - AMP objects. ``scaler`` comes before ``scheduler`` wherever both are taken (accumulate's
#   positional order).
# - Choices among strings are ``Literal`` aliases below, and their tuples of allowed values
#   (for the checks) come from them.

ProbeStep = Callable[[int], Any]  # step(batch_size): builds its batch and trains once
TrainStep = Callable[[Any], Any]  # step(batch): one training step on the given batch
OnProgress = Callable[[Any], None]  # on_progress(row): each row of the report as it is made
OnStep = Callable[[Any], None]  # on_step(attempt): each size find_batch tried, as it finishes
ShouldStop = Callable[[], bool]
Clock = Callable[[], float]

Amp = Literal["bf16", "bfloat16", "fp16", "float16"]
Remainder = Literal["apply", "drop"]
NoiseMethod = Literal["auto", "vmap", "loop"]
Trace = Literal["fake", "real"]
AMP_NAMES: tuple[str, ...] = get_args(Amp)
REMAINDERS: tuple[str, ...] = get_args(Remainder)
NOISE_METHODS: tuple[str, ...] = get_args(NoiseMethod)
TRACES: tuple[str, ...] = get_args(Trace)
