"""Snapshot and bit-exact restore of everything a probe touches: weights, gradients, buffers,
optimizer state, scheduler, scaler, train/eval modes, RNGs, backend flags; and the training
machinery a step leaves half way when it stops at an op (DistributedDataParallel's reducer and
its flags, FSDP2's per-unit training state, hooks' state and unsharded parameters), put back
before the tensors (``Machinery``), so the model trains its next steps as if the probe had never
run."""

from __future__ import annotations

import _thread
import contextlib
import copy
import functools
import gc
import os
import random
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ._background import rng_is_private

# NOTE [ Restoring under Ctrl-C ]
# A restore is many small writes (weights, grads, optimizer state and param_groups, RNGs, flags).
# A KeyboardInterrupt between two of them leaves the user's objects half restored: a second
# Ctrl-C landing inside the restore after the first left Adam's param_groups without 'betas'. So
# while a probe runs on the main thread, SIGINT goes through ``_Deferral.handle``: it raises
# KeyboardInterrupt as usual, except while a function marked ``@_uninterruptible`` is on the
# stack; then the interrupt is remembered and raised once the restore is complete. The stack is
# read from the frame the handler gets, so an interrupt caught at the very first instruction of
# the restore (or in the caller's ``finally`` just before) is deferred too. Signals only reach
# the main thread, so a probe on another thread needs (and installs) nothing.
#
# A KeyboardInterrupt raised inside a weak-reference callback (the memory tracker's, which runs
# whenever a tensor dies; torch's WeakIdKeyDictionary's), a ``__del__`` or anything the cycle
# collector runs is printed as "Exception ignored" and lost; the handler re-arms the signal a
# millisecond later instead (re-arming it at once would run the handler again inside the
# callback), so it is raised outside. It does the same inside an ``__enter__`` or ``__exit__``
# the probe runs: entering and leaving a context is a state change that must be whole, and torch
# makes them by hand. An interrupt inside FakeTensorMode's ``__exit__`` (or torch's
# ``unset_fake_temporarily``) left the fake mode set, and the next real op aborted the whole
# process ("trying to set the current FakeTensorMode, but one already exists"); one inside a
# TorchDispatchMode's ``__exit__`` left the tracker pushed for every later op; one in the
# ``__exit__`` of the fake trials' swap left fake twins in the user's modules. Last, it waits
# while the innermost frame is torch's own Python: C++ calls some of it where an exception
# cannot pass (an interrupt in ``find_torch_dispatch_rule``, which the dispatcher calls for each
# op on a fake tensor, aborted the process: "terminate called after throwing an instance of
# 'pybind11::error_already_set'"); the next frame of the model's or batchwidgets' own takes it.
# A press that lands while the handler itself runs (starting that timer's thread waits) is
# signalled again too: raised there, it went through the frame the first press was waiting on.
_UNINTERRUPTIBLE: set = set()
_WEAKREF_CALLBACKS: set = set()  # code of the weak-reference callbacks batchwidgets registers
_WEAKREF_FILES = ("_weakrefset.py", "weakref.py", f"utils{os.sep}weak.py")
_ENTER_EXIT = ("__enter__", "__exit__", "__aenter__", "__aexit__", "__del__")
_TORCH = os.path.dirname(torch.__file__) + os.sep


def makes_weakref_callbacks(factory: Callable) -> Callable:
    """Decorator: the functions ``factory`` defines run as weak-reference callbacks (the memory
    trackers' ``_release``), where the interrupt guard re-arms Ctrl-C instead of losing it (see
    NOTE [ Restoring under Ctrl-C ])."""
    _WEAKREF_CALLBACKS.update(code for code in factory.__code__.co_consts
                              if isinstance(code, types.CodeType))
    return factory


def _not_now(code: Any) -> bool:
    """Whether a KeyboardInterrupt raised in this code would be lost or cut a state change in
    two (see NOTE [ Restoring under Ctrl-C ])."""
    return code in _WEAKREF_CALLBACKS or code.co_name in _ENTER_EXIT or (
        code.co_name in ("_remove", "remove") and code.co_filename.endswith(_WEAKREF_FILES))


def _uninterruptible(function: Callable) -> Callable:
    _UNINTERRUPTIBLE.add(function.__code__)
    return function


