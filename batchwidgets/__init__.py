"""batchwidgets: how large a batch fits, how noisy it is, and whether the input pipeline keeps up.

Usage:
    >>> import batchwidgets as bw          # cheap: torch and Jupyter load on first use
    >>> bw.find_batch                      # doctest: +ELLIPSIS
    <function find_batch at ...>
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "find_batch": "batchwidgets.engine.probe",
    "NoBatchSizeFits": "batchwidgets.engine.probe",
    "BudgetExceededError": "batchwidgets.engine._memory",
    "track_tensor_memory": "batchwidgets.engine._memory",
    "SyntheticBatches": "batchwidgets.engine._batches",
    "accumulate": "batchwidgets.engine.accumulate",
    "measure_noise": "batchwidgets.engine.noise",
    "NoiseReport": "batchwidgets.results",
    "NoiseTracker": "batchwidgets.engine.noise_tracker",
    "NoiseTrackerReport": "batchwidgets.results",
    "AccumulationReport": "batchwidgets.results",
    "BatchwidgetsWarning": "batchwidgets._warnings",
    "Attempt": "batchwidgets.results",
    "BatchSizeReport": "batchwidgets.results",
    "MemoryModel": "batchwidgets.results",
    "plot_probe": "batchwidgets.plots",
    "ProbePanel": "batchwidgets.widgets",
    "NoisePanel": "batchwidgets.widgets",
    "tune_loader": "batchwidgets.engine.loader",
    "measure_loader": "batchwidgets.engine.loader",
    "data_stall": "batchwidgets.engine.loader",
    "LoaderReport": "batchwidgets.results",
    "LoaderTrial": "batchwidgets.results",
    "DataStallReport": "batchwidgets.results",
    "LoaderPanel": "batchwidgets.widgets",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'batchwidgets' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__():
    return sorted([*globals(), *_LAZY])


def load_ipython_extension(ipython):
    """``%load_ext batchwidgets``: register ``%find_batch`` (IPython is imported only now)."""
    from . import magics
    magics.load(ipython)


def unload_ipython_extension(ipython):
    from . import magics
    magics.unload(ipython)
