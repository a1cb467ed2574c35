"""What batchwidgets called of the user's code when it raised: the user's error comes back as
one line first (what was called, with what, at which batch size, on fake or real tensors), an
instance of the user's type, its ``__cause__`` the user's own error, the engine's frames gone.

Usage:
    >>> try:
    ...     with called_at("find_batch", 4, fake=False), calling(lambda: "model(x)"):
    ...         raise ValueError("no")
    ... except ValueError as error:
    ...     print(error)
    find_batch called model(x) at batch size 4 (real tensors), and it raised ValueError: no

And batchwidgets' own training steps, marked on their thread: code that intercepts the user's
training calls (an ``accumulate`` block) lets them through untouched (NOTE [ Own steps ]).

    >>> with own_steps():
    ...     in_own_steps()
    True
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ._util import first_line, tensors

# NOTE [ The user's error, said in our words first ]
# An error from the user's model, loss or batch inside a probe step comes up through the
# engine's dispatch modes (the memory tracker, FakeTensorMode) and its search loop: PyTorch's
# own message, 14-28 frames deep, naming nothing of what batchwidgets called ("forward() takes
# 2 positional arguments but 3 were given" for a batch whose last element was taken as the
# target). So the code that calls the user's (forward_and_loss, the probe's step) says what it
# calls (``calling``: "model(batch[0], batch[1]) with float32[2, 8], float32[2, 8]" and a hint
# when it can tell the fix), and the loop that knows the batch size and the tensors
# (``called_at``) raises a new exception of the user's type whose one line says all that, with
# the user's error as its ``__cause__``: code that catches the user's type still catches it.
# A type that cannot be rebuilt from one message gets a subclass of itself that can (its
# attributes copied); one that cannot even be subclassed gets the line as a PEP 678 note. The
# cause's traceback loses the engine's frames (its step, its dispatch modes, fake tensors'
# kernels), so a notebook shows the user's frames, and the public function re-raises the new
# exception from its own frame (``is_said``). Out-of-memory errors are data, never rebuilt.
_CALL = "_batchwidgets_called"  # on the user's error: (what was called, a hint or "")
_SAID = "_batchwidgets_said"  # on the exception rebuilt in our words
_WHERE = "_batchwidgets_where"  # on it too: what was called, where, on what

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
# torch's own machinery of dispatch modes and fake tensors: frames a plain PyTorch run of the
# same code never shows
_DISPATCH = tuple(_TORCH + part for part in (
    "_ops.py", "utils/_python_dispatch.py", "utils/_stats.py", "_subclasses" + os.sep,
    "_meta_registrations.py", "_prims_common" + os.sep, "_prims" + os.sep, "_refs" + os.sep,
    "_decomp" + os.sep, "_library" + os.sep, "_higher_order_ops" + os.sep,
    "fx" + os.sep + "experimental" + os.sep))
# what wraps the calls into a dispatch mode (torch.compile's guard against tracing a mode): frames
# of the machinery where they lead into our mode, and only there
_WRAPPERS = tuple(_TORCH + part for part in ("_compile.py", "_dynamo" + os.sep + "eval_frame.py"))


def describe(value: Any) -> str:
    """A value as the line names it: ``float32[2, 8]`` for a tensor, its tensors for a
    container, its type's name for anything else."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, Mapping):
        return ", ".join(f"{key} {describe(item)}" for key, item in value.items())
    found = tensors(value)
    if found and not isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {', '.join(describe(t) for t in found[:4])}"
    if found:
        return ", ".join(describe(t) for t in found[:4]) + (", ..." if len(found) > 4 else "")
    return f"a {type(value).__name__}"


