"""batchwidgets: how large a batch fits, how noisy it is, and whether the input pipeline keeps up.

Usage:
    >>> import batchwidgets as bw          # cheap: torch and Jupyter load on first use
    >>> bw.find_batch                      # doctest: +ELLIPSIS
    <function find_batch at ...>
"""

import importlib

__version__ = "0.1.0"

# Every public name -> the module that defines it (or re-exports it), imported on first use.
_LAZY = {
    # find_batch: the largest batch that trains
    "find_batch": "batchwidgets.engine.probe",
    "forget": "batchwidgets.engine.probe",
    "NoBatchSizeFits": "batchwidgets.engine.probe",
    "BatchSizeReport": "batchwidgets.results",
    "Attempt": "batchwidgets.results",
    "plot_probe": "batchwidgets.plots",
    "ProbePanel": "batchwidgets.widgets",
    # accumulate: past the largest batch that fits
    "accumulate": "batchwidgets.engine.accumulate",
    "AccumulationReport": "batchwidgets.results",
    "plot_accumulate": "batchwidgets.plots",
    # measure_noise, NoiseTracker: how noisy the batches are
    "measure_noise": "batchwidgets.engine.noise",
    "NoiseReport": "batchwidgets.results",
    "plot_noise": "batchwidgets.plots",
    "NoiseTracker": "batchwidgets.engine.noise",
    "NoiseTrackerReport": "batchwidgets.results",
    "plot_noise_tracker": "batchwidgets.plots",
    "NoisePanel": "batchwidgets.widgets",
    # critical_batch: the critical batch measured from branched runs
    "critical_batch": "batchwidgets.engine.noise",
    "CriticalBatchReport": "batchwidgets.results",
    # tune_loader: is the input pipeline keeping up
    "tune_loader": "batchwidgets.engine.loader",
    "measure_loader": "batchwidgets.engine.loader",
    "make_loader": "batchwidgets.engine.loader",
    "data_stall": "batchwidgets.engine.loader",
    "LoaderReport": "batchwidgets.results",
    "LoaderTrial": "batchwidgets.results",
    "DataStallReport": "batchwidgets.results",
    "live_loader": "batchwidgets.engine.loader",
    "LiveLoader": "batchwidgets.engine.loader",
    "LiveLoaderReport": "batchwidgets.results",
    "LoaderSegment": "batchwidgets.results",
    "LoaderSwitch": "batchwidgets.results",
    "plot_live_loader": "batchwidgets.plots",
    "plot_loader": "batchwidgets.plots",
    "LoaderPanel": "batchwidgets.widgets",
    # track_tensor_memory: measure a step of your own
    "track_tensor_memory": "batchwidgets.engine.memory",
    # fit_trainer, split_batch: train at the global batch you meant
    "fit_trainer": "batchwidgets.integrations.transformers",
    "split_batch": "batchwidgets.engine.accumulate",
    "BatchSplitReport": "batchwidgets.results",
    "BatchwidgetsWarning": "batchwidgets._warnings",
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