class _Deferral:
    def __init__(self, previous: Any, home: Any) -> None:
        self.previous = previous
        self.home = home  # the frame that installed it: frames outside the probe do not count
        self.pending = False
        self.collecting = False  # the cycle collector is running (it runs finalizers)

    def handle(self, signum: int, frame: Any) -> None:
        not_now = self.collecting or (frame is not None and frame.f_code.co_filename.startswith(
            _TORCH))
        inside = True
        while frame is not None:
            if frame.f_code in _UNINTERRUPTIBLE:
                self.pending = True
                return
            inside = inside and frame is not self.home
            not_now = not_now or frame.f_code is _HANDLE or (inside and _not_now(frame.f_code))
            frame = frame.f_back
        if not_now:  # raised here, it would be lost or cut a change in two: signal again soon
            threading.Timer(0.001, _thread.interrupt_main, (signum,)).start()
            return
        self.deliver(signum)

    def on_collect(self, phase: str, info: dict) -> None:
        self.collecting = phase == "start"

    def deliver(self, signum: int = signal.SIGINT) -> None:
        self.pending = False
        if callable(self.previous):
            self.previous(signum, None)
        raise KeyboardInterrupt


_HANDLE = _Deferral.handle.__code__  # a press while the handler runs (starting its timer)
_DEFERRAL: list[_Deferral] = []  # the one installed now (main thread only)


class InterruptGuard:
    """Installed for a whole probe: Ctrl-C works as usual, except that it waits for a restore
    in progress to finish (see NOTE [ Restoring under Ctrl-C ]). ``release()`` puts the previous
    handler back and says whether an interrupt is still to be delivered."""

    def __init__(self, home: Any = None) -> None:
        """``home``: the outermost frame of what it guards (default: the caller's)."""
        previous = signal.getsignal(signal.SIGINT)
        self.deferral: _Deferral | None = None
        if (threading.current_thread() is threading.main_thread() and not _DEFERRAL
                and previous not in (signal.SIG_IGN, None)):
            self.deferral = _Deferral(previous, home or sys._getframe(1))
            signal.signal(signal.SIGINT, self.deferral.handle)
            gc.callbacks.append(self.deferral.on_collect)
            _DEFERRAL.append(self.deferral)

    @_uninterruptible
    def release(self) -> bool:
        deferral, self.deferral = self.deferral, None
        if deferral is None:  # nested in another guard: an interrupt our restore kept is ours
            if not _DEFERRAL:
                return False
            pending, _DEFERRAL[-1].pending = _DEFERRAL[-1].pending, False
            return pending
        signal.signal(signal.SIGINT, deferral.previous)
        gc.callbacks.remove(deferral.on_collect)
        _DEFERRAL.remove(deferral)
        return deferral.pending


def _deliver_deferred() -> None:
    """Raise the KeyboardInterrupt that arrived during a restore, now that it is complete."""
    if _DEFERRAL and _DEFERRAL[-1].pending:
        _DEFERRAL[-1].deliver()


