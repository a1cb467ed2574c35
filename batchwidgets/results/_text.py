"""The text forms of every report, for where HTML is not shown: ``print(report)``, IPython's
terminal, the text/plain copy a saved notebook keeps, and ``repr(report)`` at a plain ``python``
prompt. Each is at most ``MAX_TEXT`` characters whatever the report holds; the data stays in the
fields (``dataclasses.asdict``). ``Short`` is the one place every result's repr comes from."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

MAX_TEXT = 1500  # characters: any text form of any report, never the whole dataclass
MORE = "(every field: repr(report); the table: report.rows())"

# NOTE [ A repr that elides ]
# A report's repr is the dataclass's own, ClassName(field=value, ...), with what would make it
# long elided as numpy and pandas elide: a sequence or mapping longer than a few items shows its
# first and last few, "...", and its length; a long string its start and its length. Each level
# below shows less (fewer items, shorter strings, then nested results as Name(...)) until the
# whole fits in MAX_TEXT: a BatchSizeReport with its memory timeline (thousands of numbers) was
# 7-21k characters, a BatchSplitReport holding one 15k.
_LEVELS = (  # (items shown at each end, characters of a string, nested results spelled out)
    (3, 160, True), (2, 80, True), (1, 40, True), (1, 24, False), (0, 16, False))


def short_repr(value: Any, limit: int = MAX_TEXT) -> str:
    """``value``'s repr as its dataclass writes it, long parts elided (NOTE [ A repr that
    elides ]), in at most ``limit`` characters."""
    text = ""
    for edge, chars, nested in _LEVELS:
        text = _brief(value, edge, chars, nested, top=True, seen=frozenset())
        if len(text) <= limit:
            return text
    return f"{text[:limit - 5]} ...)"


def _brief(value: Any, edge: int, chars: int, nested: bool, top: bool,
           seen: frozenset[int]) -> str:
    brief = functools.partial(_brief, edge=edge, chars=chars, nested=nested, top=False,
                              seen=seen | {id(value)})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if id(value) in seen or not (top or nested):
            return f"{name}(...)"
        return f"{name}(" + ", ".join(f"{f.name}={brief(getattr(value, f.name))}"
                                      for f in dataclasses.fields(value) if f.repr) + ")"
    if isinstance(value, str):
        return repr(value) if len(value) <= chars else \
            f"{value[:chars]!r}[...{len(value)} characters]"
    if isinstance(value, dict):
        items = [f"{brief(k)}: {brief(v)}" for k, v in _ends(list(value.items()), edge)]
        return "{" + _elided(items, len(value), edge) + "}"
    if isinstance(value, (tuple, list, set, frozenset)):
        ordered = list(value) if isinstance(value, (tuple, list)) else sorted(value, key=repr)
        items = [brief(item) for item in _ends(ordered, edge)]
        inner = _elided(items, len(value), edge)
        if isinstance(value, list):
            return f"[{inner}]"
        if isinstance(value, tuple):
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        return "{" + inner + "}" if value else f"{type(value).__name__}()"
    text = repr(value)
    return text if len(text) <= chars else f"{text[:chars]}...>"


def _ends(items: list, edge: int) -> list:
    return items if len(items) <= 2 * edge + 1 else items[:edge] + items[len(items) - edge:]


def _elided(shown: list[str], length: int, edge: int) -> str:
    if length <= 2 * edge + 1:
        return ", ".join(shown)
    return ", ".join([*shown[:edge], "...", *shown[edge:]]) + f"; length {length}"


def capped(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` in at most ``limit`` characters, cut at a sentence where it can be."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 2]
    sentence = cut.rfind(". ")
    return (cut[:sentence + 1] if sentence > limit // 2 else cut) + " …"


def fit(parts: list[str], limit: int = MAX_TEXT) -> str:
    """``parts`` joined by newlines, the last but one (the longest prose) cut at a sentence
    so that the whole, with the last part, stays within ``limit`` characters."""
    text = "\n".join(parts)
    if len(text) <= limit:
        return text
    head, long, tail = parts[:-2], parts[-2], parts[-1]
    room = limit - len("\n".join([*head, tail])) - 2 - len(" …")
    cut = long[:max(room, 0)]
    sentence = cut.rfind(". ")
    cut = cut[:sentence + 1] if sentence > 0 else cut
    return "\n".join([*head, f"{cut} …", tail])[:limit]


def _capped_summary(summary: Callable[[Any], str]) -> Callable[[Any], str]:
    @functools.wraps(summary)
    def short(self: Any) -> str:
        return capped(summary(self))
    short.capped = True
    return short


class Short:
    """A result whose repr is ``short_repr`` (NOTE [ A repr that elides ]) and whose
    ``summary()``, where it has one, is at most ``MAX_TEXT`` characters. ``str`` is the repr
    unless the class says otherwise."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # @dataclass writes __repr__ only where the class's own __dict__ has none: put it there
        # first (the decorator runs after the class, and this, are made)
        super().__init_subclass__(**kwargs)
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = Short.__repr__
        summary = cls.__dict__.get("summary")
        if callable(summary) and not getattr(summary, "capped", False):
            cls.summary = _capped_summary(summary)

    def __repr__(self) -> str:
        return short_repr(self)


class TextForm(Short):
    """A report's text form: ``str(report)`` and IPython's text/plain are its ``summary()``
    (the answer first) and its ``advice`` where it has one, in at most ``MAX_TEXT`` characters;
    ``repr(report)`` is the dataclass's own, long parts elided (``Short``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # IPython's printer walks the class's own __dict__ and takes the first __repr__ it
        # meets, the one @dataclass writes: each report needs _repr_pretty_ in its own __dict__
        super().__init_subclass__(**kwargs)
        cls._repr_pretty_ = TextForm._repr_pretty_

    def summary(self) -> str:
        """The answer in one line (each report has its own)."""
        raise NotImplementedError

    def text_parts(self) -> list[str]:
        """What the text form says after the summary (the advice, where the report has one)."""
        advice = getattr(self, "advice", "")
        return [advice] if isinstance(advice, str) and advice else []

    def text(self) -> str:
        """The text form: the report's name and summary, then the rest it says, then where
        every field is."""
        parts = [f"{type(self).__name__}: {self.summary()}"]
        parts += [part for part in self.text_parts() if part and part not in parts[0]]
        parts.append(MORE)
        return fit(parts)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text/plain (the terminal, and a notebook's saved copy): the text form."""
        printer.text(f"{type(self).__name__}(...)" if cycle else self.text())
