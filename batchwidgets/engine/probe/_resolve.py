"""find_batch's first stage: its arguments checked (``_checks.py``) and resolved once into a
frozen ``ProbeSetup`` (``_setup.py``), which the later stages only read; and a compiled model's
eager step, which the probe runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import memory
from .._batches import as_batch_maker
from .._grads import is_sharded
from .._state import RngState
from .._unsharded import meta_replica
from .._util import default_device, usable_device
from ._cell import CellStep
from ._checks import (
    check_amp,
    check_parallel,
    check_request,
    check_sharded,
    check_sharded_plan,
    checkpoints,
    notes_on,
)
from ._options import FindBatchRequest
from ._setup import SEARCH_CEILING, ProbeSetup
from ._sharded import sharded_units


def _target(gpu: Any, budget_bytes: int | None) -> tuple[str, int]:
    """``(name, usable bytes)`` of a target: a GPU, a size, or CPU processes under ``budget``."""
    if not memory.is_cpu_target(gpu):
        return memory.parse_target(gpu)
    if budget_bytes is None:
        raise ValueError(f"budget should be the memory each CPU process may use when target "
                         f"names CPU processes, but got budget=None with target={gpu!r}; pass "
                         f"e.g. budget='64MiB', target='4xCPU'.")
    return memory.CPU_TARGET, budget_bytes


def _device(model: Any, device: torch.device | str | None) -> torch.device:
    return usable_device(device) if device is not None else default_device(model)


def _batches(make_batch: Any) -> Callable[[int], Any]:
    """make_batch as make(batch_size), the RNGs as they were: reading a Dataset's samples may
    draw on them (random transforms), and a probe leaves them as it found them."""
    rng = RngState()
    try:
        return as_batch_maker(make_batch)
    finally:
        rng.restore()


def _fake_first(trace: str | None, planned: bool, is_module: bool,
                device: torch.device, step: Any = None) -> tuple[bool, list[str]]:
    """Whether a local search traces on fake tensors first (NOTE [ A free first guess ] in
    _probe.py), and why not, for the report, where it could have (``trace`` left out). A
    %%find_batch cell may: its objects are swapped for fakes (NOTE [ A cell's fake trials ])."""
    if planned or trace is not None:
        return False, []  # a plan is all fake; trace='real' asks for real steps only
    if isinstance(step, CellStep) and step.fakes:
        return False, [f"No fake trace first: {step.fakes}."]
    if not is_module and not isinstance(step, CellStep):
        return False, ["No fake trace first: a step(batch_size) of your own runs on your own "
                       "tensors."]
    if device.type not in ("cpu", "cuda"):  # CUDA: NOTE [ On CUDA, the plan for this device
        # first ] in _probe.py
        return False, [f"No fake trace first: no plan models {device.type.upper()}'s kernels."]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False, ["No fake trace first under torch.distributed: every rank takes the "
                       "same real steps."]
    return True, []


# NOTE [ Say what was assumed ]
# What the call leaves out, the model form assumes: a fresh AdamW (Adam-sized state: an MLP's
# answer was 1,072 with it and 1,246 with the user's SGD), the model's dtype without autocast,
# the model's device. The answer is for those, so the report says them in its summary and its
# table (the loss taken is said once a step has run: the step knows where it came from).
def _assumed(model: torch.nn.Module | None, request: FindBatchRequest, device: torch.device,
             planned: bool) -> tuple[str, ...]:
    if model is None:
        return ()
    assumed = []
    if request.optimizer is None:
        assumed.append("optimizer AdamW (pass optimizer=)")
    if request.amp is None:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                         if p.is_floating_point()})
        assumed.append(f"{'/'.join(dtypes) or 'float32'} without autocast (amp=)")
    if request.device is None and not planned:
        assumed.append(f"device {device} (the model's)")
    return tuple(assumed)


