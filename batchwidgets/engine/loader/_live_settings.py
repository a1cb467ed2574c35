"""The settings of a live loader: those it starts with (the wrapped loader's, with the caller's
over them) and those it switches to, checked and completed as DataLoader would."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from .._util import check_int
from ._tune import DEFAULT_BATCH_SIZE, SETTINGS, _check_source, _source_kwargs

SWITCHABLE = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


def setting(name: str) -> property:
    """A DataLoader attribute that reads the setting in force (assigning it calls ``set``)."""
    def read(self: Any) -> Any:
        return self._settings[name]

    def write(self: Any, value: Any) -> None:  # DataLoader.__init__ only; then set()
        self._settings[name] = value

    return property(read, write, doc=f"The ``{name}`` in force (``set`` changes it).")


def starting_loader(source: Any, settings: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """DataLoader arguments of the loader to wrap (``source`` with ``settings`` over its own),
    and its multiprocessing context kept apart (DataLoader refuses one without workers)."""
    _check_source(source)
    if isinstance(source, DataLoader):
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"settings should be among {list(SETTINGS)} for a DataLoader, but "
                            f"got {unknown}; set other options on the DataLoader you pass in.")
        kwargs = _source_kwargs(source)
        if settings.get("batch_size") is not None:
            if "batch_sampler" in kwargs:
                raise ValueError(f"batch_size should be None for a DataLoader with its own "
                                 f"batch_sampler, but got batch_size={settings['batch_size']!r};"
                                 f" change the batch_sampler instead.")
            kwargs["batch_size"] = settings["batch_size"]
        kwargs.update({k: v for k, v in settings.items() if k != "batch_size"})
    else:  # a Dataset: any DataLoader argument, batch_size 32 by default (as make_loader)
        _source_kwargs(source)  # the one-line error for what is no Dataset
        kwargs = {"dataset": source, "batch_size": DEFAULT_BATCH_SIZE, **settings}
    context = kwargs.pop("multiprocessing_context", None)
    if isinstance(context, str):
        context = torch.multiprocessing.get_context(context)
    return kwargs, context


def resolve(base: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``settings`` over it, checked and completed as DataLoader would."""
    new = {name: base[name] for name in SWITCHABLE}
    new.update(settings)
    check_types(new, settings)
    if new["num_workers"] == 0:
        for name, dropped in (("prefetch_factor", None), ("persistent_workers", False)):
            if settings.get(name) not in (None, False):
                raise ValueError(
                    f"{name} should be {dropped} with num_workers=0 (DataLoader takes it "
                    f"only with workers), but got {name}={settings[name]!r}; set workers "
                    f"too, e.g. set(num_workers=2, {name}={settings[name]!r}).")
        new.update(prefetch_factor=None, persistent_workers=False)
    elif new["prefetch_factor"] is None:
        new["prefetch_factor"] = 2  # DataLoader's default with workers
    return new


def check_types(new: dict[str, Any], given: dict[str, Any]) -> None:
    """One line naming the setting that is not what DataLoader takes (``given``: as typed)."""
    check_int("num_workers", new["num_workers"], 0, hint="; 0 loads in the main process")
    check_int("prefetch_factor", new["prefetch_factor"], 1, optional=True,
              hint="; DataLoader's default is 2")
    for name in ("pin_memory", "persistent_workers"):
        if not isinstance(new[name], bool):
            raise ValueError(f"{name} should be True or False, but got "
                             f"{name}={given.get(name, new[name])!r}.")
