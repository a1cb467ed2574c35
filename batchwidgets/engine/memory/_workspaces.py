"""The memory a GPU step allocates beside its tensors: cuBLAS's and cuBLASLt's workspaces, kept
for the life of the process, and cuDNN's per convolution; which ops take them, and a target's.

Usage:
    >>> from batchwidgets.engine.memory._workspaces import target_workspaces
    >>> target_workspaces("H100-80GB").cublas_bytes // 2**20, target_workspaces("T4").cublas_threads
    (32, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._allocator import KIB, MIB, WORKSPACE_FREE_FRACTION
from ._targets import GPU_CAPABILITY, GPU_SMS, SIZE_CAPABILITY, SIZE_SMS, gpu_name

# NOTE [ Workspaces of the simulated device ]
# A GPU step allocates memory that is no tensor, through the same caching allocator:
# - cuBLAS: one workspace per handle and stream, made at the first GEMM and kept for the life of
#   the process. PyTorch's default CUBLAS_WORKSPACE_CONFIG is ":4096:2:16:8", 2 chunks of 4 MiB
#   and 8 of 16 KiB = 8 MiB + 128 KiB (Hopper uses ":4096:8", 32 MiB: pass cublas_bytes).
# - cuDNN: each convolution (forward and both backward passes) takes a workspace for its
#   algorithm and frees it after. Which algorithm runs depends on the free memory: PyTorch
#   skips algorithms whose workspace exceeds the largest block it could get (cacheInfo: the
#   larger of the room left under the cap and the largest cached free block) and falls back to
#   one with less workspace when allocating it fails. The simulated convolution wants
#   ``conv_ratio`` times the bytes of its first argument (the input forward, the output's
#   gradient backward: affine in the batch size, as a trace needs), gets ``min(wanted,
#   conv_free_fraction * largest_free)`` after the op's outputs, and runs with none when even
#   that cannot be allocated, so the workspace follows the free memory as cuDNN's choice does,
#   and never raises by itself.
# NOTE [ cuDNN's choice of algorithm, and a boundary that moves ]
# cuDNN picks each convolution's algorithm by the workspace it can get, so the memory a step needs
# at the edge depends on what is free there, and a real GPU's boundary can move by a sample or two
# between runs (benchmarks/results/probe_vs_peers_cuda.md saw 641-643). The probe does not pin the
# choice (a workspace cap while probing would measure a slower step than the user will train
# with, and torch.backends.cudnn.benchmark is the user's setting, restored untouched). Instead:
# the prediction replays workspaces by the same rule (min(wanted, a share of the largest free
# block), none when that fails), so it lands at the edge; the two runs at the edge decide the
# answer; and the recommendation keeps headroom (0.9 by default) below it, which absorbs a
# boundary that moves by a few samples. The report's what-if row for expandable_segments says
# how much of the edge is the allocator's segments rather than the tensors.
# NOTE [ cuDNN's largest plan ]
# Before a convolution runs, PyTorch's cuDNN path (aten/src/ATen/native/cudnn/Conv_v8.cpp,
# generate_and_filter_plans) allocates the largest workspace of the plans cuDNN offers, halving it
# until the allocation succeeds, and frees it; the plan then runs with its own. Among the plans is
# an explicit GEMM over the unfolded input, whose workspace is the input times the kernel's area
# (kh x kw): a target plan's convolution wants that much (``conv_unfold``), capped by the free
# memory as before. On the wide CNN recorded on an H100 capped at 8 GiB (true boundary 641, seen
# 641-643 between runs), the plan went from 672 (the input once) to 642.
# NOTE [ A reduction's staging buffer ]
# A CUDA sum or mean that splits its inputs across thread blocks (PyTorch's Reduce.cuh,
# setReduceConfig) allocates a staging buffer for the blocks' partial results, and 4 bytes of
# semaphore per output block, through the caching allocator, for the length of the kernel. The
# bias gradient of every Linear is such a reduction (the output's gradient summed over the batch
# and tokens), and its buffer is large: block width x output vector x accumulator bytes x outputs
# x blocks per output, the blocks per output growing with the rows until the grid fills the GPU
# (SMs x resident blocks per SM). On an H200 (132 SMs) every fp32 bias gradient of a transformer
# at training sizes staged 132 MiB, whatever its width, on top of the step's peak (the truth
# kit's snapshots, benchmarks/results/gpu_truth_h200.json: encoder plan 816 against a real 784).
# ``staging_bytes`` (memory/_allocator.py) follows setReduceConfig for a contiguous input reduced
# over leading dims (the bias gradient's case) or trailing dims (``reduction_shape``); other
# layouts stage nothing here. The buffer is no affine function of the batch (none below 256
# values per thread, then growing with the rows up to the full grid), so a trace holds the
# reduction's rows, which are, and the replay sizes the buffer from them at every batch size:
# the small sizes a plan traces stage nothing, the answer's size may stage tens of MiB.
REDUCE_OPS = frozenset({"sum", "mean"})


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def reduction_shape(tensor: torch.Tensor, dims: object) -> tuple[int, int, bool, int] | None:
    """``(outputs, rows, fastest, accumulator_bytes)`` of a CUDA sum/mean of ``tensor`` over
    ``dims``: a contiguous input reduced over leading dims (``fastest`` False: a bias gradient)
    or trailing ones; None for other layouts (NOTE [ A reduction's staging buffer ])."""
    shape = list(tensor.shape)
    if not shape or 0 in shape or not tensor.is_contiguous():
        return None
    n = len(shape)
    wanted = set(range(n)) if dims is None or dims == [] or dims == () else {
        d % n for d in ([dims] if isinstance(dims, int) else dims)}
    kept = [i for i in range(n) if i not in wanted and shape[i] != 1]
    reduced = [i for i in range(n) if i in wanted and shape[i] != 1]
    if not reduced or (kept and not (max(reduced) < min(kept) or min(reduced) > max(kept))):
        return None  # nothing reduced, or reduced dims between kept ones: not modelled
    rows = int(torch.Size([shape[i] for i in reduced]).numel())
    outputs = int(torch.Size([shape[i] for i in kept]).numel())
    acc = 8 if tensor.dtype in (torch.float64, torch.complex64) else 4
    return outputs, rows, not kept or min(reduced) > max(kept), acc


MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "linear", "matmul",
                        "_addmm_activation"})
