"""Optimizer state by shape: an optimizer whose step fake tensors cannot run (an 8-bit one that
reads a value back, one that calls ``.item()``) or whose state is not plain tensors (a custom
object) is stepped for real on a tiny copy; what its state holds per parameter, and what its step
holds for a moment, is learned there, and a stand-in gives the fake trial state of those sizes."""

from __future__ import annotations

import collections
import copy
import math
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._util import first_line

# NOTE [ Optimizer state by shape ]
# A fake trial runs the optimizer's own step on fake tensors (NOTE [ Fake trials ] in _fake.py).
# Two kinds cannot be run so: a step that reads a value back to Python (an 8-bit optimizer's
# overflow check, a gradient norm's .item()) and state fake tensors cannot copy (a custom object
# holding the moments, which a shallow fake copy would miss: its bytes counted as zero). For
# those, the step runs for real on a tiny copy: a new optimizer of the user's class, built from
# its param_groups (every hyperparameter), over small real CPU parameters of the model's dtypes
# and ranks, three sizes each (every side times 1, 2, 3; each a multiple of 4096 elements, so
# block-wise scales divide evenly). Each state value's elements are then a line in its
# parameter's elements, ``ceil(per_element * n) + fixed`` (an Adam moment: 1 x n; an 8-bit
# moment: 1 x n in uint8, with n / 256 float32 block scales; a step counter: 0 x n + 1),
# learned from two sizes and checked on the third; a value that is not (factored, per-row state)
# is refused with the reason (where the step also cannot run on fake tensors). What the step
# holds for a moment is recorded, not summed: every storage the copy's first and second steps
# allocate and free, in order (the state it starts from included, so an 8-bit optimizer's old
# moments are freed where it frees them). The stand-in's step replays that sequence for each
# parameter, each size scaled by the parameter's bytes over the tiny one's, and what the replay
# still holds at its end is that parameter's state; the allocator's model then sees the same
# sizes in the same order as a real step makes them (8-bit Adam on a 5M-parameter MLP: the same
# answer as real steps, its state within 6 bytes). Recorded on the largest tiny parameter alone
# when a copy with all of them holds no more (one parameter at a time), on all of them at once
# otherwise. The user's optimizer object and model are never stepped, nor any of their tensors
# read; the copy's RNG draws are undone (``fork_rng``).
SIDES = {1: 4096, 2: 64, 3: 16, 4: 8}  # a parameter of each rank: 4096 elements at size 1
PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class Entry:
    """One state tensor's size: ``ceil(per_element * n) + fixed`` elements of ``dtype``, for a
    parameter of ``n`` elements."""

    dtype: torch.dtype
    per_element: Fraction
    fixed: int

    def numel(self, n: int) -> int:
        return math.ceil(self.per_element * n) + self.fixed

    def said(self) -> str:
        per, parts = self.per_element, []
        if per:
            parts.append("n" if per == 1 else f"n/{1 / per}" if per.numerator == 1
                         else f"{float(per):g}n")
        if self.fixed or not parts:
            parts.append(str(self.fixed))
        return f"{' + '.join(parts)} {_name(self.dtype)}"


@dataclass(frozen=True)
class StateRule:
    """What the optimizer holds per parameter (by group, dtype and rank) and for a moment."""

    entries: dict[tuple, dict[str, Any]]  # (group, dtype, ndim) -> key -> Entry, tuple or value
    events: tuple[tuple, ...]  # the tiny step's allocations and frees: ("alloc", key, bytes)
    first_events: tuple[tuple, ...]  # the same of the first step, which makes the state
    per_byte: float  # the events' bytes per byte of the parameters they were recorded on
    at_once: bool  # recorded on every parameter at once, not on one parameter
    note: str

    def state(self, param: torch.Tensor, group: int) -> dict[str, Any]:
        """Fake state of ``param`` (call under the fake mode)."""
        learned = self.entries[(group, param.dtype, param.dim())]
        return {key: _made(value, param.numel()) for key, value in learned.items()}


