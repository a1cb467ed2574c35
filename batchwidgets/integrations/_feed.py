"""What both trainer callbacks share: a ``NoiseTracker`` fed from a trainer's own gradient
accumulation (two fused gradient norms per update, no host sync), its losses, the data-stall
share of each step, and the optional live ``NoisePanel``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine import grad_norms, group_by_device_and_dtype, loss_scale, sum_of_squares
from ..engine.noise import DeferredUpdate, NoiseTracker

# NOTE [ Feeding the tracker from a trainer's accumulation ]
# A trainer that accumulates k micro-batches scales each micro-batch's loss by about 1/k (the
# Hugging Face Trainer divides by the micro-batches of this update, or normalises by the items
# of all k; Lightning divides by accumulate_grad_batches), so after the first backward .grad is
# g_1 / k and before the optimizer step it is the update's mean gradient (times n/k in
# Lightning's shorter last update of an epoch). That is the two-batch-size estimator with one
# small batch (NOTE [ The prefix-sum estimator ]): |k .grad_1|^2 against |mean|^2, two fused
# _foreach_norm per update, kept on the device until the tracker is read. It assumes
# micro-batches of equal size (items, for a token-normalised loss); the first micro-batch's
# norm is read before the trainer's unscale, and divided by a GradScaler's scale if it has one.


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return getattr(shell, "kernel", None) is not None


class TrainerFeed:
    """Per-update bookkeeping of a trainer callback (see NOTE [ Feeding the tracker ... ])."""

    def __init__(self, tracker: NoiseTracker | None, panel: bool | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if tracker is not None and not isinstance(tracker, NoiseTracker):
            raise TypeError(f"tracker should be a batchwidgets.NoiseTracker, but got "
                            f"tracker={tracker!r}; e.g. NoiseCallback(bw.NoiseTracker()).")
        if panel is not None and not isinstance(panel, bool):
            raise TypeError(f"panel should be True, False or None (in a notebook only), but got "
                            f"panel={panel!r}.")
        self.tracker = tracker if tracker is not None else NoiseTracker()
        self.want_panel, self.panel, self.clock = panel, None, clock
        self.groups: list[list[torch.Tensor]] = []
        self.scaler: Any = None
        self.micro_batch_size: int | None = None
        self.n_micro = 0  # micro-batches of this update so far
        self._first: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._measuring = True
        self._update_start: float | None = None
        self._data_s = 0.0
        self._wait_from: float | None = None

    # ---- the trainer's life ------------------------------------------------------------------
    def start(self, parameters: Sequence[torch.Tensor], scaler: Any = None) -> None:
        self.groups = group_by_device_and_dtype([p for p in parameters if p.requires_grad])
        self.scaler = scaler
        self.tracker.sampler.start()
        self._update_start = self._wait_from = self.clock()
        if self.want_panel or (self.want_panel is None and _in_notebook()):
            self._show_panel()

    def _show_panel(self) -> None:
        # the widgets only where a panel is asked for: a script run of a trainer imports no
        # Jupyter (see G6 in STYLE.md)
        from IPython.display import display

        from ..widgets.noise import NoisePanel

        if self.panel is None:
            self.panel = NoisePanel(self.tracker)
            display(self.panel)

    def finish(self) -> None:
        self.tracker.flush()
        if self.panel is not None:
            self.panel.refresh()
            self.panel.detach()
            self.panel = None

    # ---- time waiting for data ---------------------------------------------------------------
    def data_ready(self) -> None:
        """A batch arrived: the time since the last micro-step ended was spent waiting."""
        now = self.clock()
        if self._wait_from is not None:
            self._data_s += now - self._wait_from
        self._wait_from = None

    def micro_step_done(self) -> None:
        self._wait_from = self.clock()

    # ---- gradients and losses ----------------------------------------------------------------
    def loss(self, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            self._losses.append(value.detach().float().reshape(()))

    def after_backward(self, micro_index: int) -> None:
        """After a micro-batch's backward: ``micro_index`` of this update (0 = the first)."""
        self.n_micro = micro_index + 1
        if micro_index == 0 and self._measuring:
            started = self.clock()
            with torch.no_grad():
                self._first = grad_norms(self.groups)
            self.tracker.sampler.charge(started)

    def before_optimizer_step(self, first_scale: float, mean_scale: float, *,
                              norms: list[torch.Tensor] | None = None,
                              big_is_scaled: bool = True) -> None:
        """The update's gradient is complete: g_1 = first_scale * .grad_1, the mean gradient
        = mean_scale * .grad before clipping (per-parameter ``norms`` of it, if the trainer has
        clipped .grad already; [] when they could not be taken). Hands the tracker this
        update's numbers."""
        started = self.clock()
        n, first, losses = self.n_micro, self._first, self._losses
        self._first, self._losses = [], []
        scalars, small = list(losses), None
        if self._measuring and n >= 2 and first:
            with torch.no_grad():
                norms = grad_norms(self.groups) if norms is None else norms
                if norms:
                    device = norms[0].device
                    big = sum_of_squares([t.to(device) for t in norms]) * mean_scale ** 2
                    one = sum_of_squares(first).to(device) * first_scale ** 2
                    scale = loss_scale(self.scaler, device)
                    if scale is not None:  # a GradScaler's: .grad_1 was read scaled
                        one = one / scale.square()
                        big = big / scale.square() if big_is_scaled else big
                    scalars += [one, big]
                    small = "squares"
        elif self._measuring is False:
            self.tracker.skip_update()
        if scalars:
            device = scalars[-1].device
            with torch.no_grad():
                values = torch.stack([t.to(device) for t in scalars])
            self.tracker.sampler.charge(started)
            self.tracker.defer(values, DeferredUpdate(
                n_values=len(scalars), n_losses=len(losses), small=small,
                micro_batch_size=self.micro_batch_size, n_micro=n))

    def update_done(self) -> None:
        """After the optimizer step: time the step, choose whether the next is measured."""
        now = self.clock()
        if self._update_start is not None:
            self.tracker.observe_step_time(now - self._update_start, self._data_s)
        self._update_start, self._data_s = now, 0.0
        self.n_micro = 0
        self._measuring = self.tracker.sampler.end_update()
        if self.panel is not None:  # nothing to read: flush returns at once
            self.tracker.flush()  # the panel redraws from the listeners (throttled)


def feeding(callback: Any, tracker: NoiseTracker | None, panel: bool | None) -> None:
    """What both trainers' ``NoiseCallback.__init__`` set up: ``callback._feed`` (a
    ``TrainerFeed``), ``callback.tracker`` and the micro-batch count ``callback._micro``."""
    callback._feed = TrainerFeed(tracker, panel)
    callback.tracker = callback._feed.tracker
    callback._micro = 0
