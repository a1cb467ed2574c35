"""``measure_noise``: the gradient noise scale and mini-batch variances, from exact per-example
gradients (``torch.func.vmap(grad)``, or one backward pass per example where vmap cannot run).

Usage:
    >>> import torch, batchwidgets as bw
    >>> data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    >>> report = bw.measure_noise(torch.nn.Linear(4, 1), data, torch.nn.functional.mse_loss,
    ...                           batch_sizes=(1, 8))
    >>> sorted(report.grad_variance) == [1, 8] and report.method
    'vmap'
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.func import functional_call, grad_and_value, vmap
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from .._warnings import BatchwidgetsWarning
from ..results import LayerNoise, NoiseReport
from ._batches import to_device
from ._state import TrainingState
from .noise_tracker import unshuffled_loader_warning

LossFn = Callable[[Any, Any], torch.Tensor]
_METHODS = ("auto", "vmap", "loop")


def _check_arguments(model: Any, data: Any, loss_fn: Any, batch_sizes: Any, max_examples: Any,
                     chunk_size: Any, method: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got model={model!r}.")
    if not isinstance(data, (Dataset, DataLoader)):
        raise TypeError(f"data should be a torch Dataset or DataLoader of (input, target) pairs, "
                        f"but got data={type(data).__name__}; wrap tensors as "
                        f"torch.utils.data.TensorDataset(x, y).")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn should be a callable loss_fn(output, target) -> scalar, but got "
                        f"loss_fn={loss_fn!r}; e.g. loss_fn=torch.nn.functional.cross_entropy.")
    if (isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable)
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in batch_sizes)):
        raise TypeError(f"batch_sizes should be a sequence of ints, but got "
                        f"batch_sizes={batch_sizes!r}; e.g. batch_sizes=(1, 8, 64).")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes should be one or more ints >= 1, but got "
                         f"batch_sizes={batch_sizes!r}; e.g. batch_sizes=(1, 8, 64).")
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 2:
        raise ValueError(f"max_examples should be an int >= 2, but got "
                         f"max_examples={max_examples!r}; e.g. max_examples=1024.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size should be an int >= 1, but got chunk_size={chunk_size!r}; "
                         f"e.g. chunk_size=64.")
    if method not in _METHODS:
        raise ValueError(f"method should be one of {list(_METHODS)}, but got method={method!r}.")


def _examples(data: Dataset | DataLoader, max_examples: int) -> tuple[list, int | None]:
    """Up to ``max_examples`` items: evenly spaced over a map-style dataset, else the first ones.
    Also returns the data's size (None for an iterable dataset longer than the sample)."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        items = list(itertools.islice(iter(dataset), max_examples + 1))
        if len(items) <= max_examples:
            return items, len(items)
        return items[:max_examples], None
    size = len(dataset)
    count = min(size, max_examples)
    return [dataset[i * size // count] for i in range(count)], size


def _pair(item: Any) -> tuple[Any, Any]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        shape = f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""
        raise TypeError(f"data should yield (input, target) pairs, but an item is "
                        f"{type(item).__name__}{shape}; map it to (input, target) first.")
    return item[0], item[1]


def _vmap_chunk(model: torch.nn.Module, params: dict[str, torch.Tensor], loss_fn: LossFn,
                inputs: Any, targets: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-example gradients and losses of one chunk: ``loss_fn`` sees one-example batches."""
    buffers = dict(model.named_buffers())

    def loss_one(weights: dict[str, torch.Tensor], x: Any, y: Any) -> torch.Tensor:
        x1, y1 = _unsqueeze(x), _unsqueeze(y)
        return loss_fn(functional_call(model, (weights, buffers), (x1,)), y1)

    # randomness="different": dropout draws its own mask per example, as it would in a loop.
    per_example = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0), randomness="different")
    grads, losses = per_example(params, inputs, targets)
    return grads, losses


def _loop_chunk(model: torch.nn.Module, params: dict[str, torch.Tensor], loss_fn: LossFn,
                inputs: Any, targets: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same as ``_vmap_chunk`` with one autograd pass per example (any module works)."""
    # The module's own parameters (``params`` holds detached aliases for functional_call).
    live = dict(model.named_parameters())
    names, tensors = list(params), [live[n] for n in params]
    grads: list[list[torch.Tensor]] = [[] for _ in names]
    losses = []
    for i in range(_length(inputs)):
        loss = loss_fn(model(_unsqueeze(_index(inputs, i))), _unsqueeze(_index(targets, i)))
        parts = torch.autograd.grad(loss, tensors, allow_unused=True)
        for slot, part, tensor in zip(grads, parts, tensors):
            slot.append(torch.zeros_like(tensor) if part is None else part)
        losses.append(loss.detach())
    return {n: torch.stack(g) for n, g in zip(names, grads)}, torch.stack(losses)


def _unsqueeze(value: Any) -> Any:
    return value.unsqueeze(0) if isinstance(value, torch.Tensor) else value


def _index(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, torch.Tensor) else value


def _length(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"data inputs should collate to tensors, but got {type(value).__name__}; "
                        f"map each item to (input tensor, target).")
    return value.shape[0]


# NOTE [ Why the float64 sums are shifted ]
# tr(cov) = (1/N) sum |g_i|^2 - |G|^2 cancels badly when the noise is small next to |G|^2. We
# accumulate d_i = g_i - s for a shift s near G (the first chunk's mean gradient), so that
# tr(cov) = (1/N) sum |d_i|^2 - |mean d|^2, exact for any s and well conditioned when s ~ G
# (the "shifted data" algorithm; Chan, Golub & LeVeque 1983). Memory: one float64 copy of the
# parameters for the shift and one for sum d_i, plus one chunk of per-example gradients.
class _Moments:
    """Running per-parameter sums of shifted per-example gradients, in float64 (see NOTE
    [ Why the float64 sums are shifted ])."""

    def __init__(self) -> None:
        self.count = 0
        self.shift: dict[str, torch.Tensor] = {}
        self.sum: dict[str, torch.Tensor] = {}
        self.sum_sq: dict[str, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []

    def add(self, grads: dict[str, torch.Tensor], losses: torch.Tensor) -> None:
        if not self.shift:
            self.shift = {n: g.double().mean(0) for n, g in grads.items()}
            self.sum = {n: torch.zeros_like(s) for n, s in self.shift.items()}
            self.sum_sq = {n: s.new_zeros(()) for n, s in self.shift.items()}
        for name, g in grads.items():
            d = g.double() - self.shift[name]
            self.sum[name] += d.sum(0)
            self.sum_sq[name] += d.square().sum()
        self.count += losses.shape[0]
        self.losses.append(losses.detach().double().reshape(-1).cpu())

    def layers(self) -> tuple[LayerNoise, ...]:
        n, result = self.count, []
        for name, total in self.sum.items():
            mean_d = total / n
            trace_cov = max((self.sum_sq[name] / n - mean_d.square().sum()).item(), 0.0)
            grad_norm_sq = (self.shift[name] + mean_d).square().sum().item()
            result.append(LayerNoise(name, trace_cov, grad_norm_sq))
        return tuple(result)


def _batchnorm_in_training(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


def measure_noise(model: torch.nn.Module, data: Dataset | DataLoader, loss_fn: LossFn,
                  batch_sizes: Sequence[int] = (1, 2, 4, 8), *, replacement: bool = False,
                  max_examples: int = 1024, chunk_size: int = 64,
                  method: str = "auto") -> NoiseReport:
    """Measure gradient noise from exact per-example gradients.

    For N examples with per-example gradients g_i (of ``loss_fn`` on a one-example batch) and
    mean gradient G: ``trace_cov`` = (1/N) sum_i |g_i - G|^2, ``grad_norm_sq`` = |G|^2,
    ``b_simple`` = trace_cov / grad_norm_sq (McCandlish et al. 2018), and for each batch size B
    the variance (trace) of the mini-batch mean gradient: trace_cov / B with replacement, times
    (N - B) / (N - 1) without. The same for the loss, and a per-parameter breakdown. The model's
    weights, gradients, buffers, train/eval modes and the RNGs are restored afterwards.

    Parameters
    ----------
    model : torch.nn.Module
        Measured in its current train/eval mode, except BatchNorm layers in train mode: a
        one-example batch has no batch statistics, so they use their running statistics
        (with a ``BatchwidgetsWarning``).
    data : Dataset or DataLoader
        Items ``(input, target)``; a DataLoader's dataset is read item by item. Inputs are moved
        to the model's device. A DataLoader's ``batch_size`` is the one the advice is given at;
        one that does not shuffle gives a ``BatchwidgetsWarning`` (its batches are not the
        random ones these numbers describe), kept in ``report.warnings``.
    loss_fn : callable
        ``loss_fn(output, target) -> scalar``, called on one-example batches (``output`` and
        ``target`` keep a leading dimension of 1), so a mean reduction gives the example's loss.
    batch_sizes : sequence of int
        The sizes B for ``grad_variance[B]`` and ``loss_variance_per_batch[B]``.
    replacement : bool
        Which sampling ``grad_variance`` assumes: False (default) as a shuffling DataLoader
        draws an epoch, True for independent draws. The report holds both variants.
    max_examples : int
        Larger data is measured on ``max_examples`` evenly spaced items (the first ones of an
        iterable dataset); the report says so in ``sampled``.
    chunk_size : int
        Examples per vmap call; memory is about ``chunk_size`` copies of the gradient.
    method : {"auto", "vmap", "loop"}
        "auto" tries ``torch.func.vmap`` and falls back to one backward pass per example for
        modules vmap cannot handle (in-place updates, data-dependent control flow).

    Returns
    -------
    NoiseReport

    Raises
    ------
    TypeError, ValueError
        For bad arguments, naming the argument and a fix.

    Examples
    --------
    >>> import torch, batchwidgets as bw
    >>> data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    >>> report = bw.measure_noise(torch.nn.Linear(3, 2), data, torch.nn.functional.cross_entropy)
    >>> report.n_examples, report.replacement
    (8, False)
    """
    _check_arguments(model, data, loss_fn, batch_sizes, max_examples, chunk_size, method)
    batch_sizes = tuple(batch_sizes)
    items, n_available = _examples(data, max_examples)
    if len(items) < 2:
        raise ValueError(f"data should hold at least 2 examples, but got {len(items)}; a variance "
                         f"needs two.")
    if not replacement and max(batch_sizes) > len(items):
        raise ValueError(f"batch_sizes should be <= the {len(items)} examples measured without "
                         f"replacement, but got batch_sizes={batch_sizes!r}; pass "
                         f"replacement=True, more data or a larger max_examples.")
    unshuffled = unshuffled_loader_warning(data)
    if unshuffled:
        unshuffled += (": measure_noise draws the examples itself, so its numbers hold for "
                       "random batches, not for the ones this loader gives")
        warnings.warn(f"{unshuffled}.", BatchwidgetsWarning, stacklevel=2)
    batchnorm = _batchnorm_in_training(model)
    if batchnorm:
        warnings.warn(f"{len(batchnorm)} BatchNorm layer(s) are in train mode; per-example "
                      f"gradients have no batch statistics, so measure_noise uses their running "
                      f"statistics (eval mode) for them. Call model.eval() first to silence this.",
                      BatchwidgetsWarning, stacklevel=2)
    state = TrainingState(model)
    try:
        with torch.enable_grad():
            for module in batchnorm:
                module.eval()
            moments, used = _accumulate(model, items, loss_fn, chunk_size, method)
    finally:
        state.restore()
    report = _report(moments, n_available, batch_sizes, replacement, used, bool(batchnorm))
    loader_batch = data.batch_size if isinstance(data, DataLoader) else None
    return dataclasses.replace(report, batch_size=loader_batch,
                               warnings=(unshuffled,) if unshuffled else ())


def _accumulate(model: torch.nn.Module, items: list, loss_fn: LossFn, chunk_size: int,
                method: str) -> tuple[_Moments, str]:
    device = next(model.parameters(), torch.empty(0)).device
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    moments = _Moments()
    for start in range(0, len(items), chunk_size):
        inputs, targets = default_collate([_pair(item) for item in items[start:start + chunk_size]])
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        if method in ("auto", "vmap"):
            try:
                grads, losses = _vmap_chunk(model, params, loss_fn, inputs, targets)
            except Exception:  # vmap's limits surface as many types; the loop re-raises real bugs
                if method == "vmap":
                    raise
                method = "loop"
            else:
                method = "vmap"
        if method == "loop":
            grads, losses = _loop_chunk(model, params, loss_fn, inputs, targets)
        moments.add(grads, losses)
    return moments, method


def _report(moments: _Moments, n_available: int | None, batch_sizes: tuple[int, ...],
            replacement: bool, method: str, eval_batchnorm: bool) -> NoiseReport:
    layers = moments.layers()
    losses = torch.cat(moments.losses)
    n = moments.count
    return NoiseReport(
        trace_cov=math.fsum(layer.trace_cov for layer in layers),
        grad_norm_sq=math.fsum(layer.grad_norm_sq for layer in layers),
        loss_mean=losses.mean().item(),
        loss_variance=losses.var(correction=0).item(),
        n_examples=n, n_available=n_available, sampled=n_available != n,
        batch_sizes=batch_sizes, replacement=replacement, method=method, layers=layers,
        eval_batchnorm=eval_batchnorm)
