"""How noisy the batches are: ``measure_noise`` from per-example gradients, ``NoiseTracker``
during training, and the batch-size schedule they suggest.

- ``_measure.py``   measure_noise: per-example gradients (vmap or a loop), the report
- ``_moments.py``   measure_noise's running sums and the jackknife of its error bars
- ``_tracker.py``   NoiseTracker: losses and the noise scale online, cheaply
- ``_estimate.py``  the tracker's estimators and their error bars; loaders that bias them
- ``_feed.py``      what an accumulate block hands a tracker each update, on the device
- ``_schedule.py``  the batch-size schedule from the noise scale; sampling the tracker
- ``_critical.py``  critical_batch: the critical batch measured from branched runs
- ``_options.py``   CriticalBatchRequest: critical_batch's options declared once as one
  frozen dataclass (its signature's defaults, %critical_batch's flags)

It imports the shared modules only. ``AccumulatorFeed`` and ``AutoSteps`` are what accumulate
uses of it, ``DeferredUpdate`` what the trainer callbacks use.
"""

from ._critical import critical_batch
from ._estimate import DeferredUpdate
from ._feed import AccumulatorFeed
from ._measure import measure_noise
from ._options import CRITICAL_BATCH, CriticalBatchRequest
from ._schedule import AutoSteps
from ._tracker import NoiseTracker

__all__ = ["CRITICAL_BATCH", "AccumulatorFeed", "AutoSteps", "CriticalBatchRequest",
           "DeferredUpdate", "NoiseTracker", "critical_batch", "measure_noise"]
