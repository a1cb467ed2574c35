"""The tensor-memory tracker: the bytes of tensor storages alive on one device, op by op, and
out of memory at the op that passes a budget (how the CPU and MPS emulate a device's limit); and
where in the step each op runs (``_Where``, for the per-op trace).

Usage:
    >>> import torch
    >>> from batchwidgets.engine.memory import track_tensor_memory
    >>> with track_tensor_memory(budget_bytes=1_000_000) as tracker:
    ...     x = torch.zeros(1000)
    >>> tracker.peak_bytes
    4000
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten
from torch.utils.module_tracker import ModuleTracker

from .._state import makes_weakref_callbacks
from .._util import leaves


class BudgetExceededError(torch.OutOfMemoryError):
    """The tensors of a step passed the memory budget: out of memory on an emulated device.

    It subclasses ``torch.OutOfMemoryError`` so code that handles real out-of-memory errors
    handles this one too.
    """


def unique_tensors(tensors: Iterable[object]) -> Iterator[torch.Tensor]:
    """The strided tensors holding the data in a nested structure: a sparse COO tensor (as
    ``nn.Embedding(sparse=True)`` makes for gradients) stands for its indices and values.
    Every op's arguments pass here: see NOTE [ Walking every op's arguments ]."""
    found: list[torch.Tensor] = []
    _collect(list(tensors), found)
    return iter(found)


# NOTE [ Walking every op's arguments ]
# Every op's arguments and outputs are walked for their tensors, a hundred thousand times in a
# fake trace of a Llama-3-8B shape, so the walk is a plain recursive function filling one list:
# an op's arguments are lists, tuples and dicts of tensors and numbers, and those are taken
# without a generator or an ABC check; anything else goes the way of the engine's one batch walker
# (_util.leaves: mappings, lists and tuples), and a leaf that is another registered pytree class
# is flattened by pytree (pytree's general flatten for every op was a quarter of a fake 8B
# plan's time). The tensors come out in the same order as by that walk.
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format, torch.Size})  # what holds no tensor


def _collect(value: object, found: list) -> None:
    kind = type(value)
    if kind is list or kind is tuple:
        for item in value:
            _collect(item, found)
    elif kind is dict:
        for item in value.values():
            _collect(item, found)
    elif kind in _ATOMS:
        return
    elif isinstance(value, torch.Tensor) and kind not in SUPPORTED_NODES:
        _add(value, found)
    else:  # mappings, other sequences, registered pytree classes: the general walk
        for leaf in leaves(value):
            for item in tree_flatten(leaf)[0] if type(leaf) in SUPPORTED_NODES else (leaf,):
                if isinstance(item, torch.Tensor):
                    _add(item, found)


def _add(tensor: torch.Tensor, found: list) -> None:
    layout = tensor.layout
    if layout == torch.strided:
        found.append(tensor)
    elif layout == torch.sparse_coo:
        found += (tensor._indices(), tensor._values())


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive on one device, op by op.

    Every operator's outputs pass through ``__torch_dispatch__`` (forward, backward and optimizer
    ops alike), so a new storage is counted when it is created and released by a weak-reference
    callback when it is freed. Going over ``budget_bytes`` raises ``BudgetExceededError`` at the
    operation that crosses it, so the process never exhausts real RAM.
    """

    def __init__(self, device: torch.device | str = "cpu", budget_bytes: int | None = None,
                 baseline: Iterable[object] = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        for tensor in unique_tensors(baseline):
            self._count(tensor)
        self.baseline_bytes = self.live_bytes

    def _count(self, tensor: torch.Tensor) -> None:
        device = tensor.device.type  # not tensor.is_meta: on a fake tensor that is an op
        if device != self.device.type or device == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        nbytes = storage.nbytes()
        if known is not None and known[0]() is storage:
            if known[1] == nbytes:
                return
            self.live_bytes -= known[1]  # resized in place (out= ops)
        self._storages[key] = (weakref.ref(storage, self._release(key)), nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    @makes_weakref_callbacks  # see NOTE [ Restoring under Ctrl-C ] in engine/_state.py
    def _release(self, key: int):
        def release(ref: weakref.ref) -> None:
            known = self._storages.get(key)
            if known is not None and known[0] is ref:
                del self._storages[key]
                self.live_bytes -= known[1]
        return release

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count_outputs(func, {id(t.untyped_storage()) for t in unique_tensors([args, kwargs])},
                           list(unique_tensors([out])))
        return out

    def count_outputs(self, func, inputs: set[int], outputs: list[torch.Tensor]) -> None:
        """Count the new storages among an op's ``outputs`` (``inputs``: the ids of its inputs'
        storages) and raise at the budget; a mode that runs the op calls this after it."""
        before = self.live_bytes
        # An output sharing an input's storage (a view, an in-place op) allocates nothing new. A
        # storage made before the block, such as a dataset tensor that make_batch slices, is not
        # the step's memory: counting it would charge the whole dataset to the first slice.
        for tensor in outputs:
            key = id(tensor.untyped_storage())
            if key in self._storages or key not in inputs:
                self._count(tensor)
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            raise BudgetExceededError(
                f"{self.device.type.upper()} out of memory (batchwidgets budget): the step held "
                f"{self.live_bytes} bytes of tensors after {func}, over the budget of "
                f"{self.budget_bytes} bytes (tried to allocate {self.live_bytes - before} bytes).")


class _Where:
    """Where the step is: "forward of encoder.layer.0", "backward of ...", "optimizer step"."""

    def __init__(self) -> None:
        self.modules = ModuleTracker()
        self.optimizer_phase = False
        # asked at every op and every new storage: answered once per set of modules entered
        self._deepest: dict[tuple, str] = {}

    def module(self) -> str:
        parents = tuple(self.modules.parents)
        deepest = self._deepest.get(parents)
        if deepest is None:
            names = [name for name in parents if name != "Global"]
            deepest = max(names, key=lambda name: name.count("."), default="")
            # ModuleTracker names modules "RootClass.child.grandchild": drop the root's class name
            deepest = self._deepest[parents] = deepest.split(".", 1)[1] if "." in deepest else (
                deepest or "the step")
        return deepest

    def __call__(self) -> str:
        if self.optimizer_phase:
            return "optimizer step"
        return f"{'backward' if self.modules.is_bw else 'forward'} of {self.module()}"


@contextmanager
def track_tensor_memory(budget_bytes: int | None = None, device: torch.device | str = "cpu",
                        baseline: Iterable[object] = ()) -> Iterator[TensorMemoryTracker]:
    """Track (and cap at ``budget_bytes``) the tensor memory of the code inside the block.

    ``baseline`` lists tensors that already exist and count against the budget (weights,
    gradients, optimizer state); tensors created inside the block are counted as they appear.
    """
    with TensorMemoryTracker(device, budget_bytes, baseline) as tracker:
        yield tracker
