"""What ``accumulate(noise=tracker)`` hands a ``NoiseTracker``: each update's losses and
gradient norms, kept on the device, sampled under the tracker's overhead target."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._grads import grad_norms
from .._util import world_size
from ._estimate import DeferredUpdate, first_sq_norm, grad_sq_norm
from ._tracker import NoiseTracker

# NOTE [ What the noise tracker costs accumulate ]
# Issue 5: at most 2% per training step. Two things used to cost more: a host sync per update
# (a .tolist() of the update's norms, which stalls a GPU's queue), and a gradient hook per
# parameter per micro-step (a Python call and a reduction each). Now each update's numbers are
# stacked into one small device tensor handed to the tracker, which reads all it holds in one
# .tolist() when they are needed (NoiseTracker.flush). And without hooks the tracker gets the
# squared norm of .grad after the first micro-step, which holds that micro-batch's gradient
# alone, besides |G_big|^2 (NOTE [ The prefix-sum estimator ]): one fused _foreach_norm per
# update, whatever the number of parameters and micro-steps. That estimate is noisier (2-10x the
# updates for one error bar), too noisy for a short run, so it is opt-in:
# NoiseTracker(every_micro_batch=False). By default, and with track_grad_norms=True (the
# report's per-micro-batch norms) and under DDP (whose micro-steps see only their rank's sums;
# with steps=1, none at all), the hooks take every micro-batch's norm, one reduction per
# parameter per micro-step, and the tracker uses all k of them.

# NOTE [ The noise of sharded gradients ]
# Under FSDP2 (``fully_shard``) a micro-step's gradients are reduce-scattered as it ends: .grad is
# each rank's shard of the gradient averaged over the ranks, and hooks on the sharded parameters
# never see a rank's own micro-batch gradient. So the tracker takes the hook-free estimate: after
# the first micro-step .grad holds the gradient of the first micro-batch of every rank (world size x
# b examples), after the last that of all k (k x world x b), and their norms are the full gradient's
# (NOTE [ Norms of sharded gradients ] in engine/_grads.py): the same two-size estimate as one
# process gets from micro-batches of world x b, which is its oracle in
# tests/engine/probe/test_distributed_fsdp.py. Every update is measured (no sampling): making the
# norms full is a collective, which every rank must call alike.


class AccumulatorFeed:
    """The accumulator's side of a tracker: it calls ``loss``, ``micro_norm``,
    ``first_micro_step``, ``before_clip``, ``update`` and ``drop`` at those points of an update,
    and asks ``hooks`` whether per-parameter gradient hooks should run now."""

    def __init__(self, tracker: NoiseTracker, *, track_grad_norms: bool, ddp: bool,
                 sharded: bool = False) -> None:
        self.tracker, self.ddp, self.sharded = tracker, ddp, sharded
        # NOTE [ Sampling updates to keep the tracker cheap ] (_schedule.py)
        sampled = not (track_grad_norms or ddp or sharded or tracker.overhead_target is None)
        self.sampler = tracker.sampler if sampled else None
        # see NOTE [ The noise of sharded gradients ]
        self.wants_every_norm = (tracker.every_micro_batch or ddp) and not sharded
        self.measuring = True  # whether this update feeds the tracker
        self._groups: list[list[torch.Tensor]] = []  # the parameters by device and dtype
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []  # each micro-batch's gradient norm (hooks)
        self._first: list[torch.Tensor] = []  # per-parameter norms of g_1 (no hooks)
        self._big_sq: torch.Tensor | None = None  # |G_big|^2, taken before a clip

    # ---- the accumulator's calls ---------------------------------------------------------------
    def start(self, groups: list[list[torch.Tensor]]) -> None:
        self._groups = groups
        if self.sampler is not None:
            self.sampler.start()

    def tick(self) -> float:
        return self.sampler.clock() if self.sampler is not None else 0.0

    def charge(self, started: float) -> None:
        if self.sampler is not None:
            self.sampler.charge(started)

    def loss(self, value: torch.Tensor) -> None:
        self._losses.append(value)

    def micro_norm(self, norm: torch.Tensor) -> None:
        self._norms.append(norm)

    def first_micro_step(self, hooked: bool) -> None:
        """.grad holds the first micro-batch's gradient: NOTE [ The prefix-sum estimator ]."""
        if self.measuring and not hooked:
            started = self.tick()
            with torch.no_grad():
                self._first = grad_norms(self._groups)
            self.charge(started)

    def before_clip(self, params: Sequence[torch.Tensor], scaler: Any, optimizer: Any) -> None:
        """The averaged gradient before clipping changes it: |G_big|^2."""
        if self.measuring and self._big_sq is None:
            started = self.tick()
            self._big_sq = grad_sq_norm(params, scaler, optimizer, self._groups)
            self.charge(started)

    def update(self, params: Sequence[torch.Tensor], scaler: Any, optimizer: Any, *,
               hooked: bool, n_pending: int, micro_batch_size: int | None) -> None:
        """Hand the tracker this update's losses and squared norms as one device tensor: no
        host sync (see NOTE [ What the noise tracker costs accumulate ])."""
        started = self.tick()  # the listeners (a panel's drawing) are not the tracker's cost
        if not self.measuring:  # sampling left this update out: its losses only
            self._big_sq, self._norms, self._first = None, [], []
            self.drop()
            self.tracker.skip_update()
            return
        big = (self._big_sq if self._big_sq is not None
               else grad_sq_norm(params, scaler, optimizer, self._groups))
        losses, norms, first = self._losses, self._norms, self._first
        self._losses, self._norms, self._first, self._big_sq = [], [], [], None
        if self.sharded and micro_batch_size:  # see NOTE [ The noise of sharded gradients ]
            micro_batch_size *= world_size()
        if hooked:
            norms = self._gathered(norms)
            small, kind, n_micro = norms, "norms", len(norms)
        else:  # g_1 alone, unless the update had one micro-step (a remainder): then it is big
            square = first_sq_norm(first, scaler) if n_pending > 1 else None
            small, kind, n_micro = [square] if square is not None else [], "squares", n_pending
        if big is None or (hooked and not small):  # no gradients: the losses only
            small, kind = [], None
        scalars = [*losses, *small] + ([big] if kind is not None else [])
        if not scalars:
            return
        device = scalars[-1].device
        with torch.no_grad():
            values = torch.stack([t if t.device == device else t.to(device) for t in scalars])
        self.charge(started)
        self.tracker.defer(values, DeferredUpdate(
            n_values=len(scalars), n_losses=len(losses), small=kind,
            micro_batch_size=micro_batch_size, n_micro=n_micro))

    def _gathered(self, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        # under DDP the micro norms are each rank's own, and the big gradient is averaged over
        # the ranks too, so B_big is k times the world size times b. Every rank gets every
        # rank's micro norms (one all_gather of k scalars per update, no host sync): all report
        # the same estimate, pooled over world*k micro-batches
        world = world_size() if self.ddp else 1
        if world <= 1 or not norms:
            return norms
        with torch.no_grad():
            local = torch.stack(norms)
            gathered = [torch.empty_like(local) for _ in range(world)]
            torch.distributed.all_gather(gathered, local)
        return list(torch.cat(gathered).unbind())

    def drop(self) -> None:
        """The update's gradients are discarded (a dropped remainder): its losses only."""
        if self._losses:
            n_losses = len(self._losses)
            self.tracker.defer(torch.stack(self._losses), DeferredUpdate(
                n_values=n_losses, n_losses=n_losses, small=None, micro_batch_size=None,
                n_micro=0))
            self._losses = []

    def end_update(self) -> bool:
        """Whether the next update is measured (sampling); the hooks follow it."""
        if self.sampler is not None:
            self.measuring = self.sampler.end_update()
        return self.measuring

    def flush(self) -> None:
        self.tracker.flush()  # the last updates, to the listeners (a live panel) too

    @property
    def advice(self) -> str:
        return self.tracker.report.accumulation_advice
