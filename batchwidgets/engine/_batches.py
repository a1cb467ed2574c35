"""Batches of any size from what the user has (callable, Dataset, DataLoader, example tensor),
and the convention for feeding them to a model and a loss."""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data import default_collate as _default_collate

from ._called import loss_call, model_call
from ._util import map_tensors, nbytes

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

    @property
    def description(self) -> str:
        """What the report's "batches from" says."""
        labels = (f" with labels of {self.num_classes} classes" if self.num_classes is not None
                  else "")
        return f"random inputs of shape {self.input_shape}{labels} (--input-shape)"


def as_keywords(batch: Any) -> dict[str, Any] | None:
    """A dict, ``BatchEncoding`` or dataclass batch as the keywords it is fed with; else None."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return None


def batch_length(batch: Any, name: str = "batch") -> int:
    """The number of examples: the first dimension its tensors share (0-d ones skipped)."""
    sizes: set[int] = set()

    def note(tensor: torch.Tensor) -> None:
        if tensor.dim():
            sizes.add(tensor.shape[0])

    map_tensors(note, batch)
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"sizes {sorted(sizes)}"
        raise TypeError(f"{name} should hold tensors whose first dimension is the examples, but "
                        f"got {found} in a {type(batch).__name__}; pass (x, y) tensors or a dict "
                        f"of tensors of one batch size.")
    return sizes.pop()


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of a batch (tensors without a batch dimension are kept whole)."""
    return map_tensors(lambda t: t[start:stop] if t.dim() else t, batch)


# NOTE [ The worst case of varying inputs ]
# A batch size that fits the average sample can run out of memory an hour into training, on the
# batch that holds the longest sequence: a padding collator pads every sample of that batch to
# it. So the probe builds its batches from the largest sample of the whole data set (by tensor
# bytes), repeated: through the DataLoader's own collate_fn that is the largest padded batch the
# loader can make. Every sample is read, in an order that spreads the first reads over the whole
# set, until SCAN_SECONDS have passed; the report says which sample it used and how many were
# read. One slot of each batch takes the smallest sample instead, where the collate_fn takes
# the two together: a padded batch then has padding, as the loop's batches have, and a model
# that branches on it (Hugging Face drops an attention mask of all ones, and materialises a
# batch x 1 x L x L mask otherwise) runs the branch training runs. Padded to the longest, the
# shapes stay those of the largest sample; packed (concatenated), they stay affine in the size.
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
    samples, sizes, largest, smallest, read = [], [], None, None, 0
    for index in _scan_order(n):  # see NOTE [ The worst case of varying inputs ]
        sample = dataset[index]
        size = nbytes(sample)
        read += 1
        if len(samples) < N_SAMPLES_SCANNED:
            samples.append(sample)
            sizes.append(size)
        if largest is None or size > largest[1]:
            largest = (index, size, sample)
        if smallest is None or size < smallest[1]:
            smallest = (index, size, sample)
        if read >= N_SAMPLES_SCANNED and time.perf_counter() - started > SCAN_SECONDS:
            break
    scanned = f"all {n:,}" if read == n else f"{read:,} of {n:,} (time limit)"
    last = None  # the one slot of a batch that takes the smallest sample
    if largest[1] > smallest[1]:  # variable-size samples: the largest is the worst case
        samples = [largest[2]]
        description = (f"the largest sample, index {largest[0]} ({largest[1]:,} bytes of "
                       f"tensors; {scanned} samples read), repeated")
        if _collates(collate, [largest[2], smallest[2]]):
            last = smallest[2]
            description += f", with the smallest (index {smallest[0]}) once, as padding"
    else:  # every sample read is the same size: the first ones stand for them all
        description = (f"{len(samples)} of the {n:,} samples, in turn ({scanned} samples read, "
                       f"all of one size)")

    def make(batch_size: int) -> Any:
        items = [samples[i % len(samples)] for i in range(batch_size)]
        if last is not None and batch_size > 1:
            items[-1] = last
        return collate(items)

    make.description = description
    return make


def _collates(collate: Callable[[list], Any], items: list) -> bool:
    """Whether ``collate`` batches these samples together (default_collate does not stack
    samples of different shapes; a padding collate_fn does)."""
    try:
        collate(items)
    except Exception:  # the collate's own message would be about samples we chose
        return False
    return True


def collate_of(data: Any) -> Callable[[list], Any]:
    """How ``data``'s loop batches its items: a DataLoader's ``collate_fn`` (padding, dict
    batches), else ``default_collate``."""
    if isinstance(data, DataLoader) and data.collate_fn is not None:
        return data.collate_fn
    return _default_collate


def collate_items(collate: Callable[[list], Any], items: list, user: str) -> Any:
    """``collate(items)``; items of different shapes under ``default_collate`` (variable-length
    text in a bare Dataset) are a one-line error saying to pass the loop's DataLoader."""
    try:
        return collate(items)
    except RuntimeError as error:
        if collate is not _default_collate or "equal size" not in str(error):
            raise
        raise ValueError(f"data should give items of one shape, or be the DataLoader whose "
                         f"collate_fn pads them, but default_collate says: {error}; pass "
                         f"{user}(..., DataLoader(dataset, batch_size=..., collate_fn=...)) as "
                         f"your loop uses (e.g. DataCollatorWithPadding(tokenizer)).") from None