@_uninterruptible
def _run_all(steps: list[Callable[[], Any]]) -> BaseException | None:
    """Run every step, whatever an earlier one raised; return the first error."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as error:  # the next step must run all the same
            first = first or error
    return first


@_uninterruptible
def restore_all(*steps: Callable[[], Any]) -> None:
    """Run every step, whatever an earlier one raised; then raise the first error, or the
    KeyboardInterrupt deferred meanwhile. Uninterruptible (see NOTE [ Restoring under Ctrl-C ])."""
    first = _run_all(list(steps))
    if first is not None:
        raise first
    _deliver_deferred()


@_uninterruptible
def restore_home(state: TrainingState, model: torch.nn.Module | None, home: torch.device | None,
                 guard: InterruptGuard) -> BaseException | None:
    """The end of a probe: ``model`` (when it was moved) back to ``home``, then ``state``, each
    step whatever the one before raised; then the guard released. Returns what to raise: the
    first error, or a KeyboardInterrupt that came meanwhile, or None."""
    steps = [functools.partial(model.to, home)] if model is not None else []
    first = _run_all([*steps, state.restore])
    interrupted = guard.release()
    return first or (KeyboardInterrupt() if interrupted else None)


@contextlib.contextmanager
def restored(state: TrainingState) -> Iterator[None]:
    """``state`` put back when the block ends, also on error or Ctrl-C; Ctrl-C in the block is
    as usual, and one that comes during the restore waits for it (NOTE [ Restoring under
    Ctrl-C ]). For runs that change the state on purpose: critical_batch, measure_noise."""
    guard = InterruptGuard(home=sys._getframe(2))  # the caller's frame, past contextlib's
    try:
        yield
    finally:
        failed = restore_home(state, None, None, guard)
        if failed is not None:
            raise failed


class _Saved:
    """A tensor copied to the host, remembering the device it came from."""

    __slots__ = ("data", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor.detach().to("cpu", copy=True)
        self.device = tensor.device


def _host_copy(value: Any) -> Any:
    """Deep copy with tensors copied to the host, so a snapshot costs no device memory."""
    if isinstance(value, torch.Tensor):
        return _Saved(value)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


def _put_back(current: Any, saved: Any) -> Any:
    """``saved`` back on its device, written into ``current`` in place where it still matches."""
    if isinstance(saved, _Saved):
        data = saved.data
        if (isinstance(current, torch.Tensor) and current.shape == data.shape
                and current.dtype == data.dtype and current.device == saved.device):
            with torch.no_grad():
                current.copy_(data)
            return current
        return data.to(saved.device, copy=True)
    if isinstance(saved, dict):
        return {k: _put_back(None, v) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        return type(saved)(_put_back(None, v) for v in saved)
    return copy.deepcopy(saved)


def _write_back(tensor: torch.Tensor, saved: _Saved) -> None:
    """Put ``saved`` back into ``tensor``, the same object: in place where it still matches, else
    by swapping its data (a model moved to another device, or left half moved)."""
    data = saved.data
    if (tensor.shape == data.shape and tensor.dtype == data.dtype
            and tensor.device == saved.device and not tensor.is_meta):
        tensor.copy_(data)
    else:
        tensor.data = data.to(saved.device, copy=True)


def _on_meta(part: torch.nn.Module | list[torch.Tensor]) -> bool:
    """Whether any of ``part``'s tensors is on meta (nothing to save there)."""
    tensors = ([*part.parameters(), *part.buffers()] if isinstance(part, torch.nn.Module)
               else part)
    return any(t.is_meta for t in tensors)


class ModelState:
    """Weights, gradients, buffers and train/eval modes of a module, and which parameters and
    buffers each submodule has; given a list of parameters instead (what the optimizer of a bare
    step trains), their weights and gradients. ``weights=False`` leaves the tensors out (a plan on
    fake tensors never writes them, and an 8B model's host copy would not fit)."""

    def __init__(self, model: torch.nn.Module | list[torch.Tensor], weights: bool = True) -> None:
        is_module = isinstance(model, torch.nn.Module)
        self.model = model
        self.params = [(p, _host_copy(p), None if p.grad is None else _host_copy(p.grad))
                       for p in (model.parameters() if is_module else model)] if weights else []
        self.buffers = ([(b, _host_copy(b)) for b in model.buffers()] if is_module and weights
                        else [])
        # (module, mode, its parameters and buffers by name, its non-persistent buffer names)
        self.modules = [(m, m.training, dict(m._parameters), dict(m._buffers),
                         set(m._non_persistent_buffers_set))
                        for m in model.modules()] if is_module else []

    def restore(self) -> None:
        for module, training, parameters, buffers, non_persistent in self.modules:
            # Registrations a forward made go (a buffer registered in forward), and a tensor
            # that model.to() replaced comes back as the object the user had.
            for registry, saved in ((module._parameters, parameters), (module._buffers, buffers)):
                for name in [name for name in registry if name not in saved]:
                    del registry[name]
                for name, value in saved.items():
                    if registry.get(name) is not value:
                        registry[name] = value
            if module._non_persistent_buffers_set != non_persistent:
                module._non_persistent_buffers_set = set(non_persistent)
            module.training = training
        with torch.no_grad():
            for param, data, grad in self.params:
                _write_back(param, data)
                if grad is None:
                    param.grad = None
                elif (param.grad is not None and param.grad.device == grad.device
                      and not isinstance(param.grad, FakeTensor)):  # a fake step's: replace it
                    _write_back(param.grad, grad)
                else:
                    param.grad = grad.data.to(grad.device, copy=True)
            for buffer, data in self.buffers:
                _write_back(buffer, data)


# NOTE [ An optimizer inside an optimizer ]
# Some optimizers step another one that holds the state: torch's ZeroRedundancyOptimizer keeps
# this rank's shard in ``.optim`` (its own ``.state`` stays empty), accelerate's
# AcceleratedOptimizer and Lightning's LightningOptimizer wrap the user's in ``.optimizer`` and
# ``._optimizer``. What a step changes is the inner one's state, so it is snapshotted, restored
# and counted with the outer one's.
_INNER = ("optim", "optimizer", "_optimizer")


