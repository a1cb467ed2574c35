"""find_batch's options as one frozen dataclass, ``FindBatchRequest``, each declared once (NOTE
[ Options declared once ] in engine/_options.py): find_batch's signature takes its defaults from
``OPTIONS``, and its checks, ``%find_batch``'s flags, the ProbePanel's controls and the
remembered answer's key read its fields."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...results import BatchSizeReport
from .. import memory
from .._options import (
    AMP_NAMES,
    TRACES,
    Amp,
    OnStep,
    ProbeStep,
    ShouldStop,
    Spelling,
    Trace,
    integer,
    integers,
    number,
    option,
)
from .._util import usable_device
from ._parallel import PARALLEL

_RESTORED = ("state_dict", "load_state_dict")  # how the probe puts a scaler or scheduler back


def _optimizer(value: Any, said: Spelling) -> None:
    if not isinstance(value, torch.optim.Optimizer):
        name = value.title() if isinstance(value, str) else "Adam"
        name = name if hasattr(torch.optim, name) else "Adam"
        raise TypeError(f"{said('optimizer')} should be a torch.optim.Optimizer, but got "
                        f"{said('optimizer', value)}; create it first, e.g. "
                        f"optimizer=torch.optim.{name}(model.parameters()).")


def _amp(value: Any, said: Spelling) -> None:
    if value not in AMP_NAMES:
        raise ValueError(f"{said('amp')} should be one of {sorted(AMP_NAMES)} or None, but got "
                         f"{said('amp', value)}.")


def _multiple_of(value: Any, said: Spelling) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{said('multiple_of')} should be a positive int, but got "
                         f"{said('multiple_of', value)}; use e.g. {said('multiple_of', 8)} for "
                         f"tensor cores.")


def _headroom(value: Any, said: Spelling) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{said('headroom')} should be in (0, 1], but got "
                         f"{said('headroom', value)}; use e.g. {said('headroom', 0.9)} to keep "
                         f"10% of the memory free.")


def _steps_per_trial(value: Any, said: Spelling) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{said('steps_per_trial')} should be an int >= 1, but got "
                         f"{said('steps_per_trial', value)}.")


def _restorable(name: str) -> Any:
    def check(value: Any, said: Spelling) -> None:
        if not all(hasattr(value, method) for method in _RESTORED):
            raise TypeError(f"{said(name)} should have state_dict() and load_state_dict() (a "
                            f"GradScaler, an LR scheduler) so the probe can put it back, but "
                            f"got {said(name, value)}; pass the object your loop steps, or "
                            f"leave it out.")
    return check


def _seq_len(value: Any, said: Spelling) -> None:
    lengths = list(value) if not isinstance(value, (int, str)) else None
    if (not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                           for n in lengths)):
        raise ValueError(f"{said('seq_len')} should be a list of positive ints such as "
                         f"{said('seq_len', [128, 256, 512])}, but got {said('seq_len', value)}.")


def _trace(value: Any, said: Spelling) -> None:
    if value not in TRACES:
        raise ValueError(f"{said('trace')} should be one of {list(TRACES)} or None, but got "
                         f"{said('trace', value)}; 'fake' traces on fake tensors (nothing runs), "
                         f"'real' runs real steps.")


def _function(name: str, called: str) -> Any:
    def check(value: Any, said: Spelling) -> None:
        if not callable(value):
            raise TypeError(f"{said(name)} should be a function, {called}, but got "
                            f"{said(name, value)}; pass one, or leave {said(name)} out.")
    return check


def _parallel(value: Any, said: Spelling) -> None:
    if value not in PARALLEL:
        raise ValueError(f"{said('parallel')} should be one of {list(PARALLEL)} or None, but got "
                         f"{said('parallel', value)}; 'fsdp' is FSDP2 fully_shard, "
                         f"'zero1'-'zero3' DeepSpeed's stages, 'compare' plans each.")


def _true_or_false(name: str) -> Any:
    def check(value: Any, said: Spelling) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{said(name)} should be True or False, but got "
                            f"{said(name, value)}.")
    return check


def _keep_output(value: Any, said: Spelling) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{said('keep_output')} should be True or False, but got "
                        f"{said('keep_output', value)}; pass {said('keep_output', False)} for a "
                        f"loop that frees the output before backward.")


_YES, _NO = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def _yes_no(text: str) -> bool:
    """``--keep-output no`` -> False (yes/no, true/false, on/off, 1/0)."""
    if text.lower() not in (*_YES, *_NO):
        raise ValueError(f"should be yes or no, but got {text!r}.")
    return text.lower() in _YES


def _read_as_given(parse: Any) -> Any:
    """A flag's text checked as find_batch will read it, and kept as the text: find_batch then
    reads the string exactly as when it is called with it."""
    def text(value: str) -> str:
        parse(value)
        return value
    return text


def _target(text: str) -> None:
    memory.parse_target(memory.parse_gpus(text)[1])


# NOTE [ The report's defaults ]
# BatchSizeReport has headroom and multiple_of fields with defaults: users build reports by hand
# (``BatchSizeReport(0, None, (), "cpu", None)``, the docs' examples), so they keep them. The
# report is in results/, below the engine, which it may never import (not even lazily:
# tests/test_boundaries.py), and the request cannot sit below the engine with it: its checks
# and flag parsers are engine code (sizes, devices, GPU targets, the parallel strategies). So
# the one literal of each is the report's, the layer below, and the request's field reads it;
# the signature reads the request's, and tests/engine/test_options.py holds all three equal.
@dataclass(frozen=True)
class FindBatchRequest:
    """find_batch's options, as it was called: one field each, in its signature's order, with
    its help line, check, flag and whether a remembered answer's key holds it (``keyed``)."""

    loss_fn: Callable | None = option(
        None, "loss_fn(output, target) (default: the output's .loss, or its mean)",
        check=_function("loss_fn", "loss_fn(output, target) -> loss"), flag="name")
    optimizer: torch.optim.Optimizer | None = option(
        None, "a torch.optim.Optimizer (default: a fresh AdamW)", check=_optimizer, flag="name")
    device: torch.device | str | None = option(
        None, "cpu, cuda, cuda:1 or mps (default: the model's)",
        parse=_read_as_given(usable_device))
    budget: int | str | None = option(
        None, "memory cap such as 512MB or 16GiB; on CUDA it emulates a smaller GPU (default: "
              "the whole GPU; half of the available RAM on the CPU)",
        metavar="SIZE", parse=_read_as_given(memory.parse_bytes))
    amp: Amp | None = option(None, "probe under autocast", check=_amp, choices=("bf16", "fp16"))
    max_batch_size: int | None = option(None, "largest batch size to try", metavar="N",
                                        parse=integer)
    # the report's own defaults, which it keeps when built by hand (NOTE [ The report's defaults ])
    multiple_of: int = option(BatchSizeReport.multiple_of, "try only multiples of N",
                              check=_multiple_of, metavar="N", parse=integer)
    headroom: float = option(BatchSizeReport.headroom, "recommend at most F x max_batch_size",
                             check=_headroom, metavar="F", parse=number)
    scaler: Any = option(None, "a GradScaler to use and restore afterwards",
                         check=_restorable("scaler"), flag="name")
    scheduler: Any = option(None, "an LR scheduler to restore afterwards",
                            check=_restorable("scheduler"), flag="name")
    steps_per_trial: int = option(2, "training steps at each batch size",
                                  check=_steps_per_trial, metavar="N", parse=integer)
    start: int | None = option(None, "first batch size tried", metavar="N", parse=integer)
    # how to report, not what is measured: not in a remembered answer's key
    on_step: OnStep | None = option(
        None, "on_step(attempt): each Attempt as it finishes (progress)",
        check=_function("on_step", "on_step(attempt)"), flag="", keyed=False)
    should_stop: ShouldStop | None = option(
        None, "should_stop() -> True ends the search with the sizes it finished (a Stop "
              "button)", check=_function("should_stop", "should_stop() -> bool"), flag="",
        keyed=False)
    seq_len: Sequence[int] | None = option(
        None, "sequence lengths, e.g. 128,256,512: MAKE_BATCH is make_batch(batch_size, "
              "seq_len) and the report's frontier maps each length to its largest batch",
        check=_seq_len, metavar="N,N,...", parse=integers)
    what_if: bool = option(False, "also probe under bf16, fp16, SGD and foreach=False "
                                  "(report.what_if)", flag="switch")
    target: str | int | None = option(
        None, f"predict for a GPU that is not here: {', '.join(memory.GPU_TARGETS)}, or a "
              f"size such as 24GiB; 8xA100-80GB for 8 of them with --parallel (predicted, not "
              f"run)", metavar="GPU", parse=_read_as_given(_target),
        offered=tuple(memory.GPU_TARGETS))
    trace: Trace | None = option(
        None, "how a --target plan traces its small sizes: on fake tensors (nothing runs; the "
              "default, and the only way for a model on the meta device) or by real steps",
        check=_trace, choices=TRACES)
    step: ProbeStep | None = option(
        None, "your own step(batch_size) that trains MODEL: MODEL is then protected and "
              "counted (leave MAKE_BATCH out)",
        check=_function("step", "step(batch_size)"), flag="name")
    parallel: str | None = option(
        None, "with --target NxGPU (e.g. 8xA100-80GB): plan each rank under DDP, ZeRO stage "
              "1-3 or FSDP2, or compare them; the answer is per rank", check=_parallel,
        choices=PARALLEL)
    keep_output: bool = option(
        True, "model the loop that keeps the output and loss alive through backward and the "
              "optimizer step, until the next forward returns; no: a loop that frees them "
              "before backward (the Hugging Face Trainer)", check=_keep_output,
        metavar="yes|no", parse=_yes_no)
    # whether to remember, not what is measured (see NOTE [ Remembered answers ] in
    # probe/_remember.py)
    cache: bool = option(
        True, "give back the answer an identical call remembered, and remember this one "
              "(--no-cache: neither read nor write)", check=_true_or_false("cache"),
        flag="negated", keyed=False)
    refresh: bool = option(
        False, "measure again even where an answer is remembered (and remember the new one)",
        check=_true_or_false("refresh"), flag="switch", keyed=False)


OPTIONS = FindBatchRequest()  # find_batch's defaults, which its signature spells
