"""The Hugging Face ``Trainer``: ``fit_trainer`` sets its per-device batch and accumulation so
the global batch stays, and ``NoiseCallback`` follows the gradient noise scale, the losses and
the data-stall share of each step from the Trainer's own gradient accumulation.

Usage:
    >>> import batchwidgets as bw                                           # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=data)                  # doctest: +SKIP
    >>> bw.fit_trainer(trainer, global_batch_size=256, budget="8GiB")      # doctest: +SKIP
    >>> from batchwidgets.integrations.transformers import NoiseCallback   # doctest: +SKIP
    >>> callback = NoiseCallback()                                          # doctest: +SKIP
    >>> args = TrainingArguments("out", gradient_accumulation_steps=4)      # doctest: +SKIP
    >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()  # doctest: +SKIP
    >>> callback.tracker.report.schedule                                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..engine.noise import NoiseTracker
from ..engine.probe import find_batch
from ..results import BatchSplitReport
from ._feed import feeding
from ._fit import check_global, fit_options, split_report

try:
    from transformers import Trainer, TrainerCallback
except ImportError as error:  # an optional extra
    raise ImportError("batchwidgets.integrations.transformers needs transformers: pip install "
                      "transformers (or 'batchwidgets[test]')") from error

_HALF = (torch.float16, torch.bfloat16)


class NoiseCallback(TrainerCallback):
    """Follow the gradient noise scale of a ``transformers.Trainer`` run in a ``NoiseTracker``.

    With ``gradient_accumulation_steps=k >= 2``, each update gives one estimate from the
    Trainer's own micro-batches (see NOTE [ Feeding the tracker from a trainer's accumulation ]):
    the gradient after the first micro-batch, and the update's gradient before the Trainer clips
    it (read by a hook on each parameter during the last micro-batch's backward, when
    ``max_grad_norm > 0``). The per-micro-batch losses come from the model's ``.loss``, the
    data-stall share of each step from the time between two steps. The tracker samples updates
    to stay under its ``overhead_target``. Nothing of the training changes. A run stopped by
    Ctrl-C or an error calls no callback, so its hooks stay on the model until the next
    ``train()`` with this callback removes them first (they record in train mode only).

    ``NoiseCallback(tracker=None, *, panel=None)``: the ``NoiseTracker`` to feed (kept as
    ``callback.tracker``; a new one if None), and whether to show a live ``NoisePanel`` (None:
    when running in a notebook).

    Examples
    --------
    >>> callback = NoiseCallback(bw.NoiseTracker(max_batch_size=2048))   # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])  # doctest: +SKIP
    >>> trainer.train(); callback.tracker.report.advice                  # doctest: +SKIP
    """

    def __init__(self, tracker: NoiseTracker | None = None, *, panel: bool | None = None) -> None:
        feeding(self, tracker, panel)
        self._accumulation = 1
        self._clips = False
        self._model: torch.nn.Module | None = None
        self._loss_hook: Any = None
        self._last_hooks: list[Any] = []
        self._last_norms: list[torch.Tensor] = []

    # ---- the Trainer's events ----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        self._accumulation = max(int(args.gradient_accumulation_steps), 1)
        self._clips = bool(args.max_grad_norm and args.max_grad_norm > 0)
        self._feed.micro_batch_size = int(args.per_device_train_batch_size)
        self._drop_hooks()  # a run stopped by Ctrl-C or an error never reached on_train_end
        if model is not None:
            self._model = model
            self._loss_hook = model.register_forward_hook(self._record_loss, with_kwargs=True)
            self._feed.start(list(model.parameters()))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._feed.data_ready()  # the Trainer fetched this update's batches just before
        self._micro = 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._feed.after_backward(self._micro)
        self._micro += 1
        if self._micro == self._accumulation - 1 and self._clips and self._feed._measuring:
            self._hook_last_micro_batch()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._feed.n_micro = self._micro + 1  # the last micro-batch: nothing to read from .grad
        norms: list[torch.Tensor] | None = None
        if self._clips:  # .grad is clipped by now: the norms the hooks took before, or none
            norms, self._last_norms = self._last_norms, []
            self._unhook()
        # the Trainer divides each micro-batch's loss by their number (or normalises by the
        # items of all): .grad_1 ~ g_1 / n, and .grad is the mean
        self._feed.before_optimizer_step(first_scale=self._micro + 1, mean_scale=1.0,
                                         norms=norms)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._feed.update_done()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._drop_hooks()
        self._feed.finish()

    # ---- hooks -------------------------------------------------------------------------------
    def _record_loss(self, module: torch.nn.Module, args: Any, kwargs: dict,
                     output: Any) -> None:
        if not module.training:  # evaluation runs the same forward
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and kwargs.get("num_items_in_batch") is not None:
            # normalised by the items of the whole update: about 1/k of this micro-batch's
            # mean, which k times it gives back (the loss the Trainer logs, per micro-batch)
            loss = loss.detach() * self._accumulation
        self._feed.loss(loss)

    def _hook_last_micro_batch(self) -> None:
        """Per-parameter norms of .grad as the last backward completes it, before clipping."""
        def take(param: torch.Tensor) -> None:
            wide = torch.float32 if param.grad.dtype in _HALF else None
            self._last_norms.append(torch.linalg.vector_norm(param.grad.detach(), dtype=wide))

        self._last_norms = []
        self._last_hooks = [p.register_post_accumulate_grad_hook(take)
                            for group in self._feed.groups for p in group]

    def _drop_hooks(self) -> None:
        """Every hook this callback put on the model."""
        self._unhook()
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None

    def _unhook(self) -> None:
        for hook in self._last_hooks:
            hook.remove()
        self._last_hooks = []


# -- fit_trainer: the per-device batch that fits, the global batch kept ---------------------------

# NOTE [ The loop a Trainer runs ]
# fit_trainer probes the step ``Trainer.train()`` will run, not a generic one: the Trainer's own
# optimizer (``create_optimizer()``: its class, fused/foreach, weight-decay groups; the one
# passed to the Trainer where there is one), its mixed precision (``bf16``/``fp16`` as autocast),
# its activation checkpointing (switched on for the probe as ``train()`` switches it on, and off
# again), batches of its train dataset through its collator with the columns the model does not
# take removed (the largest sample, padded, NOTE [ The worst case of varying inputs ]), the loss
# from the model's ``.loss`` (or ``compute_loss_func``), and the model's output freed before
# backward (``keep_output=False``), as ``compute_loss`` returns the loss alone. A Trainer
# subclass with its own ``compute_loss`` is probed with the default one.


def fit_trainer(trainer: Trainer, global_batch_size: int | None = None,
                **find_batch_options: Any) -> BatchSplitReport:
    """Set a Hugging Face ``Trainer``'s per-device batch and accumulation before ``train()``:
    the per-device batch as large as fits, the global batch (and so the learning rate and
    schedule) as it was.

    Probes the loop the Trainer runs (NOTE [ The loop a Trainer runs ]) with ``find_batch``,
    which remembers its answer: a resumed run, or the same script again, gets the same
    per-device batch at once. Then ``per_device x steps x world_size == global_batch_size``
    with the per-device batch the largest divisor of ``global_batch_size / world_size`` up to
    the probe's ``recommended_batch_size`` (``split_batch``), written to
    ``args.per_device_train_batch_size`` and ``args.gradient_accumulation_steps``; the Trainer's
    train dataloader then yields batches of that size. Under ``torchrun`` every rank gets the
    same answer.

    Parameters
    ----------
    trainer : transformers.Trainer
        Built, not yet trained.
    global_batch_size : int, optional
        Examples per optimizer update over all devices. Default: the one the arguments give
        now (per-device batch x accumulation x world size).
    **find_batch_options
        ``find_batch``'s options (``budget="8GiB"``, ``headroom=0.8``, ``refresh=True``...);
        the model, data, optimizer, amp and loop are the Trainer's.

    Returns
    -------
    BatchSplitReport
        The split, and the probe's report (``.probe``, ``.remembered``).

    Raises
    ------
    TypeError
        Not a Trainer, or an option find_batch does not take (or the Trainer decides).
    ValueError
        No train dataset, DeepSpeed (its batch settings are not written yet), or a global
        batch the devices cannot share evenly.

    Examples
    --------
    >>> trainer = Trainer(model, TrainingArguments("out", per_device_train_batch_size=64),
    ...                   train_dataset=data)                     # doctest: +SKIP
    >>> bw.fit_trainer(trainer, budget="8GiB").summary()          # doctest: +SKIP
    'per_device_batch_size=32 x accumulation_steps=2 x 1 device = global_batch_size 64 ...'
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer should be a transformers.Trainer, but got "
                        f"{type(trainer).__name__}; for Lightning use "
                        f"batchwidgets.integrations.lightning.BatchSizeCallback.")
    check_global(global_batch_size)
    options = fit_options(find_batch_options, "fit_trainer")
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("trainer should not run DeepSpeed: fit_trainer does not write "
                         "DeepSpeed's batch settings yet; find_batch(..., parallel='zero2') "
                         "plans them, and split_batch splits the global batch.")
    if trainer.train_dataset is None:
        raise ValueError("trainer should have a train_dataset, but got train_dataset=None; "
                         "pass Trainer(..., train_dataset=...) first.")
    devices = args.world_size * max(1, args.n_gpu)  # ranks, and DataParallel's GPUs in each
    if global_batch_size is None:
        global_batch_size = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                             * devices)
    options.setdefault("amp", "bf16" if args.bf16 else "fp16" if args.fp16 else None)
    options.setdefault("loss_fn", trainer.compute_loss_func)
    options.setdefault("keep_output", False)  # compute_loss drops the output before backward
    with _checkpointing(trainer), _optimizer(trainer) as optimizer:
        options.setdefault("optimizer", optimizer)
        probe = find_batch(trainer.model, _batches(trainer), **options)
    report = split_report(probe, global_batch_size, devices, stacklevel=2)
    args.per_device_train_batch_size = report.per_device_batch_size
    args.gradient_accumulation_steps = report.accumulation_steps
    # __init__ copied the batch size, and get_train_dataloader reads the copy
    trainer._train_batch_size = args.train_batch_size
    return report


