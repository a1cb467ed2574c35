"""Snapshot and bit-exact restore of everything a probe touches: weights, gradients, buffers,
optimizer state, scheduler, scaler, train/eval modes, RNGs, backend flags."""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


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


class ModelState:
    """Weights, gradients, buffers and train/eval modes of a module; given a list of parameters
    instead (what the optimizer of a bare step trains), their weights and gradients."""

    def __init__(self, model: torch.nn.Module | list[torch.Tensor]) -> None:
        is_module = isinstance(model, torch.nn.Module)
        self.model = model
        self.params = [(p, _host_copy(p), None if p.grad is None else _host_copy(p.grad))
                       for p in (model.parameters() if is_module else model)]
        self.buffers = [(b, _host_copy(b)) for b in model.buffers()] if is_module else []
        self.modes = [(m, m.training) for m in model.modules()] if is_module else []

    def restore(self) -> None:
        with torch.no_grad():
            for param, data, grad in self.params:
                _put_back(param, data)
                param.grad = None if grad is None else _put_back(param.grad, grad)
            for buffer, data in self.buffers:
                _put_back(buffer, data)
        for module, training in self.modes:
            module.training = training


class OptimizerState:
    """Per-parameter state, param_groups (same dicts) and the step counters schedulers read."""

    _COUNTERS = ("_step_count", "_opt_called")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = {p: _host_copy(dict(s)) for p, s in optimizer.state.items()}
        self.groups = [{k: _host_copy(v) for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]
        self.counters = {k: getattr(optimizer, k) for k in self._COUNTERS if hasattr(optimizer, k)}

    def restore(self) -> None:
        optimizer = self.optimizer
        for param in list(optimizer.state):
            if param not in self.state:
                del optimizer.state[param]
        for param, saved in self.state.items():
            current = optimizer.state[param]
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                current[key] = _put_back(current.get(key), value)
        for group, saved in zip(optimizer.param_groups, self.groups):
            params = group["params"]
            group.clear()
            group["params"] = params
            group.update({k: _put_back(None, v) for k, v in saved.items()})
        for key, value in self.counters.items():
            setattr(optimizer, key, value)


class RngState:
    """torch (CPU, CUDA, MPS), Python and numpy (if imported) random generators."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.mps = (torch.mps.get_rng_state()
                    if torch.backends.mps.is_available() else None)
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
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


class TrainingState:
    """Everything a training step can change, snapshotted once and restored as often as needed."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 extras: tuple[Any, ...] = ()) -> None:
        if model is None and optimizer is not None:  # a bare step: it trains these parameters
            model = [p for group in optimizer.param_groups for p in group["params"]]
        self.model = ModelState(model) if model is not None else None
        self.optimizer = OptimizerState(optimizer) if optimizer is not None else None
        # Schedulers and GradScalers both have state_dict/load_state_dict.
        self.extras = [(obj, _host_copy(obj.state_dict())) for obj in extras if obj is not None]
        # A GradScaler's state_dict leaves out how far it got within a step: an out-of-memory
        # error between unscale_() and update() would leave it "unscaled", so that the next
        # unscale_() raises and the next step() reuses stale inf checks.
        self.scaler_stages = [(obj, copy.deepcopy(obj._per_optimizer_states))
                              for obj in extras if hasattr(obj, "_per_optimizer_states")]
        self.rng = RngState()
        self.flags = _backend_flags()

    def restore(self) -> None:
        if self.model is not None:
            self.model.restore()
        if self.optimizer is not None:
            self.optimizer.restore()
        for obj, saved in self.extras:
            obj.load_state_dict(_put_back(None, saved))
        for scaler, stages in self.scaler_stages:
            scaler._per_optimizer_states = copy.deepcopy(stages)
        self.rng.restore()
        _set_backend_flags(self.flags)


@contextmanager
def preserved(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              extras: tuple[Any, ...] = ()) -> Iterator[TrainingState]:
    """Restore the training state when the block ends, however it ends."""
    state = TrainingState(model, optimizer, extras)
    try:
        yield state
    finally:
        state.restore()