def as_batch_maker(make_batch: Any) -> Callable[[int], Any]:
    """A ``make(batch_size) -> batch`` callable from any accepted form of ``make_batch``."""
    if isinstance(make_batch, torch.Tensor):
        example = make_batch

        def repeat(batch_size: int) -> torch.Tensor:
            return example.unsqueeze(0).repeat(batch_size, *([1] * example.dim()))

        repeat.description = f"one example tensor of shape {tuple(example.shape)}, repeated"
        return repeat
    if isinstance(make_batch, DataLoader):
        return _dataset_maker(make_batch.dataset, collate_of(make_batch))
    if isinstance(make_batch, Dataset) or (hasattr(make_batch, "__getitem__")
                                           and hasattr(make_batch, "__len__")
                                           and not callable(make_batch)):
        return _dataset_maker(make_batch, _default_collate)
    if isinstance(make_batch, Iterator):
        raise TypeError(f"make_batch should be a DataLoader, a Dataset, a callable "
                        f"make_batch(batch_size) or an example tensor, but got an iterator "
                        f"({type(make_batch).__name__}), which gives batches of one size only "
                        f"and is used up; pass the DataLoader itself: find_batch(model, loader), "
                        f"not iter(loader).")
    if callable(make_batch):
        return make_batch
    raise TypeError(f"make_batch should be a callable make_batch(batch_size), a Dataset, a "
                    f"DataLoader or an example tensor, but got {type(make_batch).__name__}.")


# NOTE [ The batch convention ]
# One rule for find_batch, measure_noise, NoiseTracker.measure (and the loader, which only moves
# batches): a batch is fed to the model by its shape, and its target, when it has one, is
# always used.
#   tensor x                 model(x); loss_fn(output), else the output's .loss
#   (x, ..., y) tuple/list   model(x, ...); loss_fn(output, y). Without loss_fn, y goes in as
#                            model(x, ..., labels=y) when forward takes `labels` (Hugging Face)
#                            and the output's .loss is the loss; otherwise the call is refused,
#                            since a target nobody reads would be a silent wrong answer.
#   dict / BatchEncoding /   model(**batch) and the output's .loss. With loss_fn, "labels" is
#   dataclass                taken out first and loss_fn(model(**rest), labels) is the loss (as
#                            the Hugging Face Trainer does with a custom loss); without "labels",
#                            loss_fn(output).
# loss_fn always sees the model's whole output (a ModelOutput for Hugging Face models, so
# loss_fn=lambda output, labels: F.cross_entropy(output.logits, labels) for a classifier).
# The probe alone may train a model without any loss on the mean of its outputs (same memory,
# no target to ignore); the noise measurements need a real loss.
TARGET_KEY = "labels"


def _signature(model: Any) -> inspect.Signature | None:
    inner = getattr(model, "_orig_mod", model)  # torch.compile
    inner = getattr(inner, "module", inner) if isinstance(
        inner, torch.nn.parallel.DistributedDataParallel) else inner
    try:
        return inspect.signature(inner.forward)
    except (TypeError, ValueError, AttributeError):
        return None


def _accepts(model: Any, keyword: str) -> bool:
    signature = _signature(model)
    return signature is not None and keyword in signature.parameters


def _check_keywords(model: Any, keywords: Mapping[str, Any]) -> None:
    signature = _signature(model)
    if signature is None or any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    unknown = [k for k in keywords if k not in signature.parameters]
    if unknown:
        raise TypeError(f"the batch's keys should be arguments of {type(model).__name__}.forward"
                        f"{signature}, but got {unknown[0]!r}; rename it (Hugging Face models "
                        f"take 'labels') or leave it out of the batch.")