CONV_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})


@dataclass(frozen=True)
class Workspaces:
    """Sizes of the simulated workspaces (NOTE [ Workspaces of the simulated device ])."""

    cublas_bytes: int = 4096 * KIB * 2 + 16 * KIB * 8  # PyTorch's default CUBLAS_WORKSPACE_CONFIG
    cublas_threads: int = 1  # handles, each with its workspace: 2 on a GPU, whose backward runs
    # on the autograd engine's own thread (measured on an H100: 2 x 32 MiB)
    cublaslt_bytes: int = 0  # cuBLASLt's, made at the first product with a bias (1 MiB measured)
    conv_ratio: float = 1.0  # a convolution wants this times its input (gradient), in bytes
    conv_unfold: bool = False  # and times its kernel's area (NOTE [ cuDNN's largest plan ])
    conv_free_fraction: float = WORKSPACE_FREE_FRACTION  # at most this share of the largest
    # free block
    sms: int = 0  # a reduction's staging buffer on this many SMs (0: none; NOTE [ A reduction's
    # staging buffer ])
    threads_per_sm: int = 2048


NO_WORKSPACES = Workspaces(cublas_bytes=0, conv_ratio=0.0)


def kernel_area(name: str, args: tuple) -> int:
    """kh x kw of a convolution's weight (an argument after the input, or the gradient and the
    input), 1 where there is none."""
    weight = args[2 if name == "convolution_backward" else 1] if len(args) > 2 else None
    return (max(1, int(torch.Size(weight.shape[2:]).numel()))
            if isinstance(weight, torch.Tensor) else 1)


def target_capability(name: str) -> tuple[int, int]:
    """The compute capability of a target (a size: an Ampere-or-newer GPU)."""
    return GPU_CAPABILITY.get(gpu_name(name), SIZE_CAPABILITY)


def target_workspaces(name: str) -> Workspaces:
    """The workspaces of a target: cuBLAS takes 32 MiB on Hopper (H100, H200), 8 MiB + 128 KiB
    elsewhere (NOTE [ Workspaces of the simulated device ])."""
    name = gpu_name(name)
    hopper = name.startswith(("H100", "H200")) or name not in GPU_CAPABILITY  # a size: the
    # larger workspaces, so that the plan errs low
    return gpu_workspaces(hopper, *GPU_SMS.get(name, SIZE_SMS))


def gpu_workspaces(hopper: bool, sms: int, threads_per_sm: int) -> Workspaces:
    """A GPU's workspaces, from what sizes them: Hopper's cuBLAS, its SMs and their threads."""
    return Workspaces(cublas_bytes=32 * MIB if hopper else Workspaces.cublas_bytes,
                      cublas_threads=2, cublaslt_bytes=1 * MIB, conv_unfold=True, sms=sms,
                      threads_per_sm=threads_per_sm)


def device_rules(device: torch.device) -> tuple[Workspaces, tuple[int, int]]:
    """The workspaces and compute capability of the GPU present at ``device``, as a plan for it
    takes them (NOTE [ On CUDA, the plan for this device first ] in probe/_probe.py)."""
    properties = torch.cuda.get_device_properties(device)
    capability = (properties.major, properties.minor)
    return gpu_workspaces(capability >= (9, 0), properties.multi_processor_count,
                          properties.max_threads_per_multi_processor), capability
