"""The measuring engine: pure PyTorch (never IPython, ipywidgets or matplotlib), a room each.

Rooms (each folder's ``__init__.py`` says what it holds and exports):

- ``memory/``       how much a step holds: trace and peak model, CUDA allocator model, simulated
                    device, meters, budgets, OOM detection
- ``probe/``        find_batch, NoBatchSizeFits: the largest batch that trains
- ``accumulate/``   accumulate: gradient accumulation around an unchanged loop
- ``noise/``        measure_noise, NoiseTracker: how noisy the batches are, and the schedule
- ``loader/``       tune_loader, measure_loader, make_loader, data_stall: the input pipeline

Shared pieces beside them, which import none of the rooms:

- ``_util.py``       walking nested batches, the default device, world size, int checks
- ``_options.py``    option(), Option, Spelling: each public function's options declared once,
                    the fields of its request dataclass; the vocabulary (step, progress and data
                    names, Literal choices)
- ``_batches.py``    batches of any size from a callable, Dataset, DataLoader or tensor
- ``_called.py``     what was called of the user's code when it raised: one line first; and
                    batchwidgets' own steps, which an accumulate block lets through
- ``_state.py``      bit-exact snapshot and restore of model, optimizer, RNGs, flags, and of DDP's
                    reducer and FSDP2's units after a step stopped mid-way
- ``_background.py`` a panel's background probe: private RNG, a copy or a held model
- ``_grads.py``      fused gradient norms on the device; a GradScaler's scale
- ``_unsharded.py``  an FSDP2 model's replica with its full weights (per-example gradients)

What a room may import (tests/test_boundaries.py holds it): every room the shared pieces;
``probe`` also ``memory``; ``accumulate`` also ``noise``. Nothing else, and another room only
through its package (``from ..memory import replay``), never its private modules. So
``find_batch`` loads no module of noise, accumulate or loader. A new module adds its line to
its room's ``__init__.py``; its tests go in tests/engine/<room>/ (tests/engine/ for the shared
modules), named by the behaviour they hold.

The names below are the engine's public face beside its rooms: what the front ends (magics,
widgets, integrations) use of the shared modules. A front end imports these or a room's
package, never a private module (tests/test_boundaries.py holds it).
"""

from ._background import ModelHeldError, check_free, copied, held, private_rng, state_bytes
from ._batches import SyntheticBatches, as_batch_maker
from ._called import called_where
from ._grads import grad_norms, group_by_device_and_dtype, loss_scale, sum_of_squares
from ._options import (
    FLAGS,
    PYTHON,
    Option,
    Spelling,
    check_options,
    declared,
    options_of,
    positive_integer,
)
from ._util import to_device, usable_device

__all__ = ["FLAGS", "PYTHON", "ModelHeldError", "Option", "Spelling", "SyntheticBatches",
           "as_batch_maker", "called_where", "check_free", "check_options", "copied", "declared",
           "grad_norms", "group_by_device_and_dtype", "held", "loss_scale", "options_of",
           "positive_integer", "private_rng", "state_bytes", "sum_of_squares", "to_device",
           "usable_device"]