def _batches(trainer: Trainer) -> torch.utils.data.DataLoader:
    """The train dataset through the Trainer's collator, the model's unused columns removed,
    as its train dataloader builds its batches (find_batch takes the largest sample)."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    if hasattr(dataset, "column_names") and hasattr(trainer, "_remove_unused_columns"):
        dataset = trainer._remove_unused_columns(dataset, description="training")  # datasets
    elif hasattr(trainer, "_get_collator_with_removed_columns"):
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    return torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=collator)


@contextlib.contextmanager
def _optimizer(trainer: Trainer) -> Iterator[torch.optim.Optimizer]:
    """The optimizer train() will step: the Trainer's, or the one ``create_optimizer`` makes
    (made for the probe, and dropped: train() makes its own after wrapping the model)."""
    if trainer.optimizer is not None:
        yield trainer.optimizer
        return
    try:
        yield trainer.create_optimizer()
    finally:
        trainer.optimizer = None


@contextlib.contextmanager
def _checkpointing(trainer: Trainer) -> Iterator[None]:
    """Activation checkpointing on for the probe where train() switches it on, then off."""
    args, model = trainer.args, trainer.model
    wanted = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    if not wanted or getattr(model, "is_gradient_checkpointing", True):
        yield
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or args.gradient_checkpointing_kwargs or {})
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        off = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        off = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        off()
