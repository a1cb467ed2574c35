"""The GPUs a plan may target (``target="T4"``, ``"A100-80GB"``, or a size): their memory as
PyTorch reports it, less the CUDA context.

Usage:
    >>> from batchwidgets.engine.memory import parse_target
    >>> parse_target("t4")
    ('T4', 15291383808)
    >>> parse_target("H100-80GB@8GiB")    # that GPU's kernels and allocator, 8 GiB usable
    ('H100-80GB@8GiB', 8589934592)
    >>> parse_gpus("8xA100-80GB")
    (8, 'A100-80GB')
"""

from __future__ import annotations

import re

from ._allocator import MIB
from ._budget import parse_bytes

# NOTE [ GPU targets ]
# total_memory as torch.cuda.get_device_properties(0).total_memory reports it (cudaDeviceProp
# .totalGlobalMem), from printouts of _CudaDeviceProperties and deviceQuery in public issues
# and docs (the MiB figure where only that was printed). It varies by a few MiB with driver,
# ECC and board (seen: T4 14,930-15,109 MiB, V100-32GB 32,480-32,511 MiB, A100-80GB
# 81,051-81,251 MiB, H100 81,082-81,090 MiB); the common or lower value is taken.
# The CUDA context (driver state, kernel images of cuBLAS/cuDNN and PyTorch, loaded lazily since
# CUDA 11.7) takes device memory that the caching allocator never sees and that
# set_per_process_memory_fraction does not count; with lazy loading it is about 300-500 MiB on
# Ampere and Hopper. CUDA_CONTEXT_BYTES takes 512 MiB: overestimating it only lowers the
# predicted batch, and the prediction should not land above the real boundary.
GPU_TARGETS: dict[str, int] = {
    "T4": 15_095 * MIB,  # Tesla T4 (Colab), torch printout
    "L4": 23_612_293_120,  # deviceQuery: 22,518 MiB
    "A10G": 22_587 * MIB,  # AWS g5, torch printout
    "V100-16GB": 16_160 * MIB,  # V100-SXM2-16GB, torch printout
    "V100-32GB": 34_089_730_048,  # V100-SXM2-32GB, deviceQuery: 32,510 MiB
    "A100-40GB": 42_298_834_944,  # A100-SXM4-40GB, deviceQuery: 40,339 MiB
    "A100-80GB": 84_987_740_160,  # A100-SXM4-80GB, deviceQuery: 81,051 MiB
    "H100-80GB": 81_082 * MIB,  # H100 80GB HBM3 (SXM), torch printout
    "H200": 143_156 * MIB,  # H200 (141 GB HBM3e), torch printout
}
CUDA_CONTEXT_BYTES = 512 * MIB
# Compute capability, for the kernels a plan models (NOTE [ The target's kernels ] in
# _kernels.py); a target given as a size is taken as an Ampere-or-newer data-centre GPU.
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "T4": (7, 5), "L4": (8, 9), "A10G": (8, 6), "V100-16GB": (7, 0), "V100-32GB": (7, 0),
    "A100-40GB": (8, 0), "A100-80GB": (8, 0), "H100-80GB": (9, 0), "H200": (9, 0),
}
SIZE_CAPABILITY = (8, 0)
# Streaming multiprocessors and the most resident threads on each (cudaDeviceProp
# .multiProcessorCount, .maxThreadsPerMultiProcessor): a CUDA reduction sizes its cross-block
# staging buffer by them (NOTE [ A reduction's staging buffer ] in _workspaces.py). The SXM parts
# for the data-centre names; a target given as a size takes the most SMs, so its plan errs low.
GPU_SMS: dict[str, tuple[int, int]] = {
    "T4": (40, 1024), "L4": (58, 1536), "A10G": (80, 1536), "V100-16GB": (80, 2048),
    "V100-32GB": (80, 2048), "A100-40GB": (108, 2048), "A100-80GB": (108, 2048),
    "H100-80GB": (132, 2048), "H200": (132, 2048),
}
SIZE_SMS = (132, 2048)
_FAMILIES = {"v100": "V100-16GB", "a100": "A100-40GB", "h100": "H100-80GB"}  # smallest variant


