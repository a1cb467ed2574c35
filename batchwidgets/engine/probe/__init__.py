"""``find_batch``: the largest batch that trains, as stages read top to bottom.

- ``_find_batch.py``  find_batch: set up, then one of the two engines (or each length's)
- ``_measure.py``     engine 1, measuring on this device: real steps searched, the what-ifs
- ``_plan.py``        engine 2, planning for a target: traces replayed under its memory, for one
  GPU or each rank of N, the what-ifs planned
- ``_core.py``        the traced core both stand on: the search run under the meter and the
  state guard (real or fake trials), and the report of what it found
- ``_options.py``     FindBatchRequest: find_batch's options as one frozen dataclass, each field's
  default, check, help, flag and cache-key membership; OPTIONS, its defaults
- ``_nothing_fits.py`` NoBatchSizeFits: not even the smallest batch trains, and what would help
- ``_setup.py``       the arguments resolved once into a frozen ProbeSetup
- ``_checks.py``      the argument checks (one line each), what the report says was probed
- ``_trials.py``      the step each size runs (the common loop's), one size's steps measured
- ``_cell.py``        a notebook cell as the step (%%find_batch), and its fake trials
- ``_fake.py``        fake trials: the step on fake tensors, for a plan (meta models too)
- ``_fake_group.py``  the one adapter over PyTorch's fake process group, and fully_shard
- ``_sharded.py``     one FSDP2 rank traced: a meta copy under fully_shard on a fake mesh
- ``_loop.py``        the search loop: run, fit the per-op model, ask the policy
- ``_timeline.py``    one traced step's memory: split by part at the peak, by kind over its ops
- ``_stop.py``        should_stop polled between ops: a Stop in the middle of a step
- ``_optimizer_shapes.py``  optimizer state by shape: a tiny copy's real step, when fakes cannot
- ``_search.py``      the pure search policy: which batch size next
- ``_after_miss.py``  which size next after an OOM the model did not predict (pure)
- ``_parallel.py``    plans for N GPUs: each rank's share and buffers under DDP, ZeRO, FSDP2
- ``_ranks.py``       one outcome for every rank under torch.distributed, errors included
- ``_remember.py``    remembered answers: the key of what decides memory, kept and given back;
  forget(); the key's JSON values in ``_fingerprint.py``, its files in ``_cache.py``
- ``_what_if.py``     the largest batch under a change, predicted from the trace or measured;
  a target plan's rows, each planned again (on a meta model too)

It imports ``memory`` and the shared modules; nothing of accumulate, noise or loader.
"""

from ._cell import CellStep, names_in
from ._checks import check_arguments, check_request
from ._find_batch import MakeBatch, find_batch
from ._nothing_fits import NoBatchSizeFits
from ._options import OPTIONS, FindBatchRequest
from ._remember import ENGINE_VERSION, forget

__all__ = ["ENGINE_VERSION", "OPTIONS", "CellStep", "FindBatchRequest", "MakeBatch",
           "NoBatchSizeFits", "check_arguments", "check_request", "find_batch", "forget",
           "names_in"]