def optimizers_within(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it steps (NOTE [ An optimizer inside an optimizer ])."""
    found = [optimizer]
    for obj in found:
        for name in _INNER:
            inner = getattr(obj, name, None)
            if isinstance(inner, torch.optim.Optimizer) and all(inner is not o for o in found):
                found.append(inner)
    return found


# NOTE [ The training state, a long module ]
# Over 400 lines: everything a step changes (weights, optimizer state inner ones included,
# RNGs, flags, the machinery of DDP and FSDP2 a stopped step leaves half way) is snapshotted and
# restored here together, uninterruptibly, in one place.
class OptimizerState:
    """Per-parameter state, param_groups (same dicts) and the step counters schedulers read.

    The restore never leaves a dict half filled: each parameter's state is built anew and swapped
    in, and a param group gets its saved values before the keys a step added are dropped.
    """

    _COUNTERS = ("_step_count", "_opt_called")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = {p: _host_copy(dict(s)) for p, s in optimizer.state.items()}
        self.group_objects = list(optimizer.param_groups)
        self.group_params = [list(g["params"]) for g in optimizer.param_groups]
        self.groups = [{k: _host_copy(v) for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]
        self.counters = {k: getattr(optimizer, k) for k in self._COUNTERS if hasattr(optimizer, k)}

    def restore(self) -> None:
        optimizer = self.optimizer
        for param in [p for p in optimizer.state if p not in self.state]:
            del optimizer.state[param]
        for param, saved in self.state.items():
            current = optimizer.state.get(param, {})
            optimizer.state[param] = {key: _put_back(current.get(key), value)
                                      for key, value in saved.items()}
        if [id(g) for g in optimizer.param_groups] != [id(g) for g in self.group_objects]:
            optimizer.param_groups[:] = self.group_objects
        for group, params, saved in zip(self.group_objects, self.group_params, self.groups):
            if [id(p) for p in group["params"]] != [id(p) for p in params]:
                group["params"] = list(params)
            for key, value in saved.items():
                group[key] = _put_back(None, value)
            for key in [k for k in group if k != "params" and k not in saved]:
                del group[key]
        for key, value in self.counters.items():
            setattr(optimizer, key, value)


class RngState:
    """torch (CPU, CUDA, MPS), Python and numpy (if imported) random generators; none of them is
    written back under ``private_rng()``."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.mps = (torch.mps.get_rng_state()
                    if torch.backends.mps.is_available() else None)
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        if not rng_is_private():  # a background probe rewinds nothing
            torch.set_rng_state(self.torch)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            if self.mps is not None:
                torch.mps.set_rng_state(self.mps)
            random.setstate(self.python)
            if self.numpy is not None:
                sys.modules["numpy"].random.set_state(self.numpy)


# NOTE [ TF32 flags ]
# PyTorch >= 2.9 stores TF32 choices as ``fp32_precision`` per backend and op, and keeps the
# legacy views (``get_float32_matmul_precision``, ``allow_tf32``) for old code. Reading a legacy
# view raises once the new API was used, and writing one after ``set_float32_matmul_precision``
# mixes the two APIs so that reading raises from then on. So read the new API where it exists, and
# write back only a flag that a step really changed: a probe that changes nothing touches nothing.
_FP32_PRECISION_OWNERS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
                          "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _attribute(owner: Any, name: str) -> tuple[Any, Any]:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _flag_accessors() -> dict[str, tuple[Any, Any]]:
    """Name -> (read, write) for every global flag a probe could change."""
    accessors = {
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "deterministic": (torch.are_deterministic_algorithms_enabled, lambda value: (
            torch.use_deterministic_algorithms(
                value, warn_only=torch.is_deterministic_algorithms_warn_only_enabled()))),
        "deterministic_warn_only": (torch.is_deterministic_algorithms_warn_only_enabled,
                                    lambda value: torch.use_deterministic_algorithms(
                                        torch.are_deterministic_algorithms_enabled(),
                                        warn_only=value)),
        "cudnn_benchmark": _attribute(torch.backends.cudnn, "benchmark"),
        "cudnn_deterministic": _attribute(torch.backends.cudnn, "deterministic"),
    }
    if hasattr(torch.backends, "fp32_precision"):  # see NOTE [ TF32 flags ]
        for path in _FP32_PRECISION_OWNERS:
            owner = torch.backends
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
            accessors[f"fp32_precision:{path or 'generic'}"] = _attribute(owner, "fp32_precision")
    else:
        accessors["matmul_precision"] = (torch.get_float32_matmul_precision,
                                         torch.set_float32_matmul_precision)
        accessors["cudnn_allow_tf32"] = _attribute(torch.backends.cudnn, "allow_tf32")
        accessors["cuda_matmul_allow_tf32"] = _attribute(torch.backends.cuda.matmul, "allow_tf32")
    return accessors


