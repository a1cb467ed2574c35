"""Batches of any size from what the user has (callable, Dataset, DataLoader, example tensor),
and the convention for feeding them to a model and a loss."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data import default_collate as _default_collate

N_SAMPLES_SCANNED = 64  # dataset items read to find the largest sample


@dataclass(frozen=True)
class SyntheticBatches:
    """``make_batch`` without data: random inputs of one example's shape, plus random class
    labels in ``[0, num_classes)`` when given (``%find_batch --input-shape 3,32,32
    --num-classes 10``)."""

    input_shape: tuple[int, ...]
    num_classes: int | None = None

    def __call__(self, batch_size: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(batch_size, *self.input_shape)
        if self.num_classes is None:
            return inputs
        return inputs, torch.randint(0, self.num_classes, (batch_size,))


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _nbytes(sample: Any) -> int:
    if isinstance(sample, torch.Tensor):
        return sample.nelement() * sample.element_size()
    if isinstance(sample, Mapping):
        return sum(_nbytes(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(_nbytes(v) for v in sample)
    return 0


# NOTE [ The worst case of varying inputs ]
# A batch size that fits the average sample can run out of memory an hour into training, on the
# batch that holds the longest sequence: a padding collator pads every sample of that batch to
# it. So the probe builds its batches from the largest sample of the whole data set (by tensor
# bytes), repeated: through the DataLoader's own collate_fn that is the largest padded batch the
# loader can make. Every sample is read, in an order that spreads the first reads over the whole
# set, until SCAN_SECONDS have passed; the report says which sample it used and how many were
# read.
SCAN_SECONDS = 5.0


def _scan_order(n: int) -> Iterator[int]:
    """Evenly spread indices first, then all the others."""
    spread = sorted({i * n // N_SAMPLES_SCANNED for i in range(min(n, N_SAMPLES_SCANNED))})
    yield from spread
    chosen = set(spread)
    yield from (i for i in range(n) if i not in chosen)


def _dataset_maker(dataset: Dataset, collate: Callable) -> Callable[[int], Any]:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError("make_batch should be a map-style Dataset (with __len__ and __getitem__), "
                        f"but got {type(dataset).__name__}; pass make_batch(batch_size) instead.")
    n = len(dataset)
    if n == 0:
        raise ValueError("make_batch should be a non-empty Dataset, but got one of length 0.")
    started = time.perf_counter()
    samples, sizes, largest, read = [], [], None, 0
    for index in _scan_order(n):  # see NOTE [ The worst case of varying inputs ]
        sample = dataset[index]
        size = _nbytes(sample)
        read += 1
        if len(samples) < N_SAMPLES_SCANNED:
            samples.append(sample)
            sizes.append(size)
        if largest is None or size > largest[1]:
            largest = (index, size, sample)
        if read >= N_SAMPLES_SCANNED and time.perf_counter() - started > SCAN_SECONDS:
            break
    scanned = "all" if read == n else f"{read} of {n} (time limit)"
    if largest[1] > min(sizes):  # variable-size samples: the largest is the worst case
        samples = [largest[2]]
        description = (f"the largest sample, index {largest[0]} ({largest[1]:,} bytes of "
                       f"tensors; {scanned} samples read), repeated")
    else:
        description = f"{len(samples)} samples of one size ({scanned} samples read)"

    def make(batch_size: int) -> Any:
        return collate([samples[i % len(samples)] for i in range(batch_size)])

    make.description = description
    return make


def as_batch_maker(make_batch: Any) -> Callable[[int], Any]:
    """A ``make(batch_size) -> batch`` callable from any accepted form of ``make_batch``."""
    if isinstance(make_batch, torch.Tensor):
        example = make_batch

        def repeat(batch_size: int) -> torch.Tensor:
            return example.unsqueeze(0).repeat(batch_size, *([1] * example.dim()))

        return repeat
    if isinstance(make_batch, DataLoader):
        return _dataset_maker(make_batch.dataset, make_batch.collate_fn or _default_collate)
    if isinstance(make_batch, Dataset) or (hasattr(make_batch, "__getitem__")
                                           and hasattr(make_batch, "__len__")
                                           and not callable(make_batch)):
        return _dataset_maker(make_batch, _default_collate)
    if callable(make_batch):
        return make_batch
    raise TypeError(f"make_batch should be a callable make_batch(batch_size), a Dataset, a "
                    f"DataLoader or an example tensor, but got {type(make_batch).__name__}.")


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise TypeError("the model's output has no floating-point tensor to train on; pass "
                        "loss_fn=... to find_batch.")
    return sum(t.float().mean() for t in tensors)


def forward_and_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    """``(x, ..., y)`` -> ``loss_fn(model(x, ...), y)``; dict -> ``model(**batch)``; tensor ->
    ``model(x)``. Without ``loss_fn``: the output's ``.loss``, or the mean of its outputs."""
    target = None
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) >= 2:
        output = model(*batch[:-1])
        target = batch[-1]
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 1:
        output = model(batch[0])
    else:
        output = model(batch)
    if loss_fn is None:
        return _default_loss(output)
    return loss_fn(output) if target is None else loss_fn(output, target)