@contextlib.contextmanager
def calling(what: Callable[[], str], hint: Callable[[BaseException], str] | None = None, *,
            sized: bool = False) -> Iterator[None]:
    """The user's code runs inside: an error it raises is marked with ``what()`` (what was
    called, with what) and ``hint(error)`` (the fix, or ""), for ``called_at``; the innermost
    mark wins. ``sized``: ``what()`` names the batch size already."""
    try:
        yield
    except Exception as error:
        if getattr(error, _CALL, None) is None and not getattr(error, _SAID, False):
            with contextlib.suppress(Exception):  # an exception type that refuses attributes
                setattr(error, _CALL, (what(), hint(error) if hint is not None else "", sized))
        raise


def scalar_hint(loss: torch.Tensor) -> str:
    """The fix for a loss that is not one number (backward() needs one)."""
    if loss.numel() == 1:
        return ""
    return (f"loss_fn should return one number, but it returned {describe(loss)}: reduce it "
            f"(e.g. reduction='mean', or loss.mean())")


def was_called(error: BaseException) -> bool:
    """The error came from the user's code that ``calling`` marked."""
    return getattr(error, _CALL, None) is not None and not getattr(error, _SAID, False)


def said(error: BaseException, who: str, batch_size: int | None, fake: bool) -> BaseException:
    """The exception to raise for a marked user error: see NOTE [ The user's error, said in our
    words first ]."""
    what, hint, sized = getattr(error, _CALL)
    with contextlib.suppress(AttributeError):  # said once: raised again, it is marked again
        delattr(error, _CALL)
    where = f" at batch size {batch_size}" if batch_size is not None and not sized else ""
    kind = "fake tensors: shapes only, nothing computed" if fake else "real tensors"
    called = f"{who} called {what}{where} ({kind})"
    line = f"{called}, and it raised {first_line(error)}" + (f"; {hint}" if hint else "")
    trim_frames(error)
    new = _rebuilt(error, line)
    with contextlib.suppress(Exception):
        setattr(new, _WHERE, called)
    return new


def called_where(error: BaseException) -> str:
    """What a said error's line says was called, where and on what ("find_batch called the
    cell with bs = 4 (real tensors)"); "" for any other error."""
    return getattr(error, _WHERE, "")


def _plain_message(cls: type[BaseException], line: str) -> BaseException | None:
    try:
        new = cls(line)
    except Exception:  # a constructor of other arguments
        return None
    return new if str(new) == line else None