def _backend_flags() -> dict[str, Any]:
    return {name: read() for name, (read, _) in _flag_accessors().items()}


def _set_backend_flags(flags: dict[str, Any]) -> None:
    # In order, each read afresh: setting the generic fp32_precision also sets the ones below it.
    for name, (read, write) in _flag_accessors().items():
        if read() != flags[name]:
            write(flags[name])


def _load_state_dict(obj: Any, saved: Any) -> None:
    obj.load_state_dict(_put_back(None, saved))


class TrainingState:
    """Everything a training step can change, snapshotted once and restored as often as needed."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 extras: tuple[Any, ...] = (), *, weights: bool = True,
                 loss_fn: Any = None, trains: Any = None, touches: tuple[Any, ...] = ()) -> None:
        """``loss_fn``: a loss module's own weights, gradients and mode come back too, and so
        do the parameters an optimizer (``trains``, else ``optimizer``) has beside the model.
        ``touches``: more modules, optimizers (with what they train), schedulers and scalers
        a step changes (the objects a ``%%find_batch`` cell names), each put back as these."""
        trains = trains if trains is not None else optimizer
        trained = [p for o in (optimizers_within(trains) if trains is not None else [])
                   for group in o.param_groups for p in group["params"]]
        if model is None and optimizer is not None:  # a bare step: it trains these parameters
            model = trained
        self.model = ModelState(model, weights) if model is not None else None
        # DDP's reducer, FSDP2's units: reset before the tensors come back (engine/_state.py)
        self.machinery = Machinery(model)
        # what the step changes outside the model: parameters the optimizer trains beside it
        # (a learned temperature), a loss module's weights and the gradients they accumulate
        own = ({id(p) for p in model.parameters()} if isinstance(model, torch.nn.Module)
               else {id(p) for p in trained})  # a bare step's model is what it trains
        beside = list({id(p): p for p in trained if id(p) not in own}.values())
        parts: list[Any] = [beside] if beside else []
        if isinstance(loss_fn, torch.nn.Module) and loss_fn is not model:
            parts.append(loss_fn)
        # small, and touched by a fake step too (it runs on them as they are): always saved
        self.others = [ModelState(part, not _on_meta(part)) for part in parts]
        self.optimizers = ([OptimizerState(o) for o in optimizers_within(optimizer)]
                           if optimizer is not None else [])
        for other in touches:
            if isinstance(other, torch.nn.Module):
                self.others.append(ModelState(other, weights and not _on_meta(other)))
            elif isinstance(other, torch.optim.Optimizer):
                self.optimizers += [OptimizerState(o) for o in optimizers_within(other)]
                self.others.append(ModelState([p for group in other.param_groups
                                               for p in group["params"]], weights))
        extras = (*extras, *(other for other in touches
                             if not isinstance(other, (torch.nn.Module, torch.optim.Optimizer))))
        # Schedulers and GradScalers both have state_dict/load_state_dict.
        self.extras = [(obj, _host_copy(obj.state_dict())) for obj in extras if obj is not None]
        # A GradScaler's state_dict leaves out how far it got within a step: an out-of-memory
        # error between unscale_() and update() would leave it "unscaled", so that the next
        # unscale_() raises and the next step() reuses stale inf checks.
        self.scaler_stages = [(obj, copy.deepcopy(obj._per_optimizer_states))
                              for obj in extras if hasattr(obj, "_per_optimizer_states")]
        self.rng = RngState()
        self.flags = _backend_flags()

    @_uninterruptible
    def restore(self) -> None:
        """Every part, whatever an earlier one raised (see NOTE [ Restoring under Ctrl-C ])."""
        steps: list[Callable[[], Any]] = [self.machinery.reset]
        if self.model is not None:
            steps.append(self.model.restore)
        steps += [other.restore for other in self.others]
        steps += [state.restore for state in self.optimizers]
        steps += [functools.partial(_load_state_dict, obj, saved) for obj, saved in self.extras]
        steps += [functools.partial(setattr, scaler, "_per_optimizer_states",
                                    copy.deepcopy(stages)) for scaler, stages in self.scaler_stages]
        steps += [self.machinery.restore, self.rng.restore,
                  functools.partial(_set_backend_flags, self.flags)]
        restore_all(*steps)


# NOTE [ A reducer left mid-reduction ]
# DDP's C++ reducer expects every backward that its forward prepared to finish: a backward that
# stopped (out of memory between two buckets' all-reduces) leaves it "unfinalized", and the next
# forward raises "Expected to have finished reduction in the prior iteration" for ever after. No
# public API resets it: ``Reducer._reset_state()`` (private; what DDP's own
# ``_update_process_group`` calls) clears the flags, and is called only when
# ``Reducer._check_reducer_finalized()`` (private too, what DDP's ``_check_reducer_finalized``
# wraps) says it is not finalized. The reset also has the reducer rebuild its buckets after the
# next backward, in the order that backward makes its gradients, which is the order they were
# built in (a broadcast of the order, on every rank: in a job every rank resets together, as
# every rank's backward stopped; a rank that fails alone never reaches the reducer, NOTE [ A rank
# that runs out alone ] in probe/_ranks.py). DDP's own Python flags (``require_forward_param_sync``,
# which a forward under ``no_sync()`` clears and which decides whether the next forward
# broadcasts the buffers) are put back as they were. Pinned to torch 2.13 by
# tests/engine/probe/test_device_disagrees.py.
#
# NOTE [ An FSDP2 unit left mid-step ]
# FSDP2 (``fully_shard``) keeps per unit a training state (FORWARD, PRE_BACKWARD, ...), the
# unsharded parameters registered in the module while it computes, pending all-gathers and
# reduce-scatters, and on the root the iteration's bookkeeping (the final callback queued, the
# forward root). A step stopped in between leaves them so: the next forward mixes sharded and
# unsharded parameters ("got mixed torch.Tensor and DTensor"). ``FSDPModule.reset_iter_state()``
# (public since torch 2.12, on the root) waits on what is in flight, reshards every unit and
# clears the bookkeeping. It leaves the unsharded gradients the stopped backward made (autograd
# accumulates into ``FSDPParam._unsharded_param.grad`` and ``unsharded_accumulated_grad``,
# private) in place, where the next backward would add to them: they are cleared here. Where
# ``reset_iter_state`` is missing (older torch) each unit's ``reshard()`` is the fallback.


def _ddps(model: Any) -> list[Any]:
    ddp = torch.nn.parallel.DistributedDataParallel
    return [m for m in model.modules() if isinstance(m, ddp)] if isinstance(
        model, torch.nn.Module) else []


def _fsdp_units(model: Any) -> list[Any]:
    """The FSDP2 units in ``model`` (modules ``fully_shard`` made FSDPModules)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if hasattr(m, "_get_fsdp_state") and hasattr(m, "reshard")]


