"""Options declared once: an ``Option`` carries a keyword's name, default, check and help line,
and a function's ``Options`` are read by its checks, its magic's flags, the flag names in its
errors and its panel's controls (NOTE [ Options declared once ])."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# NOTE [ Options declared once ]
# Each keyword option of a public function is one ``Option`` in that function's ``Options``,
# in its signature's order: the name (the flag is ``--name`` with '_' written '-'), the
# default, the check (one rule on the value alone; rules between options stay in the function's
# checks), the help line, and how a magic reads it (``flag``: a value parsed from its text, a
# name in the notebook, a switch; no flag for a callable, or where the magic's flag means more
# than the keyword: %%accumulate finds the scaler in the notebook). The front ends derive:
# a magic's @argument lines, "(default: ...)" in its help, a panel's control's value and
# tooltip. The function's signature spells the same defaults for help(), IDEs and type
# checkers; tests/test_options.py holds the two equal, fails on a default written again in the
# code that serves the function (its room, the magics, its panel), and on a keyword without
# its Option or a flag without its keyword. Adding an option is one Option, one keyword, and
# what it does.
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


@dataclass(frozen=True)
class Option:
    """One keyword option: what every front end needs to know about it."""

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

    @property
    def flag_name(self) -> str:
        return FLAGS("no_" + self.name if self.flag == "negated" else self.name)

    @property
    def help_line(self) -> str:
        """The help with the default, when there is one to say (a magic's flag, a tooltip)."""
        if self.default is None or self.default is False:
            return self.help
        return f"{self.help} (default: {_typed(self.default)})"


class Options:
    """A function's options in its signature's order: ``options["headroom"]``, ``for option in
    options``, ``options.defaults()``, ``options.check(values, said)``."""

    def __init__(self, function: str, *options: Option) -> None:
        self.function = function
        self._options = {option.name: option for option in options}

    def __iter__(self) -> Iterator[Option]:
        return iter(self._options.values())

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    def __contains__(self, name: object) -> bool:
        return name in self._options

    def defaults(self) -> dict[str, Any]:
        return {option.name: option.default for option in self}

    def complete(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every option's value: the ones given, the defaults for the rest."""
        unknown = sorted(set(given) - set(self._options))
        if unknown:
            raise RuntimeError(f"{self.function} has no option {unknown[0]!r}: this is a bug in "
                               f"batchwidgets; please report it.")
        return {**self.defaults(), **given}

    def pick(self, namespace: Mapping[str, Any]) -> dict[str, Any]:
        """The options' values out of a namespace holding them (the function's ``locals()``)."""
        return {name: namespace[name] for name in self._options}

    def check(self, values: Mapping[str, Any], said: Spelling = PYTHON) -> None:
        """Each option's own rule (None stands for "not given" where it is the default)."""
        for name, value in values.items():
            option = self._options[name]
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
