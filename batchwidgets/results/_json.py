"""Reports as JSON and back: ``as_json(report)`` (plain dicts, lists and numbers) and
``from_json(BatchSizeReport, data)``, which rebuilds every nested report from the fields' types.
Floats go through JSON exactly (``repr`` round-trips), so a report read back equals the one
written. Standard library only.

Usage:
    >>> from batchwidgets.results import Attempt
    >>> from_json(Attempt, as_json(Attempt(8, True, 1024, 0.5))) == Attempt(8, True, 1024, 0.5)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def as_json(report: Any) -> dict[str, Any]:
    """A report dataclass as a dict that ``json.dumps`` writes (tuples become lists, int keys
    strings: ``from_json`` turns them back by the field's type)."""
    return dataclasses.asdict(report)


def from_json(cls: type[T], data: Any) -> T:
    """The ``cls`` report that ``as_json`` gave ``data``. A field missing, of another type or
    not of ``cls`` is a ``TypeError``, ``ValueError`` or ``KeyError`` (a foreign file)."""
    return _decode(cls, data)


def _decode(hint: Any, value: Any) -> Any:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        (arm,) = [a for a in arguments if a is not type(None)]  # X | None only
        return _decode(arm, value)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value)
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_decode(arguments[0], item) for item in _list(value))
        items = _list(value)
        if len(items) != len(arguments):
            raise ValueError(f"expected {len(arguments)} items, got {len(items)}")
        return tuple(_decode(a, item) for a, item in zip(arguments, items))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping, got {type(value).__name__}")
        key, item = arguments
        return {_decode(key, k): _decode(item, v) for k, v in value.items()}
    return _scalar(hint, value)


def _list(value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return list(value)


def _scalar(hint: Any, value: Any) -> Any:
    if hint is Any:
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an int, got {value!r}")
        return int(value)  # a dict's int keys come back as strings
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if hint in (str, bool) and not isinstance(value, hint):
        raise TypeError(f"expected a {hint.__name__}, got {value!r}")
    return value


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's field types (resolved once: ``get_type_hints`` is slow) and init fields."""
    return (typing.get_type_hints(cls),
            frozenset(f.name for f in dataclasses.fields(cls) if f.init))


def _dataclass(cls: type, value: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"expected a {cls.__name__}, got {type(value).__name__}")
    hints, fields = _fields(cls)
    unknown = set(value) - fields
    if unknown:
        raise KeyError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    return cls(**{name: _decode(hints[name], item) for name, item in value.items()})
