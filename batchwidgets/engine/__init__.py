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
- ``_types.py``      the vocabulary: step, progress and data names, Literal choices
- ``_options.py``    Option, Options, Spelling: each public function's options declared once
- ``_batches.py``    batches of any size from a callable, Dataset, DataLoader or tensor
- ``_called.py``     what was called of the user's code when it raised: one line first
- ``_state.py``      bit-exact snapshot and restore of model, optimizer, RNGs, flags
- ``_background.py`` a panel's background probe: private RNG, a copy or a held model
- ``_own_steps.py``  batchwidgets' own steps, which an accumulate block lets through
- ``_grads.py``      fused gradient norms on the device; a GradScaler's scale
- ``_unsharded.py``  an FSDP2 model's replica with its full weights (per-example gradients)
- ``_fingerprint.py`` what decides a step's memory (model, optimizer, batch, code) as JSON values
- ``_cache.py``      the cache directory: JSON files written atomically, read back or refused

And ``noise_tracker.py``: NoiseTracker's documented import path.

What a room may import (tests/test_boundaries.py holds it): every room the shared pieces;
``probe`` also ``memory``; ``accumulate`` also ``noise``. Nothing else, and another room only
through its package (``from ..memory import replay``), never its private modules. So
``find_batch`` loads no module of noise, accumulate or loader. A new module adds its line to
its room's ``__init__.py``; its tests go in tests/test_<public module it serves>.py.
"""
