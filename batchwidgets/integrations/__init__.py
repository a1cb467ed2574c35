"""Noise tracking inside the trainers people use: ``integrations.transformers.NoiseCallback``
(a Hugging Face ``TrainerCallback``) and ``integrations.lightning.NoiseCallback`` (a Lightning
``Callback``). Each module imports its trainer; this package imports nothing.

Usage:
    >>> from batchwidgets.integrations.transformers import NoiseCallback   # doctest: +SKIP
    >>> callback = NoiseCallback()                                          # doctest: +SKIP
    >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()  # doctest: +SKIP
    >>> callback.tracker.report.schedule                                    # doctest: +SKIP
"""
