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
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..._warnings import BatchwidgetsWarning
from ...results import NoiseReport
from .._batches import (
    as_keywords,
    batch_length,
    collate_items,
    collate_of,
    forward_and_loss,
    slice_batch,
)
from .._called import called_at, is_said
from .._options import NOISE_METHODS, NoiseMethod
from .._state import TrainingState, restored
from .._unsharded import unsharded
from .._util import check_int, to_device
from ._moments import Moments
from ._tracker import unshuffled_loader_warning

LossFn = Callable[[Any, Any], torch.Tensor]
_METHODS = NOISE_METHODS
# PyTorch's warning when vmap runs an op without a batching rule example by example
_SLOW_VMAP = re.compile(r"performance drop because we have not yet implemented the batching "
                        r"rule for (\S+)")


def _check_arguments(model: Any, data: Any, loss_fn: Any, batch_sizes: Any, max_examples: Any,
                     chunk_size: Any, method: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model should be a torch.nn.Module, but got model={model!r}.")
    if isinstance(data, Iterator):
        raise TypeError(f"data should be a torch Dataset or DataLoader, but got an iterator "
                        f"({type(data).__name__}); pass the DataLoader itself, not iter(loader).")
    sized = hasattr(data, "__getitem__") and hasattr(data, "__len__")  # a list, HF datasets
    if isinstance(data, (torch.Tensor, Mapping)) or not (
            isinstance(data, (Dataset, DataLoader)) or sized):
        raise TypeError(f"data should be a torch Dataset or DataLoader of examples ((x, y) "
                        f"pairs or dicts), but got data={type(data).__name__}; wrap tensors as "
                        f"torch.utils.data.TensorDataset(x, y).")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn should be a callable loss_fn(output, target) -> scalar or None "
                        f"(the output's .loss), but got loss_fn={loss_fn!r}; e.g. "
                        f"loss_fn=torch.nn.functional.cross_entropy.")
    if (isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable)
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in batch_sizes)):
        raise TypeError(f"batch_sizes should be a sequence of ints, but got "
                        f"batch_sizes={batch_sizes!r}; e.g. batch_sizes=(1, 8, 64).")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes should be one or more ints >= 1, but got "
                         f"batch_sizes={batch_sizes!r}; e.g. batch_sizes=(1, 8, 64).")
    check_int("max_examples", max_examples, 2, hint="; e.g. max_examples=1024")
    check_int("chunk_size", chunk_size, 1, hint="; e.g. chunk_size=64")
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


def _plain(batch: Any) -> Any:
    """A collated batch as a pytree vmap can split: dict-likes and dataclasses become dicts."""
    keywords = as_keywords(batch)
    return batch if keywords is None else keywords


