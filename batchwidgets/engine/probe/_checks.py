"""find_batch's argument checks, all before anything runs (the shape of ``DataLoader.__init__``),
and what the report says about what was probed."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
import torch.utils.checkpoint

from ..._warnings import BatchwidgetsWarning
from .. import memory
from .._options import PYTHON, Spelling, check_options
from ._options import FindBatchRequest
from ._ranks import in_job
from ._trials import AMP_DTYPES


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo;
    True where that cannot be read (no warning then)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return True
    return not flags or any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def notes_on(owner: torch.nn.Module | None, device: torch.device, amp: str | None) -> list[str]:
    """What the user should know about what was probed, said in the report (and warned)."""
    notes = []
    if owner is not None and (hasattr(owner, "_orig_mod")  # torch.compile's OptimizedModule
                              or getattr(owner, "_compiled_call_impl", None) is not None):
        notes.append("The model is torch.compile'd: find_batch measured its eager step "
                     "(torch.compile's own buffers are not seen on the CPU, and compiling under "
                     "the meter would stop it compiling for good); the compiled step often holds "
                     "less: probe again on the GPU at the size you train with.")
    if amp == "bf16" and device.type == "cpu" and not _cpu_has_bf16():
        notes.append("amp='bf16' on a CPU without bf16 instructions (no avx512_bf16 or "
                     "amx_bf16): the memory is right, but each step runs several times slower "
                     "than float32, so step times do not rank throughput.")
    if owner is not None and any(p.grad is not None for p in owner.parameters()):
        notes.append("The model held gradients from an earlier backward: the first step at each "
                     "size accumulated into them and its zero_grad freed them, as in a loop that "
                     "zeroes its gradients; the answer is for that loop.")
    for note in notes[:2]:  # the gradients note is information, not a warning
        warnings.warn(note, BatchwidgetsWarning, stacklevel=4)  # resolve, find_batch, the user
    return notes


def check_arguments(model: Any, make_batch: Any = None, *, said: Spelling = PYTHON,
                    **given: Any) -> None:
    """Every rule find_batch has for its arguments (``check_request``). ``given``: find_batch's
    options given by name (the rest are the defaults)."""
    check_request(model, make_batch, FindBatchRequest(**given), said)


def check_request(model: Any, make_batch: Any, request: FindBatchRequest,
                  said: Spelling = PYTHON) -> None:
    """Every rule find_batch has for its arguments, one ``if`` each: each option's own (in
    probe/_options.py), then the rules between them; a one-line TypeError or ValueError naming
    the argument and the fix, as the caller wrote it (``said``: find_batch's keywords or
    %find_batch's flags)."""
    check_options(request, said)
    step, seq_len, target = request.step, request.seq_len, request.target
    _check_trace(model, target, request.trace, step, said)
    if request.parallel is not None:
        count = memory.parse_gpus(target)[0] if target is not None else 1
        check_parallel(request.parallel, target, count,
                       step is None and isinstance(model, torch.nn.Module), said)
    if request.keep_output is not True and (
            step is not None or not isinstance(model, torch.nn.Module)):
        raise ValueError(f"{said('keep_output')} should be left out with a step of your own: "
                         f"it models the model form's loop, and your step is measured as it "
                         f"runs (what it keeps, it holds); leave {said('keep_output')} out.")
    if step is not None:
        _check_step(model, make_batch, seq_len, said)
        model = step
    _check_model(model, make_batch)
    _check_sizes(request.max_batch_size, request.multiple_of, request.start, said)
    if seq_len is not None:
        _check_lengths(make_batch, said)


def check_sharded(owner: torch.nn.Module | None, device: torch.device) -> None:
    """A model sharded by fully_shard (FSDP2) is probed inside its job, on its shards' device."""
    shards = ([p for p in owner.parameters() if hasattr(p, "full_tensor")]
              if owner is not None else [])  # not `if owner`: torch.compile's has no len()
    if not shards:
        return
    if not in_job():
        raise ValueError("model should be probed inside the job that sharded it, but got a "
                         "model sharded by fully_shard (FSDP2) and no initialised process "
                         "group; call find_batch on every rank after "
                         "torch.distributed.init_process_group() and before "
                         "destroy_process_group().")
    if device.type != shards[0].device.type:
        raise ValueError(f"device should be the device the model's shards live on "
                         f"({shards[0].device.type}) for a model sharded by fully_shard "
                         f"(FSDP2), but got device={str(device)!r}; leave device out.")


def check_sharded_plan(trace: str | None) -> None:
    """A plan for a target from inside an FSDP2 job traces a meta replica of the full model."""
    if trace == "real":
        raise ValueError("trace should be 'fake' (or left out) for a target plan of a model "
                         "sharded by fully_shard (FSDP2), but got trace='real': the plan traces "
                         "a meta replica of its full shapes, and no rank holds its weights; leave "
                         "trace out, or leave target out to probe this job's real steps.")


def has_meta_tensors(model: Any) -> bool:
    """A model built on the meta device (any of its parameters or buffers)."""
    return isinstance(model, torch.nn.Module) and any(
        t.is_meta for t in (*model.parameters(), *model.buffers()))


def _check_trace(model: Any, target: Any, trace: str | None, step: Any,
                 said: Spelling) -> None:
    """trace= and a model built on the meta device: what can be planned, and how."""
    on_meta = has_meta_tensors(model)
    if on_meta and target is None:
        raise ValueError(f"{said('target')} should name a GPU to plan for when the model is on "
                         f"the meta device (it has no weights to run here), but got "
                         f"{said('target', None)}; pass e.g. {said('target', 'A100-80GB')}, or "
                         f"build the model on a real device.")
    if on_meta and trace == "real":
        raise ValueError(f"{said('trace')} should be 'fake' (or left out) for a model on the meta "
                         f"device, but got {said('trace', 'real')}: it has no weights to run "
                         f"real steps with.")
    if trace == "fake" and target is None:
        raise ValueError(f"{said('trace', 'fake')} plans for a GPU that is not here: pass "
                         f"{said('target')} (e.g. {said('target', 'A100-80GB')}), or leave "
                         f"{said('trace')} out to probe this device with real steps.")
    if trace == "fake" and (step is not None or not isinstance(model, torch.nn.Module)):
        raise ValueError(f"{said('trace', 'fake')} needs the model form, find_batch(model, "
                         f"make_batch, ...): a step(batch_size) of your own runs on your real "
                         f"tensors; leave {said('trace')} out (or {said('trace', 'real')}).")


def _check_lengths(make_batch: Any, said: Spelling) -> None:
    if not callable(make_batch) or isinstance(make_batch, (torch.Tensor, torch.utils.data.Dataset,
                                                           torch.utils.data.DataLoader)):
        raise TypeError(f"make_batch should be a callable make_batch(batch_size, seq_len) with "
                        f"{said('seq_len')}, but got {type(make_batch).__name__}; write one that "
                        f"builds a batch of that many samples of that length.")
    try:
        inspect.signature(make_batch).bind(1, 1)
    except TypeError:
        name = getattr(make_batch, "__name__", type(make_batch).__name__)
        raise TypeError(f"make_batch should take (batch_size, seq_len) with {said('seq_len')}, "
                        f"but got {name}{inspect.signature(make_batch)}; add the seq_len "
                        f"parameter, e.g. def {name}(batch_size, seq_len).") from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass


def check_amp(amp: str | None, device: torch.device) -> None:
    """A forced ``amp`` the device's autocast cannot run: one line, not a probe that silently
    measures float32 (autocast warns "Disabling autocast" and runs without it)."""
    if amp is None:
        return
    dtype = AMP_DTYPES[amp]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device.type, dtype=dtype):
                pass
        except RuntimeError as error:  # a device type autocast does not know at all
            caught.append(warnings.WarningMessage(str(error), UserWarning, "", 0))
    refused = [str(w.message) for w in caught if "autocast" in str(w.message).lower()
               or "not supported" in str(w.message)]
    if refused:
        raise ValueError(f"amp should be a precision autocast runs on {device.type}, but got "
                         f"amp={amp!r}, which this PyTorch does not autocast there; leave amp "
                         f"out, or try the other of 'bf16' and 'fp16'.")


