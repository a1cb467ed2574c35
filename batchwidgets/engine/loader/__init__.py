"""Is the input pipeline keeping up: DataLoader settings measured and tuned, and how long a
training step waits on data.

- ``_tune.py``    make_loader, measure_loader, tune_loader, data_stall; reports that make loaders
- ``_search.py``  tune_loader's pure search policy: which setting next
- ``_timing.py``  timing one DataLoader; workers always shut down
- ``_checks.py``  argument checks, unpicklable datasets, warnings with numbers
- ``_live.py``    live_loader: the running loop's loader, switched at its next batch without
                  losing the order, measured; its epochs, whose workers stop when abandoned;
                  the settings it starts with and switches to, checked
- ``_autotune.py`` live_loader(autotune=True)'s policy: which setting to try next, from the stall

It imports the shared modules only.
"""

from .._options import TrainStep
from ._checks import usable_cpus
from ._live import SWITCHABLE, LiveLoader, live_loader
from ._timing import one_line
from ._tune import (
    DEFAULT_BATCH_SIZE,
    data_stall,
    loader_report,
    make_loader,
    measure_loader,
    tune_loader,
    with_data,
)

__all__ = ["DEFAULT_BATCH_SIZE", "SWITCHABLE", "LiveLoader", "TrainStep", "data_stall",
           "live_loader", "loader_report", "make_loader", "measure_loader", "one_line",
           "tune_loader", "usable_cpus", "with_data"]