_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type[BaseException]) -> type[BaseException]:
    """``cls`` with a message of ours: same name and module, its ``__init__`` left out."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__init__": lambda self, line: BaseException.__init__(self, line),
            "__str__": lambda self: str(self.args[0]) if self.args else ""})
    return _SUBCLASSES[cls]


def _rebuilt(error: BaseException, line: str) -> BaseException:
    new = _plain_message(type(error), line)
    if new is None:
        try:
            new = _subclass(type(error))(line)
            new.__dict__.update({k: v for k, v in vars(error).items()
                                 if not k.startswith("_batchwidgets")})
        except Exception:  # neither: the user's own error carries the line as a note
            error.add_note(line)
            setattr(error, _SAID, "note")  # said, and its own traceback kept
            return error
    setattr(new, _SAID, True)
    new.__cause__ = error
    return new


def _ours(tb: Any) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def _machinery(tb: Any) -> bool:
    name = tb.tb_frame.f_code.co_filename
    return name.startswith(_DISPATCH) or name.startswith(_WRAPPERS)


def trim_frames(error: BaseException) -> None:
    """The user's error's traceback as a plain run of the user's code would show it: without
    batchwidgets' frames above the user's (the step that called it), and without anything below
    the op the user's code called where the engine's dispatch mode ran it (our mode's frames,
    torch's dispatch and fake-tensor machinery): the op raised, as it does without a mode."""
    chain = []
    tb = error.__traceback__
    while tb is not None:
        chain.append(tb)
        tb = tb.tb_next
    first = next((i for i, tb in enumerate(chain) if not _ours(tb)), len(chain))
    mode = next((i for i in range(first, len(chain)) if _ours(chain[i])), len(chain))
    while mode > first and _machinery(chain[mode - 1]):
        mode -= 1  # the dispatcher's way into our mode
    for tb in chain[:first] + chain[mode:]:
        if _ours(tb):  # its locals (a batch, a snapshot) go with it
            with contextlib.suppress(RuntimeError):  # still running: it clears its own
                tb.tb_frame.clear()
    kept = [tb for tb in chain[first:mode] if not _machinery(tb)]
    for this, following in zip(kept, [*kept[1:], None]):
        this.tb_next = following
    error.__traceback__ = kept[0] if kept else None


@contextlib.contextmanager
def called_at(who: str, batch_size: int | None, fake: bool) -> Iterator[None]:
    """Inside, a user error that ``calling`` marked comes out said in our words (``said``)."""
    try:
        yield
    except Exception as error:
        if not was_called(error):
            raise
        new = said(error, who, batch_size, fake)
        if new is error:
            raise
        raise new from error


def is_said(error: BaseException) -> bool:
    """The exception is a user's error said in our words: a public function re-raises it from
    its own frame (``raise error.with_traceback(None)``), its search's frames left out."""
    return getattr(error, _SAID, False) is True


def model_call(model: Any, args: str, values: Any, batch: Any
               ) -> contextlib.AbstractContextManager:
    """``calling``'s marks for the model's call: what it was given, and the fix it can tell."""
    def what() -> str:
        return f"model({args}) with {describe(values)}"

    def hint(error: BaseException) -> str:
        # a 3-tuple's middle element taken as the model's second argument fails in any way
        # (a TypeError for a count, an AttributeError deep in a model that takes a cache
        # there): said whatever the type, unless the dtypes tell something surer
        dtypes = _dtype_hint(model, values)
        if dtypes or not (isinstance(batch, (list, tuple)) and len(batch) > 2):
            return dtypes
        return (f"the batch is a {len(batch)}-tuple: all but its last element go to the "
                f"model and the last is the target (loss_fn(output, batch[-1])); make "
                f"the batch (inputs, target), or a dict fed as model(**batch)")

    return calling(what, hint)


def _dtype_hint(model: Any, values: Any) -> str:
    """The batch's floating dtype against the model's weights', where they differ."""
    weights = {p.dtype for p in getattr(model, "parameters", list)() if p.is_floating_point()}
    given = {t.dtype for t in tensors(values) if t.is_floating_point()}
    if len(weights) != 1 or not given or given <= weights:
        return ""
    weight, batch = (str(next(iter(weights))).removeprefix("torch."),
                     str(sorted(given, key=str)[0]).removeprefix("torch."))
    return (f"the batch is {batch} and the model's weights {weight}: give them one dtype "
            f"(the batch's tensors .to(torch.{weight}), or model.to(torch.{batch}))")


def loss_call(loss_fn: Callable, output: Any, target: Any, has_target: bool
               ) -> contextlib.AbstractContextManager:
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    args = "output, target" if has_target else "output"
    given = f"output {describe(output)}" + (f", target {describe(target)}" if has_target
                                               else "")
    return calling(lambda: f"loss_fn({args}) ({name}) with {given}")


_LOCAL = threading.local()  # _LOCAL.depth: own_steps() blocks open on this thread


# NOTE [ Own steps ]
# find_batch may run inside a user's `with accumulate(...)` block (a %%accumulate cell that probes
# first). Its trial steps call optimizer.step() and backward(), which the block would count as
# the user's micro-steps, leaving gradients behind. The probe marks its steps here, and the
# accumulator asks `in_own_steps()` before it takes a call. Neither capability imports the other:
# both import this module, which imports nothing of theirs.
@contextmanager
def own_steps() -> Iterator[None]:
    """Inside, on this thread, the training calls are batchwidgets' own (see NOTE [ Own steps ])."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def in_own_steps() -> bool:
    """Whether this thread runs batchwidgets' own steps now."""
    return getattr(_LOCAL, "depth", 0) > 0
