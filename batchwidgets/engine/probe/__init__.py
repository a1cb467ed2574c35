"""``find_batch``: the largest batch that trains, as stages that ``_find_batch.py`` calls in turn.

request (``_options.py``: FindBatchRequest; ``_checks.py``) -> ``_resolve.py``: a ProbeSetup ->
``_probe.py``: Probe, its trials (``_trials.py``, ``_fake.py``, ``_cell.py``, ``_sharded.py`` on
``_fakes.py``; ``_stop.py``, ``_optimizer_shapes.py``) searched by the policy (``_search.py``,
``_after_miss.py``) -> Traced (``_setup.py``: the data the stages hand on; ``_timeline.py``) ->
``_plan.py`` for a target (``_parallel.py``: each rank of N), the answer verified on this device
otherwise -> the what-ifs (``_what_if.py``: each change tried again by the orchestrator) ->
BatchSizeReport. Around it: ``_remember.py``
(``_fingerprint.py``, ``_cache.py``); beside it: ``_ranks.py`` (one outcome for every rank),
``_nothing_fits.py`` (NoBatchSizeFits). The pipeline, who owns what and where a new option or
target goes: docs/development.md. It imports ``memory`` and the shared modules; nothing of
accumulate, noise or loader."""

from ._cell import CellStep, names_in
from ._checks import check_arguments, check_request
from ._find_batch import MakeBatch, find_batch
from ._nothing_fits import NoBatchSizeFits
from ._options import OPTIONS, FindBatchRequest
from ._remember import ENGINE_VERSION, forget

__all__ = ["ENGINE_VERSION", "OPTIONS", "CellStep", "FindBatchRequest", "MakeBatch",
           "NoBatchSizeFits", "check_arguments", "check_request", "find_batch", "forget",
           "names_in"]
