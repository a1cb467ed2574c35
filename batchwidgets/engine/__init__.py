"""The measuring engine: pure PyTorch (never IPython, ipywidgets or matplotlib), one module each.

Public (each returns a report from ``batchwidgets.results``):

- ``probe.py``           find_batch, NoBatchSizeFits     the largest batch that trains
- ``accumulate.py``      accumulate                      gradient accumulation around a loop
- ``noise.py``           measure_noise                   gradient noise from per-example grads
- ``noise_tracker.py``   NoiseTracker                    noise and losses during training
- ``loader.py``          tune_loader, measure_loader,    DataLoader settings, measured;
                         make_loader, data_stall         how long a step waits on data

Private, in the order a newcomer meets them:

- ``_util.py``           walking nested batches, the default device, world size, int checks
- ``_types.py``          the vocabulary: step, progress and data names, Literal choices
- ``_batches.py``        batches of any size from a callable, Dataset, DataLoader or tensor
- ``_search.py``         the probe's pure search policy: which batch size next
- ``_meters.py``         memory backends: CUDA allocator peaks and cap, CPU/MPS tensor bytes
- ``_probe_checks.py``   find_batch's argument checks; what the report says was probed
- ``_trials.py``         the probe's trials and search loop, the memory split, target= plans
- ``_trace.py``          the per-op memory trace of a step, the peak model fitted on two
- ``_what_if.py``        the largest batch under a change: predicted from the trace, or measured
- ``_cuda_model.py``     a model of PyTorch's CUDA caching allocator; replay of a step's trace
- ``_cuda_sim.py``       a simulated CUDA device over CPU tensors; GPU targets (target="T4")
- ``_memory.py``         OOM detection, budget parsing, the tensor-memory tracker
- ``_state.py``          bit-exact snapshot and restore of model, optimizer, RNGs, flags
- ``_background.py``     a panel's background probe: private RNG, a copy or a held model
- ``_accumulator.py``    accumulate's context manager: micro-steps, real steps, DDP, remainder
- ``_accumulate_calls.py`` the calls a block replaces (step, backward, clipping), and for whom
- ``_noise_feed.py``     what accumulate hands a NoiseTracker each update, on the device
- ``_noise_estimate.py`` the NoiseTracker's estimators and their error bars
- ``_noise_moments.py``  measure_noise's running sums and the jackknife of its error bars
- ``_schedule.py``       the batch-size schedule from the noise scale; sampling the tracker
- ``_loader_search.py``  tune_loader's pure search policy: which setting next
- ``_loader_timing.py``  timing one DataLoader; workers always shut down
- ``_loader_checks.py``  argument checks, unpicklable datasets, warnings with numbers

A new engine module adds its line here. Its tests go in tests/test_<public module it serves>.py
(test_probe.py, test_loader.py, ...); the pure search policies have their own (test_search.py).
"""

from ._batches import SyntheticBatches
from ._memory import BudgetExceededError, is_oom, parse_bytes, track_tensor_memory
from .noise import measure_noise
from .probe import NoBatchSizeFits, find_batch

__all__ = ["BudgetExceededError", "NoBatchSizeFits", "SyntheticBatches", "find_batch", "is_oom",
           "measure_noise", "parse_bytes", "track_tensor_memory"]
