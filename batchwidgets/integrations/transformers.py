"""``NoiseCallback`` for the Hugging Face ``Trainer``: the gradient noise scale, the losses and
the data-stall share of each step from the Trainer's own gradient accumulation.

Usage:
    >>> from batchwidgets.integrations.transformers import NoiseCallback   # doctest: +SKIP
    >>> callback = NoiseCallback()                                          # doctest: +SKIP
    >>> args = TrainingArguments("out", gradient_accumulation_steps=4)      # doctest: +SKIP
    >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()  # doctest: +SKIP
    >>> callback.tracker.report.schedule                                    # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.noise import NoiseTracker
from ._feed import feeding

try:
    from transformers import TrainerCallback
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
