"""What decides a training step's memory, as plain JSON values: a model's structure (modules,
their code and settings, every parameter's and buffer's shape, dtype, device, ``requires_grad``),
an optimizer's class and memory-relevant settings and state, a batch's structure and shapes, a
callable's code with what it reads; and ``digest``, one hash of them all."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import sys
import sysconfig
import types
from collections.abc import Mapping
from typing import Any

import torch

SIMPLE = (bool, int, float, str, type(None))
MAX_ITEMS = 32  # of a long list a callable reads: its length and this many items
MAX_DEPTH = 4  # callables reading callables reading values: deeper is only a type name

# NOTE [ What a fingerprint holds ]
# A fingerprint must change whenever the step's memory may, and stay equal from one process to the
# next when nothing changed, so it holds values, never ids or default reprs (they hold addresses). A
# module: its class (by name and the code of the methods its classes define, so a class edited in a
# notebook cell is another, and the plain values those methods read from their module where the
# user wrote them: a script's ``CHECKPOINT = sys.argv[1] == "1"`` gave one answer, 3.6x off, to
# both values), ``extra_repr``, its plain settings (``vars`` of simple values: ``p`` of
# a Dropout, ``gradient_checkpointing`` of a Hugging Face block, a test fake's threshold), the
# functions it keeps as attributes (by the callable's rules: ``self.act = F.gelu``), its hook
# counts, a Hugging Face ``config``; every parameter's name, shape, dtype, device, ``requires_grad``
# and gradient. A callable: its code (not its file or line numbers), its defaults, the values in its
# closure and the globals it names, each by the same rules, so ``step`` reading a notebook's
# ``SEQ_LEN`` changes with it (a function of an installed package or the standard library by its
# name and code alone: its versions decide the rest). An optimizer: its class, each group's settings
# (floats only as zero or not: a learning rate decides no memory, a momentum of 0 does) and the
# shapes of its state. Where a value is none of these, its type and its plain settings.


def digest(value: Any) -> str:
    """One SHA-256 of a fingerprint (any JSON value)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=_type_of)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each of ``values`` as a JSON value holding what decides memory (NOTE [ What a
    fingerprint holds ]); an object met twice is walked once."""
    walk = _Walk()
    return {name: walk.value(value, 0) for name, value in values.items()}


def batch_fingerprint(batch: Any) -> Any:
    """A batch's structure with each tensor's shape, dtype and device."""
    if isinstance(batch, torch.Tensor):
        return _tensor(batch)
    if isinstance(batch, Mapping):
        return {"dict": {str(k): batch_fingerprint(v) for k, v in batch.items()}}
    if isinstance(batch, (list, tuple)):
        return [batch_fingerprint(v) for v in batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {_name(type(batch)): {f.name: batch_fingerprint(getattr(batch, f.name))
                                     for f in dataclasses.fields(batch)}}
    return batch if isinstance(batch, SIMPLE) else {"type": _name(type(batch))}


def _type_of(value: Any) -> str:
    """What JSON cannot hold: a dtype or device by name, anything else by its type (a default
    repr would hold an address)."""
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return _name(type(value))


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _tensor(tensor: torch.Tensor) -> list:
    return ["tensor", list(tensor.shape), str(tensor.dtype), str(tensor.device),
            type(tensor).__name__]


def _code(code: types.CodeType) -> str:
    """A code object without its file and line numbers (they move when a cell is edited above)."""
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return digest([code.co_code.hex(), consts, list(code.co_names), list(code.co_varnames),
                   list(code.co_freevars), code.co_argcount, code.co_kwonlyargcount])


def _names(code: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _functions(kind: type) -> list[Any]:
    """The functions a class defines (methods, static, class methods, properties' getters)."""
    found = []
    for attribute in vars(kind).values():
        attribute = getattr(attribute, "__func__", getattr(attribute, "fget", attribute))
        if isinstance(attribute, types.FunctionType):
            found.append(attribute)
    return found


@functools.lru_cache(maxsize=512)
def _class_code(kind: type) -> tuple[str, tuple[tuple[dict, str], ...]]:
    """A module class's code (its own classes', nn.Module's excepted), and the globals its
    methods read where the user wrote them (not an installed library's): (namespace, name)."""
    parts, reads = [], []
    for owner in kind.__mro__:
        if owner in (torch.nn.Module, object):
            break
        functions = _functions(owner)
        parts.append([_name(owner), sorted(_code(f.__code__) for f in functions)])
        reads += [(f.__globals__, name) for f in functions if not _installed(f)
                  for name in sorted(_names(f.__code__))]
    return digest(parts), tuple(reads)


def class_fingerprint(kind: type) -> str:
    """A module class by name and its code, with the plain values its methods read from their
    module as they are now (a flag a script sets from its arguments: ``if CHECKPOINT:``)."""
    code, reads = _class_code(kind)
    plain = sorted({(name, repr(namespace[name])) for namespace, name in reads
                    if name in namespace and isinstance(namespace[name], SIMPLE)})
    return digest([code, plain]) if plain else code


def _settings(owner: Any) -> dict[str, Any]:
    """An object's plain public settings: simple values and tuples of them."""
    found = {}
    for key, value in vars(owner).items():
        if key.startswith("_"):
            continue
        if isinstance(value, SIMPLE) or (isinstance(value, tuple)
                                         and all(isinstance(v, SIMPLE) for v in value)):
            found[key] = list(value) if isinstance(value, tuple) else value
    return found


def module_fingerprint(model: torch.nn.Module, walk: _Walk | None = None) -> dict[str, Any]:
    """Every module, parameter and buffer of ``model`` (NOTE [ What a fingerprint holds ])."""
    walk = walk or _Walk()
    modules = []
    for name, module in model.named_modules():
        try:
            extra = module.extra_repr()
        except Exception:  # a user's extra_repr may fail on a half-built module
            extra = ""
        hooks = [len(getattr(module, hook, ())) for hook in
                 ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks")]
        # what the module calls that is no module: a function kept as an attribute
        # (``self.act = F.gelu``, a dropout given as a lambda, a forward patched on the instance)
        calls = {key: walk.value(value, 1) for key, value in vars(module).items()
                 if callable(value) and not isinstance(value, (torch.nn.Module, type))}
        modules.append([name, class_fingerprint(type(module)), extra, _settings(module), hooks,
                        calls])
    parameters = [[name, *_tensor(p), p.requires_grad,
                   None if p.grad is None else _tensor(p.grad)]
                  for name, p in model.named_parameters()]
    buffers = [[name, *_tensor(b)] for name, b in model.named_buffers()]
    found = {"modules": modules, "parameters": parameters, "buffers": buffers}
    config = getattr(model, "config", None)  # a Hugging Face model's: attention kernel included
    if hasattr(config, "to_dict"):
        try:
            found["config"] = json.loads(json.dumps(config.to_dict(), default=_type_of))
            found["attention"] = repr(getattr(config, "_attn_implementation", None))
        except Exception:  # a config that does not serialise: its type then
            found["config"] = _name(type(config))
    return found


def _zero_or_not(value: Any) -> Any:
    """An optimizer setting as far as memory sees it: a float only as zero or not."""
    if isinstance(value, bool) or not isinstance(value, (float, torch.Tensor)):
        return list(map(_zero_or_not, value)) if isinstance(value, (tuple, list)) else (
            value if isinstance(value, SIMPLE) else _name(type(value)))
    if isinstance(value, torch.Tensor):  # a learning rate on the device (capturable)
        return _tensor(value)
    return value != 0


def optimizer_fingerprint(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's class, its groups' memory-relevant settings and its state's shapes."""
    groups = []
    for group in optimizer.param_groups:
        settings = {k: _zero_or_not(v) for k, v in group.items() if k != "params"}
        parameters = [_tensor(p) for p in group["params"]]
        state = [{k: _tensor(v) if isinstance(v, torch.Tensor) else repr(type(v))
                  for k, v in optimizer.state.get(p, {}).items()} for p in group["params"]]
        groups.append({"settings": settings, "parameters": parameters, "state": state})
    return {"optimizer": _name(type(optimizer)), "groups": groups}


class _Walk:
    """One fingerprint's walk: each object once (a module read twice, a recursive function)."""

    def __init__(self) -> None:
        self.seen: dict[int, Any] = {}

    def value(self, value: Any, depth: int) -> Any:
        if isinstance(value, SIMPLE):
            return value
        if isinstance(value, (torch.device, torch.dtype)):
            return str(value)
        if isinstance(value, torch.Tensor):
            return _tensor(value)
        if id(value) in self.seen:
            return self.seen[id(value)]
        self.seen[id(value)] = ["cycle", _name(type(value))]
        found = self._object(value, depth)
        self.seen[id(value)] = found
        return found

    def _object(self, value: Any, depth: int) -> Any:
        if isinstance(value, torch.nn.Module):
            return module_fingerprint(value, self)
        if isinstance(value, torch.optim.Optimizer):
            return optimizer_fingerprint(value)
        if isinstance(value, types.ModuleType):
            return {"module": value.__name__}
        if isinstance(value, types.CodeType):  # a cell compiled, run by a step of its own
            return {"code": _code(value)}
        if isinstance(value, type):
            return {"class": _name(value)}
        if depth >= MAX_DEPTH:
            return {"type": _name(type(value))}
        if isinstance(value, (list, tuple)):
            return [len(value), [self.value(v, depth + 1) for v in value[:MAX_ITEMS]]]
        if isinstance(value, Mapping):
            items = list(value.items())[:MAX_ITEMS]
            return {"dict": len(value), "items": [[repr(k) if not isinstance(k, str) else k,
                                                   self.value(v, depth + 1)] for k, v in items]}
        if dataclasses.is_dataclass(value):
            return {_name(type(value)): {f.name: self.value(getattr(value, f.name), depth + 1)
                                         for f in dataclasses.fields(value)}}
        if callable(value):
            return self._callable(value, depth)
        found: dict[str, Any] = {"type": _name(type(value))}
        if hasattr(value, "__dict__"):  # e.g. a precision plugin's "bf16-mixed"
            found["settings"] = _settings(value)
        if hasattr(value, "is_enabled"):  # a GradScaler: on or off
            found["enabled"] = bool(value.is_enabled())
        return found

    def _callable(self, function: Any, depth: int) -> Any:
        if isinstance(function, functools.partial):
            return {"partial": self.value(function.func, depth + 1),
                    "args": self.value(function.args, depth + 1),
                    "keywords": self.value(function.keywords, depth + 1)}
        if inspect.ismethod(function):
            return {"method": self.value(function.__func__, depth + 1),
                    "self": self.value(function.__self__, depth + 1)}
        if not isinstance(function, types.FunctionType):  # a callable object, a builtin
            kind = type(function)
            call = inspect.getattr_static(kind, "__call__", None)
            found = {"type": _name(kind), "settings": _settings(function)
                     if hasattr(function, "__dict__") else {}}
            if isinstance(function, types.BuiltinFunctionType):  # torch.tanh, not torch.relu
                found["name"] = f"{function.__module__}.{function.__qualname__}"
            if isinstance(call, types.FunctionType):
                found["call"] = _code(call.__code__)
            return found
        code = function.__code__
        if _installed(function):  # a library's: its version decides what it reads
            return {"function": f"{function.__module__}.{function.__qualname__}",
                    "code": _code(code)}
        cells = [cell.cell_contents for cell in function.__closure__ or ()
                 if _filled(cell)]
        globals_read = {name: self.value(function.__globals__[name], depth + 1)
                        for name in sorted(_names(code)) if name in function.__globals__}
        return {"function": function.__qualname__, "code": _code(code),
                "defaults": self.value(function.__defaults__, depth + 1),
                "kwdefaults": self.value(function.__kwdefaults__, depth + 1),
                "closure": [self.value(c, depth + 1) for c in cells], "globals": globals_read}


_LIBRARIES = tuple(path for path in {sysconfig.get_paths()["stdlib"],
                                     sysconfig.get_paths()["purelib"],
                                     sysconfig.get_paths()["platlib"]} if path)


def _installed(function: types.FunctionType) -> bool:
    """A function of an installed package or the standard library (not the user's code)."""
    file = getattr(sys.modules.get(function.__module__), "__file__", None) or ""
    return file.startswith(_LIBRARIES) or "site-packages" in file or "dist-packages" in file


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