def _normal(name: str) -> str:
    name = re.sub(r"[\s_\-]+", "", name.lower()).replace("nvidia", "").replace("tesla", "")
    return re.sub(r"(\d)(gib|g)$", r"\1gb", name)


CPU_TARGET = "CPU"  # target="4xCPU" with budget=: CPU processes, each under the budget


def is_cpu_target(value: object) -> bool:
    """``"CPU"`` (any case) as a target's device: CPU processes under ``budget=``."""
    return isinstance(value, str) and value.strip().upper() == CPU_TARGET


def gpu_name(target_name: str) -> str:
    """The GPU of a target's name, without a cap (``"H100-80GB@8GiB"`` -> ``"H100-80GB"``)."""
    return target_name.split("@", 1)[0]


def parse_target(value: int | str) -> tuple[str, int]:
    """``(name, usable_bytes)`` for a GPU name of ``GPU_TARGETS``, a size, or a GPU capped at a
    size.

    A name is case- and punctuation-blind (``"a100 40gb"``, ``"A100-40GB"``; a bare family such
    as ``"a100"`` means its smallest variant); its usable bytes are the total memory less the
    CUDA context (NOTE [ GPU targets ]). A size (``"24GiB"``, ``"16GB"``, ``"512M"``, an int)
    is the memory the process may use, as ``budget`` is. ``"H100-80GB@8GiB"`` is that GPU (its
    kernels and allocator) with the size usable, as under
    ``torch.cuda.set_per_process_memory_fraction`` (the cap counts no CUDA context).
    """
    if isinstance(value, str) and "@" in value:
        gpu, _, cap = value.partition("@")
        name, whole = parse_target(gpu)
        if not cap.strip() or not re.match(r"^\s*[0-9.]", cap):
            raise ValueError(f"target should name a GPU and the memory usable on it, such as "
                             f"'H100-80GB@8GiB', but got target={value!r}.")
        usable = parse_target(cap)[1]
        if name not in GPU_TARGETS or usable > whole:
            raise ValueError(f"target should cap a named GPU at most at its usable memory "
                             f"({whole / 2**30:.1f} GiB on {name}), but got target={value!r}.")
        return f"{name}@{cap.strip()}", usable
    if isinstance(value, str) and not re.match(r"^\s*[0-9.]", value):
        wanted = _normal(value)
        names = {_normal(name): name for name in GPU_TARGETS}
        name = names.get(wanted) or _FAMILIES.get(wanted)
        if name is None:
            raise ValueError(f"target should be one of {', '.join(GPU_TARGETS)} or a size such "
                             f"as '24GiB', but got target={value!r}.")
        return name, GPU_TARGETS[name] - CUDA_CONTEXT_BYTES
    size = value
    if isinstance(value, str) and re.match(r"^\s*[0-9.]+\s*[kKmMgGtT]\s*$", value):
        size = value.strip() + "iB"  # "512M" is 512 MiB, as nvidia-smi and Slurm write it
    nbytes = parse_bytes(size, "target")
    return (value.strip() if isinstance(value, str) else f"{nbytes} bytes"), nbytes


def parse_gpus(value: int | str) -> tuple[int, int | str]:
    """``(count, gpu)`` of a target that names several GPUs (``"8xA100-80GB"``, ``"4 x H100"``,
    ``"2x24GiB"``); a target without a count is one GPU. The GPU is for ``parse_target``."""
    found = re.match(r"^\s*(\d+)\s*[x\u00d7*]\s*(\S.*)$", value) if isinstance(value, str) else None
    if found is None:
        return 1, value
    count, gpu = int(found.group(1)), found.group(2)
    if count < 1:
        raise ValueError(f"target should count at least one GPU, such as '8xA100-80GB', but got "
                         f"target={value!r}.")
    if not is_cpu_target(gpu):
        try:
            parse_target(gpu)
        except ValueError as error:  # said of the GPU's part: said again of the target as given
            raise ValueError(str(error).replace(f"target={gpu!r}", f"target={value!r}")) from None
    return count, gpu