def _check_step(model: Any, make_batch: Any, seq_len: Any, said: Spelling) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be the torch.nn.Module that step trains, when "
                        f"{said('step')} is given, but got model={model!r}; call "
                        f"find_batch(model, step=my_step, optimizer=optimizer), or "
                        f"find_batch(my_step) without a model.")
    if make_batch is not None or seq_len is not None:
        raise TypeError(f"make_batch and {said('seq_len')} should be left out with "
                        f"{said('step')}: the step makes its own batches; call "
                        f"find_batch(model, step=my_step, optimizer=optimizer).")


def _check_model(model: Any, make_batch: Any) -> None:
    if isinstance(model, type):
        raise TypeError(f"model should be a model instance or a step(batch_size) function, but "
                        f"got model={model.__name__} (a class); create it first, e.g. "
                        f"find_batch({model.__name__}(), ...).")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError(f"model should be a torch.nn.Module or a step(batch_size) callable, "
                        f"but got model={model!r}.")
    if isinstance(model, torch.nn.Module) and make_batch is None:
        raise TypeError("make_batch is required with a model: pass make_batch(batch_size) -> "
                        "batch, a Dataset, a DataLoader or one example tensor, e.g. "
                        "find_batch(model, torch.randn(3, 32, 32)).")


def _check_sizes(max_batch_size: Any, multiple_of: int, start: Any, said: Spelling) -> None:
    """The sizes tried: max_batch_size and start against multiple_of, and each other."""
    if max_batch_size is not None and (isinstance(max_batch_size, bool)
                                       or not isinstance(max_batch_size, int)
                                       or max_batch_size < multiple_of):
        raise ValueError(f"{said('max_batch_size')} should be an int >= {said('multiple_of')} "
                         f"({multiple_of}), but got {said('max_batch_size', max_batch_size)}; "
                         f"raise it or lower {said('multiple_of')}.")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1
                              or start % multiple_of):
        raise ValueError(f"{said('start')} should be a positive multiple of "
                         f"{said('multiple_of')} ({multiple_of}), but got "
                         f"{said('start', start)}.")
    if start is not None and max_batch_size is not None and start > max_batch_size:
        raise ValueError(f"{said('max_batch_size')} should be >= {said('start')} ({start}), but "
                         f"got {said('max_batch_size', max_batch_size)}; raise "
                         f"{said('max_batch_size')} or lower {said('start')}.")


