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
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten
from torch.utils.module_tracker import ModuleTracker

from .._state import makes_weakref_callbacks
from .._util import leaves

# NOTE [ Lifted constants ]
# torch.tensor(0.0) (Adam's ``step`` on its first step, a constant in a model's forward) makes
# its storage outside the dispatcher and then passes it through aten.lift_fresh: on real tensors
# the lift returns that same storage, which no op made, so nothing is counted. Under a fake mode
# the lift returns a fake with a storage of its own, which would be counted, so a fake trace had
# an allocation a real one never has (74 of them in a BERT's first AdamW step). A lift is never
# counted: both traces agree (and Adam's step counters live on the host on CUDA anyway).
LIFT = torch.ops.aten.lift_fresh.default
# A query of a fake tensor's device, which C++ asks Python for (60% of a fake Llama step's ops,
# most from autograd's engine): it allocates nothing and is not in the trace, so a mode hands it
# on at once (NOTE [ One dispatch mode for two ] in _simulated.py)
DEVICE = torch.ops.prim.device.default


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


# NOTE [ A DTensor's bytes are its local shard's ]
# FSDP2 (``fully_shard``) keeps each parameter, gradient and optimizer state as a DTensor: a
# wrapper whose own storage has the global size but holds nothing, around the local shard this
# rank owns (a 1/world_size slice). Counting the wrapper would charge every rank the whole
# model. So a traceable wrapper subclass (DTensor, and any other that flattens to inner tensors)
# stands for its inner tensors, and they are counted. What FSDP2 all-gathers for forward and
# backward (the unsharded parameters of a unit) and the unsharded gradients it reduce-scatters
# are plain tensors made by ops the tracker sees, so they count as they are made and freed.
_WRAPPERS: dict[type, bool] = {}  # tensor type -> is a traceable wrapper subclass


def _add(tensor: torch.Tensor, found: list) -> None:
    kind = type(tensor)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        wrapper = _WRAPPERS.get(kind)
        if wrapper is None:
            wrapper = _WRAPPERS[kind] = is_traceable_wrapper_subclass(tensor)
        if wrapper:  # see NOTE [ A DTensor's bytes are its local shard's ]
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    _add(inner, found)
            return
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
                 baseline: Iterable[object] = (), held_bytes: int = 0, *,
                 defer_budget: bool = False) -> None:
        """``held_bytes``: memory the step holds that no op shows (DDP's gradient buckets:
        NOTE [ What a wrapper holds outside every op ] in probe/_trials.py), counted from the
        start. ``defer_budget``: inside a distributed job (NOTE [ Over the budget inside a job
        ])."""
        super().__init__()
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.defer_budget = defer_budget
        self.over_budget: str | None = None  # the first crossing's message, while deferred
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        for tensor in unique_tensors(baseline):
            self._count(tensor)
        self.held_bytes = held_bytes
        self.live_bytes += held_bytes
        self.peak_bytes = self.live_bytes
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
        if func is DEVICE:
            return func(*args, **kwargs)
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
        for tensor in outputs if func is not LIFT else ():
            key = id(tensor.untyped_storage())
            if key in self._storages or key not in inputs:
                self._count(tensor)
        # only the op that allocates crosses the budget: an op that allocated nothing runs
        # after the crossing (a profiler's record_function exit while the error unwinds, under
        # Lightning), and naming it would hide the op that did (issue 46)
        if (self.budget_bytes is not None and self.live_bytes > self.budget_bytes
                and self.live_bytes > before):
            message = (
                f"{self.device.type.upper()} out of memory (batchwidgets budget): the step held "
                f"{self.live_bytes} bytes of tensors after {self.op_said(func)}, over the budget "
                f"of {self.budget_bytes} bytes (tried to allocate {self.live_bytes - before} "
                f"bytes).")
            if not self.defer_budget:
                raise BudgetExceededError(message)
            self.over_budget = self.over_budget or message

    def op_said(self, func: Any) -> str:
        """The op an out-of-memory message names (a tracer adds its module)."""
        return str(func)

    def raise_if_over_budget(self) -> None:
        """Raise the budget's out-of-memory error that ``defer_budget`` held back, if any."""
        if self.over_budget is not None:
            raise BudgetExceededError(self.over_budget)


# NOTE [ Over the budget inside a job ]
# Under torch.distributed every rank's step runs collectives (DDP's gradient all-reduce, FSDP2's
# all-gathers and reduce-scatters). A rank that stopped at the op that crossed its budget would
# leave the others waiting in the step's next collective until the group's timeout. So inside a
# job the budget is checked, not enforced, op by op: the step runs to its end (its real memory is
# the host's, well above an emulated budget: the overshoot is one step's worth, less than the
# search's doubling), and the trial then counts as out of memory; a collective after it shares
# every rank's verdict (probe/_ranks.py) before anyone goes on.


# NOTE [ A real CUDA OOM inside a job ]
# A real CUDA out-of-memory error in the middle of a step cannot be recovered inside a job: the
# rank that raised leaves its step, while the others wait in the step's next NCCL collective,
# and only aborting the process group frees them. So inside a job the CUDA probe never lets a
# real step run out: every step runs under the tensor tracker too, with a budget of
# JOB_TENSOR_FRACTION (memory/_meters.py) of the memory the rank can reach (the rest for the
# caching allocator's rounding and fragmentation, kernel workspaces, NCCL's own buffers),
# checked as on the CPU (NOTE [ Over the budget inside a job ]): a step that crosses it runs to
# its end on real memory still free, and counts as out of memory. If a real OOM happens anyway,
# the rank posts it where every rank can read it (probe/_ranks.py) and the others' collectives
# fail within the group's timeout, each naming that rank: an error on every rank, never a
# silent hang. Not run on a GPU yet: the logic is the CPU budget path's, tested over gloo.


# NOTE [ Module tracking under activation checkpointing ]
# PyTorch's ModuleTracker hooks the gradients of every module's inputs and outputs to see where
# backward is, and keeps each hook's handle until it exits. Under activation checkpointing the
# forward runs again inside backward, and the handles of the hooks on that recomputation keep
# its graph, and so every recomputed activation, alive: a BERT step with checkpointing held 64 MB
# instead of 19 MB (more than the 33 MB without checkpointing), and the probe answered half the
# batch that fits. A forward that runs inside backward is a recomputation: its modules still
# enter ``parents`` (the ops are named), but no gradient hook is left on its tensors.
class _Modules(ModuleTracker):
    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, str] = {}  # each module entered, by its path: its class's name

    def _fw_pre_hook(self, mod, input) -> None:
        name = self._get_mod_name(mod)  # "RootClass.child.grandchild", as ``parents`` holds it
        self.kinds[name.split(".", 1)[1] if "." in name else ""] = type(mod).__name__
        if torch._C._current_graph_task_id() == -1:
            return super()._fw_pre_hook(mod, input)
        self._get_append_fn(self._get_mod_name(mod), False)()
        return None

    def _fw_post_hook(self, mod, input, output) -> None:
        if torch._C._current_graph_task_id() == -1:
            return super()._fw_post_hook(mod, input, output)
        self._get_pop_fn(self._get_mod_name(mod), False)()
        return None


class _Where:
    """Where the step is: "forward of encoder.layer.0", "backward of ...", "optimizer step"."""

    def __init__(self) -> None:
        self.modules = _Modules()
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
