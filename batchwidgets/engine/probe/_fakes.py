"""PyTorch's fake machinery, adapted in one place: fake tensors (``FakeTensorMode``, a fake of a
tensor or of an optimizer's state, what fakes cannot run: ``FakeTraceError``), the fake process
group (``torch.testing._internal``: N ranks in this process alone, no communication, so one rank's
step under FSDP2 can be traced as it runs), and ``fully_shard`` wherever the supported torch keeps
it. The fake trials (``_fake.py``, ``_cell.py``, ``_sharded.py``) stand on it."""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .._unsharded import is_host_scalar

# NOTE [ A fake process group, behind one adapter ]
# PyTorch's fake process group is a backend ("fake") that answers every collective at once and
# touches no data: one process is one rank of a world of any size, and FSDP2 shards, gathers and
# reduce-scatters exactly as it would there (torchtitan's memory estimator runs FSDP2 the same
# way). It lives in torch.testing._internal.distributed.fake_pg (importing it registers the
# backend), a private module that has kept its name from torch 2.4 to 2.13; this file is the only
# one that reads it, and fully_shard's own move (torch.distributed._composable.fsdp until 2.5,
# torch.distributed.fsdp from 2.6). The group is the process's default group for the time of one
# plan, so a plan runs where no process group is initialised; inside a job (a group already
# there) the plan takes the strategy's published rules instead (NOTE [ Per-rank memory by
# strategy ] in _parallel.py) and says so.
_FAKE_PG = "torch.testing._internal.distributed.fake_pg"
# FSDP2's module that frees and reallocates its unsharded parameters, and the modules that call
# those functions by the names they imported (NOTE [ FSDP2 frees by resizing storages ])
_FSDP_PARAM = ("torch.distributed.fsdp._fully_shard._fsdp_param",
               "torch.distributed._composable.fsdp._fsdp_param")
_FSDP_CALLERS = ("_fsdp_param", "_fsdp_param_group")
_ALIAS = torch.ops.aten.alias.default  # the op a recount is said to follow

# NOTE [ FSDP2 frees by resizing storages ]
# FSDP2 does not free a unit's unsharded parameters and all-gather output after it runs: it
# keeps the tensors and resizes their storages to 0 bytes (_fsdp_param.free_storage), and back
# to full size before the next all-gather (alloc_storage). A storage resize is no op of the
# dispatcher, so the tracker and the simulated device, which see storages only as ops make and
# return them, counted each unit's gathered weights from its first all-gather to the end of the
# step: one FSDP2 rank held every unit's full weights at once, more than a ZeRO-2 rank (a
# Llama-3-8B shape on 8xA100-80GB fitted 0 per rank, ZeRO-2 1). While a plan's fake group is up,
# both functions (private to FSDP2, torch 2.4-2.13) also hand the tensor, after the resize, to
# each dispatch mode on the stack that counts storages (torch.utils._python_dispatch's private
# _get_current_dispatch_mode_stack): they count the storage at its new size, the bytes freed
# or allocated there, as the CUDA caching allocator sees them. (Not through an op: a view of a
# fake tensor whose storage was resized to 0 grows the storage back to the view's size.) Known
# limit: a CPU target (target="2xCPU", the tensor tracker without the simulated device) is left
# as it was: recounted there, its first trial's op sequence differed from the next one's, and
# the plan fell back to FSDP2's rules (not understood yet).


class FakeGroupUnavailable(RuntimeError):
    """This process cannot run a fake process group (the reason is the message)."""


def fully_shard_function() -> Callable[..., Any]:
    """FSDP2's ``fully_shard`` (torch >= 2.6 path first, then the 2.4-2.5 one)."""
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(path), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise FakeGroupUnavailable(f"this torch ({torch.__version__}) has no FSDP2 fully_shard")


def _importable() -> None:
    if not torch.distributed.is_available():
        raise FakeGroupUnavailable("this build of torch has no torch.distributed")
    if torch.distributed.is_initialized():
        raise FakeGroupUnavailable("a process group is initialised in this process already")
    try:
        importlib.import_module(_FAKE_PG)  # registers the "fake" backend
    except ImportError as error:
        raise FakeGroupUnavailable(f"torch {torch.__version__} has no fake process group "
                                   f"({error})") from error


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0) and a 1-D
    CPU ``DeviceMesh`` over it, yielded; the group is destroyed afterwards, however it ends."""
    _importable()
    from torch.distributed.device_mesh import init_device_mesh

    store = importlib.import_module(_FAKE_PG).FakeStore()
    torch.distributed.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        with resizes_seen():
            yield init_device_mesh("cpu", (world_size,))
    finally:
        torch.distributed.destroy_process_group()


def _recount(tensor: torch.Tensor) -> None:
    """Each dispatch mode that counts storages counts ``tensor``'s again, at its new size."""
    stack = _get_current_dispatch_mode_stack()
    if not any(callable(getattr(mode, "count", None)) for mode in stack):
        return  # a CPU target's tracker alone: see the known limit in NOTE [ FSDP2 frees ... ]
    grown = tensor.untyped_storage().nbytes() > 0
    for mode in stack:
        for counter in (mode, getattr(mode, "tracker", None)):
            if hasattr(counter, "count_outputs"):  # the tensor tracker
                counter.count_outputs(_ALIAS, set(), [tensor])
                if grown and callable(getattr(counter, "mark", None)):
                    # gathered weights are the strategy's buffer, whether or not autograd saves
                    # them (a Linear saves its weight): never the activations a sample adds
                    counter.mark(tensor, "temporary")
            elif callable(getattr(counter, "count", None)):  # the simulated device
                counter.count(tensor)


