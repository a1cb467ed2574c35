"""How much a training step holds, and when it is out of memory: the room under the probe.

- ``_budget.py``     sizes as people write them ("16GiB", "512M"); host memory left to take
- ``_oom.py``        which errors are out of memory; what an error's traceback keeps alive
- ``_tracker.py``    the tensor-memory tracker: live bytes op by op, a budget as a device limit
- ``_trace.py``      the per-op trace of a step, and the peak model fitted on two of them
- ``_allocator.py``  a model of PyTorch's CUDA caching allocator; replaying a trace through it
- ``_simulated.py``  a simulated CUDA device over CPU tensors, with a target's workspaces
- ``_workspaces.py`` cuBLAS's, cuBLASLt's and cuDNN's workspaces, and a target's
- ``_targets.py``    the GPUs a plan may target (one, or a count: "8xA100-80GB"), and their
                     memory less the CUDA context
- ``_kernels.py``    what a CUDA target's kernels keep where the CPU's keep more: dropout,
                     attention, the foreach optimizer step
- ``_meters.py``     the probe's meters: CUDA's allocator, or the tracker on the CPU and MPS
- ``_snapshot.py``   a traced step as PyTorch's memory snapshot records it (report.save_snapshot)

It imports the shared modules beside it and nothing of the capabilities.
"""

from ._allocator import (
    STEADY_STEPS,
    event_bytes,
    largest_batch_size,
    needed_bytes,
    replay,
    scale_events,
)
from ._budget import available_memory_bytes, parse_bytes
from ._meters import Reading
from ._oom import cannot_train_alone, drop_own_frames, forget, free_memory, is_oom
from ._simulated import probe_meter, seed_meter, simulated_cuda
from ._snapshot import step_snapshot
from ._targets import CPU_TARGET, GPU_TARGETS, is_cpu_target, parse_gpus, parse_target
from ._trace import OpTrace, PeakModel, said_where
from ._tracker import BudgetExceededError, TensorMemoryTracker, track_tensor_memory

__all__ = [
    "CPU_TARGET", "GPU_TARGETS", "STEADY_STEPS", "BudgetExceededError", "OpTrace", "PeakModel",
    "Reading", "TensorMemoryTracker", "available_memory_bytes", "cannot_train_alone",
    "drop_own_frames", "event_bytes", "forget", "free_memory", "is_cpu_target", "is_oom",
    "largest_batch_size", "needed_bytes", "parse_bytes", "parse_gpus", "parse_target",
    "probe_meter", "replay", "said_where", "scale_events", "seed_meter", "simulated_cuda",
    "step_snapshot", "track_tensor_memory",
]