def check_parallel(parallel: str | None, target: Any, count: int, is_module: bool,
                   said: Spelling = PYTHON) -> tuple[str | None, int]:
    """``parallel=`` and the GPUs it plans for: ``(strategy, world_size)``. A target that counts
    several GPUs without ``parallel`` is planned under DDP, what torchrun with
    DistributedDataParallel gives; inside a job a one-GPU target takes the job's world size."""
    if parallel is None:
        return ("ddp", count) if count > 1 else (None, 1)
    given = said("parallel", parallel)
    if target is None:
        raise ValueError(f"{given} plans GPUs that are not here: pass a target with a count, "
                         f"e.g. {said('target', '8xA100-80GB')} {given}; inside a job, "
                         f"find_batch probes the real ranks without {said('parallel')}.")
    if count == 1 and not in_job():
        raise ValueError(f"{given} should come with more than one GPU, but got "
                         f"{said('target', target)} and no initialised process group; count the "
                         f"GPUs in the target, e.g. "
                         f"{said('target', f'8x{memory.parse_gpus(target)[1]}')}, or leave "
                         f"{said('parallel')} out.")
    if not is_module:
        raise ValueError(f"{given} needs the model form, find_batch(model, make_batch, ...): "
                         f"the plan reads the model's parameters to shard them; pass the model, "
                         f"or leave {said('parallel')} out.")
    return parallel, count if count > 1 else torch.distributed.get_world_size()


def checkpoints(model: torch.nn.Module) -> bool:
    """The model recomputes activations already: Hugging Face's flag, a block's forward through
    torch.utils.checkpoint, or a CheckpointWrapper."""
    with warnings.catch_warnings():  # transformers 5 renamed it, and warns on the old name
        warnings.simplefilter("ignore")
        if (getattr(model, "is_activation_checkpointing", False)
                or getattr(model, "is_gradient_checkpointing", False)):
            return True
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if (isinstance(forward, functools.partial)
                and forward.func is torch.utils.checkpoint.checkpoint):
            return True
        if type(module).__name__ == "CheckpointWrapper":
            return True
        if getattr(module, "gradient_checkpointing", False) is True:
            return True
    return False