def _seen(resize: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    def resized(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().nbytes()
        resize(tensor)
        if tensor.untyped_storage().nbytes() != before:
            _recount(tensor)
    resized.seen = True  # type: ignore[attr-defined]
    return resized


@contextlib.contextmanager
def resizes_seen() -> Iterator[None]:
    """FSDP2's storage resizes seen by the dispatch modes (NOTE [ FSDP2 frees by resizing
    storages ]); FSDP2's own functions put back afterwards."""
    module = next((found for found in map(_module, _FSDP_PARAM) if found is not None), None)
    if module is None or getattr(getattr(module, "free_storage", None), "seen", False):
        yield
        return
    package = module.__name__.rpartition(".")[0]
    callers = [found for found in (_module(f"{package}.{name}") for name in _FSDP_CALLERS)
               if found is not None]
    patched = [(caller, name, getattr(caller, name)) for caller in callers
               for name in ("free_storage", "alloc_storage") if hasattr(caller, name)]
    try:
        for caller, name, original in patched:
            setattr(caller, name, _seen(original))
        yield
    finally:
        for caller, name, original in patched:
            setattr(caller, name, original)


def _module(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def resizes_seen_in_job() -> contextlib.AbstractContextManager:
    """``resizes_seen()`` inside a job (an FSDP2 model's real steps, metered on the CPU or under
    the job's tensor budget); nothing to do, and nothing imported, elsewhere."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return resizes_seen()
    return contextlib.nullcontext()


# -- fake tensors ----------------------------------------------------------------------------------

class FakeTraceError(RuntimeError):
    """The step cannot be traced on fake tensors; ``op`` and ``module`` say where."""

    def __init__(self, op: str, module: str, cause: BaseException) -> None:
        self.op, self.module = op, module
        super().__init__(f"{op} in {module} cannot run on fake tensors "
                         f"({type(cause).__name__})")


def fake_mode() -> FakeTensorMode:
    """Real tensors a make_batch slices or collates become fake constants as they meet an op.
    FakeTensorMode's dispatch cache is shared by every mode in the process; entries an earlier
    plan left made a later one's trial free 4 storages more at one size than at the other (a
    second plan with SGD without momentum could not be scaled), so each plan starts it empty."""
    clear = getattr(FakeTensorMode, "cache_clear", None)
    if clear is not None:
        clear()
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_like(tensor: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of ``tensor``'s shape, strides and dtype (call under the fake mode)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def host_scalars(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    """The numbers of the state's host scalars (Adam's ``step``), by id."""
    return {id(value): value.item() for state in optimizer.state.values()
            for value in state.values() if is_host_scalar(value)}


def fake_state(value: Any, scalars: dict[int, float]) -> Any:
    """A fake of one optimizer state value; a host scalar keeps its number as a fake constant,
    since the optimizer reads it back as a real step would."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) in scalars:
        return torch.tensor(scalars[id(value)], dtype=value.dtype)
    return fake_like(value)


@contextlib.contextmanager
def quiet_meta_errors() -> Iterator[None]:
    """FakeTensorMode logs every meta kernel that raises (a user's shape error) at ERROR level
    before raising it: the error reaches the user said in our words (or the fake search gives
    way to real steps), so the log line would only be noise in the notebook."""
    logger = logging.getLogger(fake_tensor.__name__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# What fake tensors cannot do: read a value back, make a shape from data, an op without a meta
# kernel. Any other error is the user's own and propagates as it is.
_FAKE_LIMITS = (NotImplementedError, *(
    getattr(fake_tensor, name) for name in ("DataDependentOutputException",
                                            "DynamicOutputShapeException",
                                            "UnsupportedOperatorException",
                                            "UnsupportedFakeTensorException")
    if hasattr(fake_tensor, name)))


@contextlib.contextmanager
def where_it_failed(meter: Any) -> Iterator[None]:
    """What fake tensors cannot run, as FakeTraceError (the op, the module it ran in)."""
    try:
        yield
    except _FAKE_LIMITS as error:
        func = getattr(error, "func", None)
        where = meter._where.module() if getattr(meter, "_where", None) is not None else "the step"
        raise FakeTraceError(str(func) if func is not None else type(error).__name__, where,
                             error) from error


@contextlib.contextmanager
def in_fake_mode(mode: FakeTensorMode) -> Iterator[None]:
    """The fake mode, with Python's cycle collector paused: fake tensors make many more
    Python objects than real ones, and a collection inside the step would free cyclic
    garbage at another op at each size, so the two traces would not line up (a 32-layer
    model's did not); refcounting frees the rest where a real step frees it."""
    gc.collect()
    gc.disable()
    try:
        with mode:
            yield
    finally:
        gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off over the fake trials (as ``in_fake_mode`` pauses it over
    each), then run once, so that their garbage is not collected inside a real step (its time
    and its trace); as it was afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if enabled:
            gc.enable()
