"""The one adapter over PyTorch's fake process group (``torch.testing._internal``): N ranks in
this process alone, no communication, so one rank's step under FSDP2 can be traced as it runs;
and ``fully_shard`` wherever the supported torch keeps it."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# NOTE [ A fake process group, behind one adapter ]
# PyTorch's fake process group is a backend ("fake") that answers every collective at once and
# touches no data: one process is one rank of a world of any size, and FSDP2 shards, gathers and
# reduce-scatters exactly as it would there (torchtitan's memory estimator runs FSDP2 the same
# way). It lives in torch.testing._internal.distributed.fake_pg (importing it registers the
# backend), a private module that has kept its name from torch 2.4 to 2.13; this file is the only
# one that reads it, and fully_shard's own move (torch.distributed._composable.fsdp until 2.5,
# torch.distributed.fsdp from 2.6). The group is the process's default group for the time of one
# plan, so a plan runs where no process group is initialised; inside a job (a group already
# there) the plan takes the strategy's published rules instead (NOTE [ Per-rank memory by
# strategy ] in _parallel.py) and says so.
_FAKE_PG = "torch.testing._internal.distributed.fake_pg"


class FakeGroupUnavailable(RuntimeError):
    """This process cannot run a fake process group (the reason is the message)."""


def fully_shard_function() -> Callable[..., Any]:
    """FSDP2's ``fully_shard`` (torch >= 2.6 path first, then the 2.4-2.5 one)."""
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(path), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise FakeGroupUnavailable(f"this torch ({torch.__version__}) has no FSDP2 fully_shard")


def _importable() -> None:
    if not torch.distributed.is_available():
        raise FakeGroupUnavailable("this build of torch has no torch.distributed")
    if torch.distributed.is_initialized():
        raise FakeGroupUnavailable("a process group is initialised in this process already")
    try:
        importlib.import_module(_FAKE_PG)  # registers the "fake" backend
    except ImportError as error:
        raise FakeGroupUnavailable(f"torch {torch.__version__} has no fake process group "
                                   f"({error})") from error


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0) and a 1-D
    CPU ``DeviceMesh`` over it, yielded; the group is destroyed afterwards, however it ends."""
    _importable()
    from torch.distributed.device_mesh import init_device_mesh

    store = importlib.import_module(_FAKE_PG).FakeStore()
    torch.distributed.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        torch.distributed.destroy_process_group()