# NOTE [ Why the probe starts at 2 ]
# Batch size 1 is a special case for many models: BatchNorm cannot train on one sample, and
# reductions over the batch, squeezes and kernel choices make its memory fall off the line that
# larger sizes lie on, so a fit through it misleads the jump. Starting at 2 (as Lightning's tuner
# does) costs nothing when 2 fits; when it does not, the search halves down to 1.
def resolve(model: Any, make_batch: Any, request: FindBatchRequest) -> ProbeSetup:
    """find_batch's arguments as one setup: checked first (one-line errors, nothing run), then
    each resolved in one place. Reads a Dataset's samples (``make``) but trains nothing."""
    check_request(model, make_batch, request)
    step, target, trace, optimizer = request.step, request.target, request.trace, request.optimizer
    amp, multiple_of = request.amp, request.multiple_of
    owner = model if step is not None or isinstance(model, torch.nn.Module) else None
    bare = model if step is None and owner is None else step  # a step(batch_size), or None
    is_module = bare is None
    budget_bytes = memory.parse_bytes(request.budget, "budget")
    resolved = _device(owner, request.device)
    count, gpu = memory.parse_gpus(target) if target is not None else (1, None)
    units: tuple[str, ...] = ()
    parallel, world_size = check_parallel(request.parallel, target, count, is_module)
    planned = _target(gpu, budget_bytes) if target is not None else None
    if planned is None:
        check_sharded(owner, resolved)
    elif is_module and is_sharded(list(model.parameters())):  # a plan inside an FSDP2 job
        check_sharded_plan(trace)
        units = sharded_units(model)
        model, optimizer = meta_replica(model, optimizer)
        owner = model
        if parallel is None:  # as the job runs: FSDP2 over its ranks, or the target's count
            parallel = "fsdp"
            world_size = count if count > 1 else torch.distributed.get_world_size()
    elif parallel is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        parallel, world_size = "ddp", torch.distributed.get_world_size()  # the job's, as it runs
    if planned is not None:  # see NOTE [ Planning for a GPU that is not here ] in _plan.py
        resolved, budget_bytes = torch.device("cpu"), None
    check_amp(amp, resolved)
    fake_first, why_not = _fake_first(trace, planned is not None, is_module, resolved, bare)
    if trace is None:  # see NOTE [ Fake trials ] in _fake.py
        trace = "fake" if planned is not None and is_module else "real"
    notes = notes_on(owner=owner, device=resolved, amp=amp) + why_not
    assumed = _assumed(model if is_module else None, request, resolved, planned is not None)
    if is_module and optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
    ceiling = (request.max_batch_size or SEARCH_CEILING) // multiple_of * multiple_of
    start = request.start
    if start is None:
        start = min(max(multiple_of, 2), ceiling)  # see NOTE [ Why the probe starts at 2 ]
    seq_len = request.seq_len
    make = None
    if is_module:  # a frontier's make_batch(batch_size, seq_len) is taken at each length
        make = make_batch if seq_len is not None else _batches(make_batch)
    return ProbeSetup(
        request=request, model=model if is_module else None, step=bare, owner=owner, make=make,
        batch_description=getattr(make, "description", ""), optimizer=optimizer,
        device=resolved, home=_device(model, None) if is_module else resolved,
        budget_bytes=budget_bytes, target=planned, parallel=parallel, world_size=world_size,
        trace=trace, fake_first=fake_first, start=start, ceiling=ceiling,
        seq_len=tuple(sorted(set(seq_len))) if seq_len is not None else None,
        notes=tuple(notes), assumed=assumed, units=units,
        checkpointing=owner is not None and checkpoints(owner))


# NOTE [ A compiled model is probed in its eager step ]
# find_batch meters a step through dispatch modes (the tensor tracker, the simulated device, the
# fake mode). Under any of them torch.compile does not compile: Dynamo skips the frame ("non-infra
# torch dispatch mode present") and marks the forward's code to be skipped from then on, so a
# compiled model probed as it is trained eagerly afterwards, for good (torch 2.13). Where Dynamo
# has compiled code already, that code runs under the modes instead, and its kernels allocate
# their buffers outside the dispatcher (inductor's empty_strided_cpu), which no mode sees. So
# while a compiled model (torch.compile(module), module.compile()) is probed, torch.compile's
# stance is "force_eager" (torch >= 2.6): the step run and measured is the eager one, Dynamo
# caches nothing, and the model compiles as before afterwards. The report says so
# (report.measured_step): the eager step's memory bounds the compiled one's from above where
# inductor fuses and frees activations, and a real step on the GPU, where the allocator sees
# every buffer, is what measures the compiled step itself.
def compiled(model: Any) -> bool:
    """torch.compile's OptimizedModule, or a module whose .compile() was called."""
    return isinstance(model, torch.nn.Module) and (
        hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None)


EAGER_STEP = ("the eager step: torch.compile's own buffers are not seen on the CPU (its "
              "kernels allocate outside the dispatcher); probe again on the GPU")


@contextlib.contextmanager
def eager_while_probed(setup: ProbeSetup) -> Iterator[str]:
    """The probe of a compiled model runs its eager step (NOTE [ A compiled model is probed in
    its eager step ]); yields what the report says was measured ("" for a model not compiled)."""
    stance = getattr(torch.compiler, "set_stance", None)
    if not compiled(setup.owner) or stance is None:
        yield "" if not compiled(setup.owner) else "the step as torch.compile ran it"
        return
    with stance("force_eager"):
        yield EAGER_STEP