def _takes_one_argument(loss_fn: Callable) -> bool:
    try:
        inspect.signature(loss_fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read: let the call decide
        return True
    return True


def _is_tensor_loss(loss_fn: Any) -> bool:
    """PyTorch's own losses, which take tensors only (torch.nn.functional.* and nn.*Loss)."""
    return (isinstance(loss_fn, torch.nn.modules.loss._Loss)
            or getattr(loss_fn, "__module__", None) == "torch.nn.functional")


def _apply(loss_fn: Callable, output: Any, target: Any, has_target: bool, form: str) -> Any:
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if not isinstance(output, torch.Tensor) and _is_tensor_loss(loss_fn):
        fix = ("leave loss_fn out to use the output's .loss" if hasattr(output, "loss")
               else f"pass e.g. loss_fn=lambda output, {'labels' if has_target else 'batch'}: "
                    f"{name}(output.logits, ...)")
        raise TypeError(f"loss_fn should take the model's whole output, but got loss_fn={name}, "
                        f"which takes tensors, and the model returns a {type(output).__name__}; "
                        f'{fix} (see "Batches and losses" in docs/find_batch.md).')
    if has_target:
        with loss_call(loss_fn, output, target, True):
            return loss_fn(output, target)
    if not _takes_one_argument(loss_fn):
        raise TypeError(f"batch should be an (inputs, target) tuple or a dict with a "
                        f"'{TARGET_KEY}' entry for loss_fn={name}(output, target), but got "
                        f"{form}, which has no target; add the target to the batch, or pass a "
                        f"loss_fn(output) of one argument.")
    with loss_call(loss_fn, output, None, False):
        return loss_fn(output)


def _output_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def _default_loss(output: Any, surrogate: bool, form: str) -> torch.Tensor:
    loss = _output_loss(output)
    if loss is not None:
        return loss
    if not surrogate:
        raise TypeError(f"loss_fn should be given, since the model's output "
                        f"({type(output).__name__}) has no .loss; pass loss_fn(output, target) "
                        f"with {form}, or put '{TARGET_KEY}' in dict batches of a Hugging Face "
                        f"model so that it computes its own loss.")
    tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise TypeError("the model's output has no floating-point tensor to train on; pass "
                        "loss_fn=... to find_batch.")
    return sum(t.float().mean() for t in tensors)


class Forward(NamedTuple):
    """One batch through the model and the loss: the model's whole output, the loss, and where
    the loss came from (said in a report: "loss_fn", "the output's .loss", ...)."""

    output: Any
    loss: torch.Tensor
    loss_from: str


def forward_and_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable | None, *,
                     call: Callable | None = None, surrogate: bool = True) -> torch.Tensor:
    """The loss of one batch by NOTE [ The batch convention ]. ``call`` runs the model (a
    ``functional_call`` for per-example gradients; default ``model``); ``surrogate`` lets a
    model without any loss train on the mean of its outputs (the probe) instead of refusing."""
    return forward(model, batch, loss_fn, call=call, surrogate=surrogate).loss


def forward(model: torch.nn.Module, batch: Any, loss_fn: Callable | None, *,
            call: Callable | None = None, surrogate: bool = True) -> Forward:
    """``forward_and_loss`` with the model's output kept and where the loss came from; each call
    of the user's code marked with what was called (NOTE [ The user's error, said in our words
    first ] in engine/_called.py)."""
    call = model if call is None else call
    keywords = as_keywords(batch)
    if keywords is not None:
        form = f"a {type(batch).__name__} batch with keys {list(keywords)}"
        if loss_fn is None:
            _check_keywords(model, keywords)
            with model_call(model, "**batch", keywords, batch):
                output = call(**keywords)
            return Forward(output, _default_loss(output, surrogate, form),
                           _loss_from(output))
        has_target = TARGET_KEY in keywords
        target = keywords.pop(TARGET_KEY, None)
        _check_keywords(model, keywords)
        with model_call(model, f"**batch without {TARGET_KEY!r}", keywords, batch):
            output = call(**keywords)
        return Forward(output, _apply(loss_fn, output, target, has_target, form), "loss_fn")
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        *inputs, target = batch
        form = f"an (x, ..., y) {type(batch).__name__} of {len(batch)}"
        args = ", ".join(f"batch[{i}]" for i in range(len(inputs)))
        if loss_fn is not None:
            with model_call(model, args, inputs, batch):
                output = call(*inputs)
            return Forward(output, _apply(loss_fn, output, target, True, form), "loss_fn")
        if not _accepts(model, TARGET_KEY):
            raise TypeError(f"loss_fn should be given for (x, ..., y) batches, so that the "
                            f"target y is used, but got loss_fn=None and "
                            f"{type(model).__name__}.forward takes no labels=; pass e.g. "
                            f"loss_fn=torch.nn.functional.cross_entropy (called as "
                            f"loss_fn(model(x, ...), y)), or batches without a target to train "
                            f"on the output's .loss.")
        with model_call(model, f"{args}, {TARGET_KEY}=batch[-1]", batch, batch):
            output = call(*inputs, **{TARGET_KEY: target})
        if _output_loss(output) is None:
            raise TypeError(f"loss_fn should be given: {type(model).__name__}(x, labels=y) "
                            f"returned no .loss; pass loss_fn(output, y).")
        return Forward(output, _output_loss(output), "the output's .loss")
    if isinstance(batch, (list, tuple)) and len(batch) == 1:
        batch = batch[0]
    form = f"a {type(batch).__name__} alone"
    with model_call(model, "batch", batch, batch):
        output = call(batch)
    if loss_fn is None:
        return Forward(output, _default_loss(output, surrogate, form), _loss_from(output))
    return Forward(output, _apply(loss_fn, output, None, False, form), "loss_fn")


def _loss_from(output: Any) -> str:
    """Where a loss without ``loss_fn`` comes from (``_default_loss``'s choice)."""
    return "the output's .loss" if _output_loss(output) is not None else "the mean of the output"
