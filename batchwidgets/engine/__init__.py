"""The measuring engine: pure PyTorch (never IPython, ipywidgets or matplotlib)."""

from ._batches import SyntheticBatches
from ._memory import BudgetExceededError, is_oom, parse_bytes, track_tensor_memory
from .noise import measure_noise
from .probe import NoBatchSizeFits, find_batch

__all__ = ["BudgetExceededError", "NoBatchSizeFits", "SyntheticBatches", "find_batch", "is_oom",
           "measure_noise", "parse_bytes", "track_tensor_memory"]