def _made(value: Any, n: int) -> Any:
    if isinstance(value, Entry):
        return torch.empty(value.numel(n), dtype=value.dtype, device="cpu")
    if isinstance(value, tuple):  # a custom object's tensors
        return tuple(_made(v, n) for v in value)
    return value


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StandIn:
    """The fake trial's optimizer when the user's cannot step on fake tensors: each step replays
    the tiny copy's allocations and frees at the parameter's scale, and what the replay still
    holds at its end is the parameter's state (see NOTE [ Optimizer state by shape ])."""

    def __init__(self, optimizer: torch.optim.Optimizer, twins: dict[int, torch.nn.Parameter],
                 rule: StateRule) -> None:
        self.rule = rule
        self.param_groups = [dict(group, params=[twins[id(p)] for p in group["params"]])
                             for group in optimizer.param_groups]
        self.state: dict = collections.defaultdict(dict)
        for i, group in enumerate(self.param_groups):
            for param, real in zip(group["params"], optimizer.param_groups[i]["params"]):
                if optimizer.state.get(real):  # it has stepped: state held from the start
                    self.state[param] = {"state": _flat(rule.state(param, i))}

    def step(self) -> None:
        stepped = [(i, p) for i, group in enumerate(self.param_groups)
                   for p in group["params"] if p.grad is not None]
        if self.rule.at_once:  # the state by the learned sizes, the step's memory all at once
            new = [(i, p) for i, p in stepped if not self.state.get(p)]
            for i, param in new:
                self.state[param] = {"state": _flat(self.rule.state(param, i))}
            size = sum(p.numel() * p.element_size() for _, p in stepped)
            if size:
                _replay(self.rule.first_events if new else self.rule.events,
                        size * self.rule.per_byte, [])
            return
        for _, param in stepped:  # the old state held by the replay alone, freed where it frees
            held = list(self.state.pop(param, {}).get("state") or ())
            scale = param.numel() * param.element_size() * self.rule.per_byte
            self.state[param] = {"state": _replay(
                self.rule.events if held else self.rule.first_events, scale, held)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None


def _flat(state: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return tuple(t for value in state.values() for t in (_tensors_of(value) or ()))


def _replay(events: tuple[tuple, ...], scale: float,
            state: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The recorded step's allocations and frees, each scaled (call under the fake mode), from
    ``state`` (what the parameter holds: taken, so a free frees it); returns what it holds at
    the end, its new state."""
    held: dict[Any, torch.Tensor] = {("state", j): t for j, t in enumerate(state)}
    state.clear()
    for event in events:
        if event[0] == "alloc":
            held[event[1]] = torch.empty(math.ceil(event[2] * scale), dtype=torch.uint8)
        else:
            held.pop(event[1], None)
    return tuple(held.values())


def state_rule(optimizer: torch.optim.Optimizer) -> StateRule | None:
    """None when the optimizer steps on fake tensors with plain state (it is faked as it is);
    otherwise its state learned on a tiny copy (see NOTE [ Optimizer state by shape ]), or a
    one-line ValueError naming ``optimizer=`` when even that cannot work."""
    name = type(optimizer).__name__
    custom = _custom_state(optimizer.state.values())
    if custom is None and type(optimizer).__module__.startswith("torch.optim"):
        return None  # PyTorch's own: its steps run on fake tensors (probe/test_fake_trace.py)
    why = custom and f"state holds {custom}"
    if why is None:
        why = _fake_failure(optimizer)
        if why is None:
            return None
    with torch.random.fork_rng(devices=[]):
        try:
            return _learn(optimizer, why)
        except _Unlearnable as error:
            reason = str(error)
        except Exception as error:  # its step on small CPU tensors: the optimizer's own limits
            reason = f"a step on a tiny CPU copy raised {type(error).__name__}: {first_line(error)}"
    raise OptimizerStateError(
        f"optimizer should step on fake tensors, or on a tiny CPU copy, to be planned without "
        f"running, but {name}'s {why}, and {reason}; plan it with trace='real' on a model built "
        f"on a real device, or with an optimizer whose state is as large (e.g. "
        f"optimizer=torch.optim.AdamW(model.parameters()) for two moments per weight).")


class OptimizerStateError(ValueError):
    """The optimizer's state can be neither faked nor learned on a tiny copy (one line)."""


class _Unlearnable(Exception):  # the reason, for OptimizerStateError's line
    """A state value no line in its parameter's elements gives."""


def _custom_state(states: Any) -> str | None:
    """What in the state is neither a tensor nor a plain value, said for the note."""
    for state in states:
        for key, value in state.items():
            if not isinstance(value, (torch.Tensor, *PLAIN)) and not (
                    isinstance(value, (tuple, list))
                    and all(isinstance(v, PLAIN) for v in value)):
                return f"a {type(value).__name__} ({key!r})"
    return None


def _tiny_shapes(ndim: int) -> list[tuple[int, ...]]:
    if ndim == 0:
        return [()]
    side = SIDES.get(ndim, 4)
    return [(side * k,) * ndim for k in (1, 2, 3)]


def _tiny_copy(optimizer: torch.optim.Optimizer, mode: FakeTensorMode | None = None,
               only: tuple | None = None) -> tuple[torch.optim.Optimizer, dict]:
    """A new optimizer of the user's class and hyperparameters over tiny parameters, with
    gradients; ``made[(group, dtype, ndim)]``: its parameters of each kind, smallest first
    (``only``: one parameter, the largest of that kind)."""
    made: dict[tuple, list[torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        kinds = sorted({(p.dtype, p.dim()) for p in group["params"] if p.requires_grad},
                       key=str)
        tiny = []
        for dtype, ndim in kinds:
            if only is not None and only != (i, dtype, ndim):
                continue
            shapes = _tiny_shapes(ndim)[-1:] if only is not None else _tiny_shapes(ndim)
            params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype))
                      for s in shapes]
            made[(i, dtype, ndim)] = params
            tiny += params
        groups.append(dict(group, params=tiny))
    if mode is not None:
        with mode:
            made = {kind: [torch.nn.Parameter(mode.from_tensor(p)) for p in params]
                    for kind, params in made.items()}
            for p in (p for params in made.values() for p in params):
                p.grad = torch.empty_like(p)
        groups = [dict(group, params=[p for kind, params in made.items() if kind[0] == i
                                      for p in params]) for i, group in enumerate(groups)]
    else:
        for p in (p for params in made.values() for p in params):
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    try:  # the class built anew: every hyperparameter is in the groups
        tiny = type(optimizer)([g for g in groups if g["params"]])
    except Exception:  # a constructor that needs more: a shallow copy with its own groups
        tiny = copy.copy(optimizer)
        tiny.param_groups = [g for g in groups if g["params"]]
        tiny.state = collections.defaultdict(dict)
    return tiny, made


def _fake_failure(optimizer: torch.optim.Optimizer) -> str | None:
    """Why two steps of a tiny copy cannot run on fake tensors (None: they can, plainly)."""
    mode = FakeTensorMode()
    try:
        tiny, _ = _tiny_copy(optimizer, mode)
        with mode:
            tiny.step()
            tiny.step()
    except Exception as error:
        func = getattr(error, "func", None)
        what = type(error).__name__ if func is None else f"{func} {type(error).__name__}"
        return f"step cannot run on fake tensors ({what})"
    custom = _custom_state(tiny.state.values())
    return None if custom is None else f"state holds {custom}"


def _learn(optimizer: torch.optim.Optimizer, why: str) -> StateRule:
    tiny, made = _tiny_copy(optimizer)
    first_events, _ = _recorded(tiny)  # the first step makes the state
    events, peak = _recorded(tiny)
    entries = {kind: _entries([tiny.state[p] for p in params], [p.numel() for p in params])
               for kind, params in made.items()}
    kind = max(made, key=lambda k: made[k][-1].numel() * made[k][-1].element_size())
    largest, made = _tiny_copy(optimizer, only=kind)
    one = [p for params in made.values() for p in params]
    one_first_events, _ = _recorded(largest, one[0])
    one_events, one_peak = _recorded(largest, one[0])
    at_once = peak > 1.25 * one_peak  # see NOTE [ Optimizer state by shape ]
    all_bytes = sum(p.numel() * p.element_size() for g in tiny.param_groups for p in g["params"])
    one_bytes = sum(p.numel() * p.element_size() for p in one)
    per_byte = 1 / all_bytes if at_once else 1 / one_bytes
    said = "; ".join(
        f"{_name(kind[1])} rank {kind[2]}: " + ", ".join(
            f"{key} {_said(value)}" for key, value in learned.items()
            if not isinstance(value, PLAIN))
        for kind, learned in entries.items())
    ratio = (peak / all_bytes) if at_once else (one_peak / one_bytes)
    note = (f"Optimizer state planned by shape: {type(optimizer).__name__}'s {why}, so two "
            f"real steps of a tiny copy measured it, per parameter of n elements: {said}; its "
            f"step's own allocations replayed to scale ({ratio:.2g}x the bytes of "
            f"{'all parameters at once' if at_once else 'each parameter, one at a time'}).")
    return StateRule(entries, events if at_once else one_events,
                     first_events if at_once else one_first_events, per_byte, at_once, note)


def _said(value: Any) -> str:
    return f"({', '.join(map(_said, value))})" if isinstance(value, tuple) else value.said()


class _Recorder(TorchDispatchMode):
    """Each new storage an op makes, and when it is freed, in order."""

    def __init__(self, state: tuple[torch.Tensor, ...]) -> None:
        """``state``: the tensors the step starts from, freed as ``("free", ("state", j))``."""
        super().__init__()
        self.events: list[tuple] = []
        self._known: dict[int, weakref.ref] = {}
        for j, tensor in enumerate(state):
            self._watch(tensor.untyped_storage(), ("state", j))

    def _watch(self, storage: Any, key: Any) -> None:
        self._known[id(storage)] = weakref.ref(
            storage, lambda _, key=key: self.events.append(("free", key)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            known = self._known.get(id(storage))
            if id(storage) in inputs or (known is not None and known() is storage):
                continue
            key = len(self.events)
            self._watch(storage, key)
            self.events.append(("alloc", key, storage.nbytes()))
        return out


def _recorded(tiny: torch.optim.Optimizer, made: torch.Tensor | None = None,
              ) -> tuple[tuple[tuple, ...], int]:
    """A step's allocations and frees, and the most they hold at once; ``made``: the one
    parameter whose state's frees are recorded too."""
    params = [p for g in tiny.param_groups for p in g["params"]]
    for p in params:  # a fresh gradient, as after each backward
        p.grad = torch.randn(p.shape).to(p.dtype)
    held = () if made is None else _flat(tiny.state[made])
    recorder = _Recorder(held)
    del held
    with recorder:
        tiny.step()
    events = tuple(recorder.events)
    recorder._known.clear()  # no free recorded after the step
    sizes, live, peak = {}, 0, 0
    for event in events:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
            peak = max(peak, live)
        else:
            live -= sizes.pop(event[1], 0)
    return events, peak


def _tensors_of(value: Any) -> list[torch.Tensor] | None:
    """A state value's tensors: itself, or a custom object's (attributes, items); None: plain."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, PLAIN) or (isinstance(value, (tuple, list))
                                    and all(isinstance(v, PLAIN) for v in value)):
        return None
    inside = (vars(value) if hasattr(value, "__dict__") else value if isinstance(value, dict)
              else dict(enumerate(value)) if isinstance(value, (list, tuple)) else {})
    return [t for v in inside.values() for t in (_tensors_of(v) or [])]


def _entries(states: list[dict], sizes: list[int]) -> dict[str, Any]:
    """Each state key's size as a line in the parameter's elements, from the tiny sizes."""
    learned: dict[str, Any] = {}
    for key, value in states[0].items():
        tensors = [_tensors_of(state.get(key)) for state in states]
        if tensors[0] is None:
            learned[key] = value
            continue
        if any(t is None or len(t) != len(tensors[0]) for t in tensors):
            raise _Unlearnable(f"its state {key!r} is not the same kind for every size")
        fitted = tuple(_line([ts[j] for ts in tensors], sizes, key)
                       for j in range(len(tensors[0])))
        learned[key] = fitted[0] if isinstance(value, torch.Tensor) else fitted
    return learned


def _line(tensors: list[torch.Tensor], sizes: list[int], key: str) -> Entry:
    if len({t.dtype for t in tensors}) != 1:
        raise _Unlearnable(f"its state {key!r} changes dtype with the parameter's size")
    counts = [t.numel() for t in tensors]
    if len(sizes) == 1:  # a 0-d parameter: one size
        return Entry(tensors[0].dtype, Fraction(0), counts[0])
    per = Fraction(counts[1] - counts[0], sizes[1] - sizes[0])
    entry = Entry(tensors[0].dtype, per, int(counts[0] - per * sizes[0]))
    if any(entry.numel(n) != c for n, c in zip(sizes, counts)) or entry.fixed < 0:
        raise _Unlearnable(f"its state {key!r} ({counts} elements for parameters of {sizes}) "
                           f"is not a fixed share of its parameter's elements (factored or "
                           f"per-row state)")
    return entry