def _vmap_chunk(model: torch.nn.Module, params: dict[str, torch.Tensor], loss_fn: LossFn | None,
                batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-example gradients and losses of one chunk: the loss sees one-example batches."""
    buffers = dict(model.named_buffers())
    in_dims = tree_map(lambda v: 0 if isinstance(v, torch.Tensor) and v.dim() else None, batch)
    dims = tree_flatten(in_dims)[0]

    def loss_one(weights: dict[str, torch.Tensor], example: Any) -> torch.Tensor:
        leaves, spec = tree_flatten(example)
        one = tree_unflatten([v.unsqueeze(0) if d == 0 else v for v, d in zip(leaves, dims)],
                             spec)

        def call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (weights, buffers), args, kwargs)

        return forward_and_loss(model, one, loss_fn, call=call, surrogate=False)

    # randomness="different": dropout draws its own mask per example, as it would in a loop.
    per_example = vmap(grad_and_value(loss_one), in_dims=(None, in_dims), randomness="different")
    return per_example(params, batch)


def _loop_chunk(model: torch.nn.Module, params: dict[str, torch.Tensor], loss_fn: LossFn | None,
                batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same as ``_vmap_chunk`` with one autograd pass per example (any module works)."""
    # The module's own parameters (``params`` holds detached aliases for functional_call).
    live = dict(model.named_parameters())
    names, tensors = list(params), [live[n] for n in params]
    grads: list[list[torch.Tensor]] = [[] for _ in names]
    losses = []
    for i in range(batch_length(batch, "data")):
        loss = forward_and_loss(model, slice_batch(batch, i, i + 1), loss_fn, surrogate=False)
        parts = torch.autograd.grad(loss, tensors, allow_unused=True)
        for slot, part, tensor in zip(grads, parts, tensors):
            slot.append(torch.zeros_like(tensor) if part is None else part)
        losses.append(loss.detach())
    return {n: torch.stack(g) for n, g in zip(names, grads)}, torch.stack(losses)


def _quiet_vmap(run: Callable[[], Any], slow_ops: set[str]) -> Any:
    """``run()`` with PyTorch's per-call "performance drop" warnings of vmap collected in
    ``slow_ops`` (measure_noise says it once) and every other warning passed on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    for warning in caught:
        found = _SLOW_VMAP.search(str(warning.message))
        if found:
            slow_ops.add(found.group(1).rstrip("."))
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno)
    return result


class VmapCannotRun(ValueError, RuntimeError):
    """``method="vmap"`` was asked of a model torch.func.vmap cannot run. A ValueError (a value
    of ``method`` that cannot work here) and a RuntimeError, the type vmap's own failure had."""


def _refuse_vmap(model: torch.nn.Module, params: dict[str, torch.Tensor],
                 loss_fn: LossFn | None, batch: Any, error: Exception) -> NoReturn:
    """vmap failed on a chunk. One example through the loop tells the model's own error (raised
    from there, as it is) from what vmap cannot do (one line naming ``method=`` and the fix)."""
    _loop_chunk(model, params, loss_fn, slice_batch(batch, 0, 1))
    raise VmapCannotRun(
        f"method should be 'loop' or 'auto' for {type(model).__name__}, but got method='vmap': "
        f"torch.func.vmap cannot run its forward (it raised {type(error).__name__}: "
        f"{_vmap_reason(error)}), while one backward pass per example can; pass method='loop', "
        f"or leave method out ('auto' falls back to the loop by itself).") from error


def _vmap_reason(error: Exception) -> str:
    """What vmap met, in our words (its own message is long and names its internals)."""
    message = str(error)
    if ".item()" in message or "data-dependent" in message or "Tensor.item" in message:
        return "a data-dependent op such as .item() or a branch on a tensor's value"
    if "in-place" in message or "inplace" in message:
        return "an in-place update vmap cannot batch"
    if "batching rule" in message:
        return "an op without a batching rule"
    return "an op or a Python branch it cannot batch"


def _batchnorm_in_training(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


def measure_noise(model: torch.nn.Module, data: Dataset | DataLoader,
                  loss_fn: LossFn | None = None,
                  batch_sizes: Sequence[int] = (1, 2, 4, 8), *, replacement: bool = False,
                  max_examples: int = 1024, chunk_size: int = 64,
                  method: NoiseMethod = "auto") -> NoiseReport:
    """Measure gradient noise from exact per-example gradients.

    For N examples with per-example gradients g_i (of ``loss_fn`` on a one-example batch) and
    mean gradient G: ``trace_cov`` = (1/N) sum_i |g_i - G|^2, ``grad_norm_sq`` = |G|^2,
    ``b_simple`` = tr(Sigma) / |G|^2 of the data (McCandlish et al. 2018): trace_cov /
    grad_norm_sq exactly when the whole data set was measured, else both parts estimated
    without bias by the rule ``report.population_rule`` names (N of M examples as if drawn at
    random without replacement; an infinite population where M is unknown), and for each batch
    size B the variance (trace) of the mini-batch mean gradient: trace_cov / B with
    replacement, times (N - B) / (N - 1) without. The same for the loss, and a per-parameter
    breakdown. The model's weights, gradients, buffers, train/eval modes and the RNGs are
    restored afterwards.
    ``report.measurable`` says whether N examples can resolve B_simple at all (see NOTE [ The
    error bars of measure_noise ]); ``b_simple_error`` is its standard error.

    Parameters
    ----------
    model : torch.nn.Module
        Measured in its current train/eval mode, except BatchNorm layers in train mode: a
        one-example batch has no batch statistics, so they use their running statistics
        (with a ``BatchwidgetsWarning``).
    data : Dataset, DataLoader, or a list of items (anything with len() and [i])
        Items ``(input, ..., target)``, dicts (e.g. ``{"input_ids", "attention_mask",
        "labels"}``) or tensors, fed by the batch convention of ``find_batch`` (see "Batches
        and losses" in docs/find_batch.md); a DataLoader's dataset is read item by item and
        batched by its ``collate_fn`` (padded variable-length text, as the loop sees it). Inputs
        are moved to the model's device. A DataLoader's ``batch_size`` is the one the advice is
        given at; one that does not shuffle gives a ``BatchwidgetsWarning`` (its batches are not
        the random ones these numbers describe), kept in ``report.warnings``.
        On every rank of an FSDP2 job (``fully_shard``), each rank measures its own items on a
        replica holding the full weights (NOTE [ An unsharded replica ]).
    loss_fn : callable, optional
        ``loss_fn(output, target) -> scalar``, called on one-example batches (``output`` and
        ``target`` keep a leading dimension of 1), so a mean reduction gives the example's loss.
        For dict items the target is their ``"labels"``. Default: the output's ``.loss``, as
        Hugging Face models return when the items hold ``labels``.
    batch_sizes : sequence of int
        The sizes B for ``grad_variance[B]`` and ``loss_variance_per_batch[B]``.
    replacement : bool
        Which sampling ``grad_variance`` assumes: False (default) as a shuffling DataLoader
        draws an epoch, True for independent draws. The report holds both variants.
    max_examples : int
        Larger data is measured on ``max_examples`` evenly spaced items (the first ones of an
        iterable dataset); the report says so in ``sampled`` and ``population_rule``.
    chunk_size : int
        Examples per vmap call; memory is about ``chunk_size`` copies of the gradient.
    method : {"auto", "vmap", "loop"}
        "auto" tries ``torch.func.vmap`` and falls back to one backward pass per example for
        modules vmap cannot handle (in-place updates, data-dependent control flow). Examples
        with a non-finite loss or gradient are left out with a ``BatchwidgetsWarning``.

    Returns
    -------
    NoiseReport

    Raises
    ------
    TypeError, ValueError
        For bad arguments, naming the argument and a fix; a model without trainable
        parameters; a batch the convention cannot feed (naming the form that would work).

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
    model = unsharded(model)  # FSDP2: see NOTE [ An unsharded replica ]
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model should have trainable parameters (requires_grad=True), but got "
                         f"none in {type(model).__name__}; measure_noise measures their "
                         f"gradients: unfreeze the ones you train, e.g. "
                         f"p.requires_grad_(True).")
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
        with restored(state), torch.enable_grad():
            for module in batchnorm:
                module.eval()
            moments, used = _accumulate(model, items, loss_fn, chunk_size, method,
                                        collate_of(data))
    except Exception as error:
        if not is_said(error):
            raise
        raise error.with_traceback(None) from error.__cause__  # said in our words: from here
    report = _report(moments, n_available, batch_sizes, replacement, used, bool(batchnorm))
    loader_batch = data.batch_size if isinstance(data, DataLoader) else None
    return dataclasses.replace(report, batch_size=loader_batch,
                               warnings=(unshuffled,) if unshuffled else ())


def _accumulate(model: torch.nn.Module, items: list, loss_fn: LossFn | None, chunk_size: int,
                method: str, collate: Callable[[list], Any]) -> tuple[Moments, str]:
    device = next(model.parameters(), torch.empty(0)).device
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    moments, slow_ops, skipped = Moments(len(items)), set(), 0
    for start in range(0, len(items), chunk_size):
        batch = to_device(_plain(collate_items(collate, items[start:start + chunk_size],
                                               "measure_noise")), device)
        if method in ("auto", "vmap"):
            try:
                grads, losses = _quiet_vmap(
                    lambda batch=batch: _vmap_chunk(model, params, loss_fn, batch), slow_ops)
            except Exception as error:  # vmap's limits surface as many types
                if method == "vmap":
                    with called_at("measure_noise", 1, fake=False):
                        _refuse_vmap(model, params, loss_fn, batch, error)
                method = "loop"  # which re-raises the model's own errors
            else:
                method = "vmap"
        if method == "loop":  # one example at a time: batches of 1
            with called_at("measure_noise", 1, fake=False):
                grads, losses = _loop_chunk(model, params, loss_fn, batch)
        grads, losses, dropped = _finite(grads, losses)
        skipped += dropped
        if losses.numel():
            moments.add(grads, losses)
    _say_what_was_left_out(moments.count, skipped, slow_ops, method)
    return moments, method


def _finite(grads: dict[str, torch.Tensor], losses: torch.Tensor
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """The examples whose loss and gradient are finite, and how many were not."""
    keep = torch.isfinite(losses.detach().reshape(-1))
    for g in grads.values():
        keep &= torch.isfinite(g.reshape(g.shape[0], -1)).all(1)
    if bool(keep.all()):
        return grads, losses, 0
    return ({n: g[keep] for n, g in grads.items()}, losses[keep],
            int(keep.numel() - keep.sum()))


def _say_what_was_left_out(count: int, skipped: int, slow_ops: set[str], method: str) -> None:
    if skipped:
        message = (f"{skipped} of {count + skipped} examples had a non-finite loss or gradient "
                   f"(nan/inf) and were left out; check those inputs and targets (a Hugging Face "
                   f"example whose labels are all -100 has a NaN loss)")
        if count < 2:
            raise ValueError(f"data should give finite losses, but {message}.")
        warnings.warn(f"measure_noise: {message}.", BatchwidgetsWarning, stacklevel=3)
    if slow_ops and method == "vmap":
        warnings.warn(f"measure_noise: torch.func.vmap has no batching rule for "
                      f"{', '.join(sorted(slow_ops))} and ran them one example at a time inside "
                      f"vmap (PyTorch's 'performance drop' warning, said once here); the "
                      f"numbers are exact.",
                      BatchwidgetsWarning, stacklevel=3)


def _report(moments: Moments, n_available: int | None, batch_sizes: tuple[int, ...],
            replacement: bool, method: str, eval_batchnorm: bool) -> NoiseReport:
    layers = moments.layers()
    losses = torch.cat(moments.losses)
    n = moments.count
    grad_norm_sq_error, b_simple_error = moments.errors(n_available)
    return NoiseReport(
        trace_cov=math.fsum(layer.trace_cov for layer in layers),
        grad_norm_sq=math.fsum(layer.grad_norm_sq for layer in layers),
        loss_mean=losses.mean().item(),
        loss_variance=losses.var(correction=0).item(),
        n_examples=n, n_available=n_available, sampled=n_available != n,
        batch_sizes=batch_sizes, replacement=replacement, method=method, layers=layers,
        eval_batchnorm=eval_batchnorm, grad_norm_sq_error=grad_norm_sq_error,
        b_simple_error=b_simple_error)