_DDP_FLAGS = ("require_forward_param_sync", "require_backward_grad_sync")


class Machinery:
    """What the wrappers in ``model`` (DDP, FSDP2) hold beside its tensors: reset after a step
    that stopped half way (``reset``), and their flags put back (``restore``)."""

    def __init__(self, model: Any) -> None:
        self.ddps = [(ddp, {name: getattr(ddp, name) for name in _DDP_FLAGS
                            if hasattr(ddp, name)}) for ddp in _ddps(model)]
        self.units = _fsdp_units(model)

    def reset(self) -> None:
        """The wrappers' machinery back to between two steps (NOTE [ A reducer left
        mid-reduction ], NOTE [ An FSDP2 unit left mid-step ])."""
        for ddp, _ in self.ddps:
            _reset_reducer(ddp)
        if self.units:
            _reset_fsdp(self.units)

    def restore(self) -> None:
        for ddp, flags in self.ddps:
            for name, value in flags.items():
                setattr(ddp, name, value)


def _reset_reducer(ddp: Any) -> None:
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_reset_state"):
        return
    try:
        reducer._check_reducer_finalized()
    except RuntimeError:  # a backward it prepared did not finish
        reducer._reset_state()


def _reset_fsdp(units: list[Any]) -> None:
    roots = [unit for unit in units if getattr(unit._get_fsdp_state(), "_is_root", None) is True]
    for root in roots:
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
    for unit in units:
        state = unit._get_fsdp_state()
        if not roots or not hasattr(units[0], "reset_iter_state"):
            unit.reshard()
        for group in getattr(state, "_fsdp_param_groups", ()) or ():
            for param in getattr(group, "fsdp_params", ()):
                if getattr(param, "unsharded_accumulated_grad", None) is not None:
                    param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    unsharded.grad = None
