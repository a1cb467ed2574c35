"""What a CUDA target runs where the CPU runs something else, for the trace of a plan: dropout's
mask, the attention kernel of each ``scaled_dot_product_attention`` call and what it stores, and
the optimizers' multi-tensor (foreach) step.

Usage:
    >>> import torch
    >>> from batchwidgets.engine.memory._kernels import sdpa_backend
    >>> q = torch.empty(2, 4, 256, 32)
    >>> sdpa_backend((9, 0), q, q, q, None, 0.1, False), sdpa_backend((7, 5), q.half(), q.half(),
    ...     q.half(), None, 0.0, True)
    ('efficient', 'efficient')
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# NOTE [ The target's kernels ]
# A plan traces the step on the CPU (real or fake tensors) and replays it for a CUDA target, so
# every op whose CUDA kernel stores something else than the CPU's would be counted wrong. Three
# of them hold most of the memory of a transformer, and are rewritten while a plan's step runs
# (``cuda_kernels``: the user's code calls the same functions, they run as the target's
# would):
# - dropout: CUDA's out-of-place dropout is the fused native_dropout, keeping a one-byte bool
#   mask; the CPU's multiplies by a float noise tensor and keeps that (4 bytes an element). A
#   transformer encoder at 256 tokens kept 7 MB a sample of such masks on the CPU.
# - scaled_dot_product_attention: the backend CUDA picks for each call, by the rules of
#   aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``sdpa_backend``; the user's
#   torch.backends.cuda.*_sdp_enabled flags and sdpa_kernel contexts count). Flash and
#   memory-efficient attention store the output and a float32 logsumexp per query row, never
#   the L x L matrix that the CPU's math path keeps three times over (scores, softmax, dropout);
#   their backward takes the input gradients and float32 buffers (flash: dq accumulator and
#   softmax_d, rounded to 128 rows; efficient: delta, and a float32 grad-q accumulator for half
#   inputs) and frees the buffers after. ``_FusedAttention`` allocates exactly those. Its
#   output is zeros: the numbers of a plan's trace are never read. cuDNN attention (preferred
#   on sm90 and sm100 by recent builds with cuDNN > 9.15) keeps the same output and per-row
#   statistics and is counted as flash. The math path on the target is the CPU's, except that
#   its dropout is CUDA's.
# - the optimizer: with foreach=None, PyTorch's optimizers take their multi-tensor (foreach)
#   step on CUDA and the per-parameter loop on the CPU; foreach keeps a temporary the size of
#   all parameters at once (Adam's sqrt of exp_avg_sq). ``foreach_as_on_cuda`` sets
#   foreach=True on such groups for each step of the plan, and puts None back after.
# Left out, and the error band's business: cuDNN's and cuBLAS's algorithm choice beyond the
# workspaces of memory/_simulated.py, autocast's CUDA op lists (a plan with amp traces the
# CPU's), and kernels of other libraries.

_HALF = (torch.float16, torch.bfloat16)


def _is_half(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _HALF


def _gemm_alignment(capability: tuple[int, int], half: bool) -> int:
    """minimum_gemm_alignment of sdp_utils.cpp: the head size's multiple for efficient attention."""
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense: same batch; same heads, or q's a multiple of k's
    (= v's) with enable_gqa."""
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if q.size(1) == k.size(1) == v.size(1):
        return True
    return enable_gqa and k.size(1) == v.size(1) and q.size(1) % k.size(1) == 0


def sdpa_backend(capability: tuple[int, int], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                 is_causal: bool, enable_gqa: bool = False) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel a GPU of compute ``capability``
    runs for this call (NOTE [ The target's kernels ])."""
    dense = all(t.dim() == 4 and t.size(-2) > 0 for t in (q, k, v)) and not any(
        t.is_nested for t in (q, k, v))
    if not dense:
        return "math"
    strides_ok = all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (q, k, v))
    same_dtype = q.dtype == k.dtype == v.dtype
    head_sizes = q.size(-1), k.size(-1), v.size(-1)
    backends = torch.backends.cuda
    if (backends.flash_sdp_enabled() and capability >= (8, 0) and attn_mask is None
            and same_dtype and _is_half(q) and len(set(head_sizes)) == 1 and q.size(-1) <= 256
            and not (capability in ((8, 6), (8, 9), (12, 0)) and q.size(-1) > 192
                     and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            and not (is_causal and q.size(-2) != k.size(-2))
            and _heads_ok(q, k, v, enable_gqa) and strides_ok):
        return "flash"
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    alignment = _gemm_alignment(capability, _is_half(q))
    if (backends.mem_efficient_sdp_enabled() and capability >= (5, 0) and same_dtype
            and q.dtype in dtypes and q.size(-1) == k.size(-1)
            and q.size(-1) % alignment == 0 and v.size(-1) % alignment == 0
            and all(t.stride(-1) == 1 for t in (q, k, v)) and _heads_ok(q, k, v, enable_gqa)):
        return "efficient"
    return "math"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _FusedAttention(torch.autograd.Function):
    """What flash or memory-efficient attention allocates and keeps (NOTE [ The target's
    kernels ]), with zeros for numbers. ``mask`` is the additive bias efficient attention keeps."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        batch, heads, rows = q.shape[0], q.shape[1], q.shape[2]
        out = torch.zeros((batch, rows, heads, v.shape[-1]), dtype=q.dtype,
                          device=q.device).transpose(1, 2)  # the kernel's (B, L, H, E) layout
        if backend == "efficient" and _is_half(q) and v.shape[-1] > 128:
            accumulator = torch.empty((batch, rows, heads, v.shape[-1]), dtype=torch.float32)
            del accumulator  # the output accumulator of large heads, freed with the kernel
        lse_rows = rows if backend == "flash" else _round_up(rows, 32)
        lse = torch.empty((batch, heads, lse_rows), dtype=torch.float32, device=q.device)
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v = ctx.saved_tensors[:3]  # out, lse and the bias are kept, not read
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        batch, heads, rows, size = q.shape
        if ctx.backend == "flash":
            buffers = [torch.empty((batch, heads, _round_up(rows, 128)), dtype=torch.float32),
                       torch.empty((batch, _round_up(rows, 128), heads, _round_up(size, 32)),
                                   dtype=torch.float32)]  # softmax_d, dq_accum
            if k.shape[1] != heads:  # GQA: dk and dv over every query head, then summed
                buffers += [torch.empty((batch, heads, *k.shape[2:]), dtype=k.dtype),
                            torch.empty((batch, heads, *v.shape[2:]), dtype=v.dtype)]
        else:
            buffers = [torch.empty((batch, heads, rows), dtype=torch.float32)]  # delta
            if _is_half(q):
                buffers.append(torch.empty((batch, heads, rows, _round_up(size, 32)),
                                           dtype=torch.float32))  # grad-q accumulator
        del buffers
        return grad_q, grad_k, grad_v, None, None


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The additive bias efficient attention keeps for a mask: a bool mask as q's dtype, its
    last dimension padded to a multiple of 16 (pad_bias in attention.cu)."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            mask.logical_not(), float("-inf"))
    last = mask.size(-1)
    if last % 16:
        padded = torch.zeros((*mask.shape[:-1], _round_up(last, 16)), dtype=mask.dtype,
                             device=mask.device)
        padded[..., :last] = mask
        mask = padded[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float | None,
          enable_gqa: bool) -> torch.Tensor:
    """The math path of sdpa with CUDA's dropout (the CPU's keeps a float noise tensor)."""
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    factor = math.sqrt(1 / math.sqrt(q.size(-1)) if scale is None else scale)
    scores = (q * factor) @ (k * factor).transpose(-2, -1)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if mask is not None:
        scores = (scores.masked_fill(mask.logical_not(), float("-inf"))
                  if mask.dtype == torch.bool else scores + mask)
    weights = torch.softmax(scores, dim=-1)
    return torch.native_dropout(weights, dropout_p, True)[0] @ v


def _attention(capability: tuple[int, int], func: Any, args: tuple, kwargs: dict) -> Any:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    call = dict(zip(names, args), **kwargs)
    q, k, v = call["query"], call["key"], call["value"]
    mask, dropout_p = call.get("attn_mask"), float(call.get("dropout_p", 0.0))
    is_causal, enable_gqa = bool(call.get("is_causal", False)), bool(call.get("enable_gqa", False))
    backend = sdpa_backend(capability, q, k, v, mask, dropout_p, is_causal, enable_gqa)
    if backend == "math":
        if dropout_p > 0:
            return _math(q, k, v, mask, dropout_p, is_causal, call.get("scale"), enable_gqa)
        return func(*args, **kwargs)
    if backend == "efficient" and k.size(1) != q.size(1):  # GQA: efficient repeats k and v
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    bias = _bias(mask, q, k) if mask is not None else None
    return _FusedAttention.apply(q, k, v, bias, backend)


def _dropout_call(func: Any, args: tuple, kwargs: dict) -> tuple[Any, float, bool] | None:
    """(input, p) of an out-of-place training dropout, the call CUDA fuses; else None."""
    names = ("input", "p", "training" if func is not _ORIGINAL["torch.dropout"] else "train",
             "inplace")
    call = dict(zip(names, args), **kwargs)
    p, training = call.get("p", 0.5), call.get("training", call.get("train", True))
    return (call["input"], p) if training and not call.get("inplace") and 0 < p < 1 else None


_ORIGINAL = {"F.scaled_dot_product_attention": F.scaled_dot_product_attention,
             "F.dropout": F.dropout, "torch.dropout": torch.dropout}


@contextmanager
def _target_functions(capability: tuple[int, int]) -> Iterator[None]:
    """F.scaled_dot_product_attention, F.dropout and torch.dropout as the target runs them, on
    this thread only (NOTE [ Why the functions are swapped, not intercepted by a mode ])."""
    owner = threading.get_ident()
    sdpa, dropout, torch_dropout = (F.scaled_dot_product_attention, F.dropout, torch.dropout)

    def attention(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return sdpa(*args, **kwargs)
        return _attention(capability, sdpa, args, kwargs)

    def swap_dropout(original: Any) -> Any:
        def dropped(*args: Any, **kwargs: Any) -> Any:
            fused = (_dropout_call(original, args, kwargs) if threading.get_ident() == owner
                     else None)
            if fused is None:
                return original(*args, **kwargs)
            return torch.native_dropout(fused[0], fused[1], True)[0]
        return dropped

    F.scaled_dot_product_attention = attention
    F.dropout, torch.dropout = swap_dropout(dropout), swap_dropout(torch_dropout)
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout, torch.dropout = sdpa, dropout, torch_dropout


# NOTE [ Why the functions are swapped, not intercepted by a mode ]
# A TorchFunctionMode is popped while it handles a call, so it never sees the calls made inside
# a function that dispatches through __torch_function__ itself: nn.MultiheadAttention's
# F.multi_head_attention_forward calls scaled_dot_product_attention from inside, and a mode saw
# only the outer call. So the three functions are swapped in their modules for the plan's step
# (the modules' own callers look them up there at each call: torch.nn.functional's functions,
# nn.Dropout, Hugging Face's attention), and act only on the plan's thread: another thread of
# the kernel calls the originals. Code that bound the function by name at import time
# (``from torch.nn.functional import scaled_dot_product_attention``) runs the CPU's kernel, and
# its plan counts the L x L matrix; that errs toward a smaller batch.


@contextmanager
def foreach_as_on_cuda() -> Iterator[None]:
    """Each optimizer step inside, on this thread, takes the multi-tensor path CUDA takes by
    default: groups with foreach=None (and neither fused nor differentiable) get foreach=True
    for the step; the hooks are global, so another thread's steps are left as they are."""
    changed: list[dict] = []
    owner = threading.get_ident()

    def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != owner:  # another thread's training: its own path
            return
        for group in optimizer.param_groups:
            if ("foreach" in group and group["foreach"] is None and not group.get("fused")
                    and not group.get("differentiable")):
                group["foreach"] = True
                changed.append(group)

    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        while changed:
            changed.pop()["foreach"] = None

    handles = [register_optimizer_step_pre_hook(before),
               register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        after(None, None, None)  # a step that raised left its groups changed


@contextmanager
def cuda_kernels(capability: tuple[int, int]) -> Iterator[None]:
    """The kernels and optimizer path of a GPU of compute ``capability`` while a plan's step
    runs (NOTE [ The target's kernels ])."""
    with _target_functions(capability), foreach_as_on_cuda():
        yield
