"""``accumulate``: gradient accumulation around an unchanged training loop.

- ``_accumulate.py``   accumulate(): its argument checks, steps from a batch size or "auto"
- ``_accumulator.py``  the context manager: the calls a block replaces (step, backward,
                       clipping) and for whom, micro-steps, real steps, DDP, the remainder
- ``_options.py``      AccumulateRequest: accumulate's options declared once as one frozen
  dataclass (its signature's defaults, %%accumulate's N and flags)
- ``_split.py``        split_batch: a global batch as per-device batch x steps x devices

It imports ``noise`` (a tracker fed from the micro-batches, the "auto" schedule) and the shared
modules.
"""

from ._accumulate import accumulate
from ._accumulator import Accumulator
from ._options import ACCUMULATE, AccumulateRequest
from ._split import split, split_batch

__all__ = ["ACCUMULATE", "AccumulateRequest", "Accumulator", "accumulate", "split", "split_batch"]
