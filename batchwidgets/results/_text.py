"""The text form of every report, for where HTML is not shown: ``print(report)``, IPython's
terminal, and the text/plain copy a saved notebook keeps. ``repr(report)`` keeps every field."""

from __future__ import annotations

from typing import Any

MAX_TEXT = 1500  # characters: the answer and the summary, never the whole dataclass
MORE = "(every field: repr(report); the table: report.rows())"


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


class TextForm:
    """A report's text form: ``str(report)`` and IPython's text/plain are its ``summary()``
    (the answer first) and its ``advice`` where it has one, in at most ``MAX_TEXT`` characters;
    ``repr(report)``, the dataclass's own, keeps every field (a plain base: no fields)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # IPython's printer walks the class's own __dict__ and takes the first __repr__ it
        # meets, the one @dataclass writes: each report needs _repr_pretty_ in its own __dict__
        super().__init_subclass__(**kwargs)
        cls._repr_pretty_ = TextForm._repr_pretty_

    def summary(self) -> str:
        """The answer in one line (each report has its own)."""
        raise NotImplementedError

    def text(self) -> str:
        """The text form: the report's name and summary, then its advice, then where the rest is."""
        parts = [f"{type(self).__name__}: {self.summary()}"]
        advice = getattr(self, "advice", "")
        if isinstance(advice, str) and advice and advice not in parts[0]:
            parts.append(advice)
        parts.append(MORE)
        return fit(parts)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text/plain (the terminal, and a notebook's saved copy): the text form."""
        printer.text(f"{type(self).__name__}(...)" if cycle else self.text())
