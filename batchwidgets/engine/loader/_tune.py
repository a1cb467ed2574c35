"""``tune_loader``: DataLoader settings that keep the device busy, measured, not guessed; and
``measure_loader`` (one setting), ``data_stall`` (how much a training step waits on data).

Usage:
    >>> import torch, batchwidgets as bw
    >>> data = torch.utils.data.TensorDataset(torch.randn(256, 8))
    >>> trial = bw.measure_loader(data, batch_size=32, duration_s=0.05)
    >>> trial.samples_per_s > 0
    True
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..._warnings import BatchwidgetsWarning
from ...results import DataStallReport, LoaderReport, LoaderTrial
from ...results.loader import with_factory
from .._options import Clock, OnProgress, ShouldStop, TrainStep
from .._util import check_int, has_accelerator
from . import _search
from ._checks import (
    check_measure_arguments,
    check_tune_arguments,
    check_workers_can_unpickle,
    usable_cpus,
)
from ._timing import copy_batch, failed_trial, resolve_device, shutdown, synchronize, time_loader

# Progress callbacks, steps and data arguments: NOTE [ One vocabulary ] in engine/_options.py.

DEFAULT_BATCH_SIZE = 32  # for a Dataset given without batch_size
SETTINGS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "batch_size")


def check_source(source: Any) -> None:
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        raise TypeError(f"loader_or_dataset should be a DataLoader or a Dataset, but got "
                        f"loader_or_dataset={source!r} (a path); load the files into a "
                        f"torch.utils.data.Dataset, e.g. torchvision.datasets.ImageFolder(path).")


def source_kwargs(source: Any) -> dict[str, Any]:
    """DataLoader arguments that reproduce ``source`` (a DataLoader) or batch a Dataset."""
    if not isinstance(source, DataLoader):
        if not (hasattr(source, "__getitem__") or hasattr(source, "__iter__")):
            raise TypeError(f"loader_or_dataset should be a DataLoader or a Dataset, but got "
                            f"loader_or_dataset={type(source).__name__}; wrap your samples in a "
                            f"torch.utils.data.Dataset.")
        return {"dataset": source, "batch_size": DEFAULT_BATCH_SIZE}
    kwargs: dict[str, Any] = {
        "dataset": source.dataset, "num_workers": source.num_workers,
        "pin_memory": source.pin_memory, "prefetch_factor": source.prefetch_factor,
        "persistent_workers": source.persistent_workers, "collate_fn": source.collate_fn,
        "timeout": source.timeout, "worker_init_fn": source.worker_init_fn,
        "multiprocessing_context": source.multiprocessing_context,
        "generator": source.generator}
    if hasattr(source, "in_order"):  # PyTorch >= 2.6
        kwargs["in_order"] = source.in_order
    iterable = isinstance(source.dataset, IterableDataset)  # takes no sampler argument
    if source.batch_size is not None:  # DataLoader built its BatchSampler from these
        kwargs.update(batch_size=source.batch_size, drop_last=source.drop_last)
        if not iterable:
            kwargs["sampler"] = source.sampler
    elif source.batch_sampler is not None:  # the user's own; DataLoader wants batch_size=1
        kwargs.update(batch_size=1, batch_sampler=source.batch_sampler)
    else:  # no automatic batching: the dataset yields batches
        kwargs["batch_size"] = None
        if not iterable:
            kwargs["sampler"] = source.sampler
    return kwargs


def make_loader(loader_or_dataset: DataLoader | Any, /, **settings: Any) -> DataLoader:
    """A new DataLoader over the same data with some settings changed:
    ``bw.make_loader(data, **report.best.settings)`` builds what ``tune_loader`` found.

    Keeps the dataset, sampler (and so shuffling), batch_sampler, collate_fn, drop_last,
    worker_init_fn, generator, multiprocessing_context and timeout of a DataLoader; a Dataset
    gets ``batch_size=32`` and sequential sampling unless ``batch_size`` is given.

    Parameters
    ----------
    loader_or_dataset : DataLoader or Dataset
    **settings
        Any of ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
        ``batch_size`` (None keeps the source's). With ``num_workers=0``, ``prefetch_factor``
        becomes None and ``persistent_workers`` False, as DataLoader requires.

    Returns
    -------
    torch.utils.data.DataLoader

    Examples
    --------
    >>> loader = make_loader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), num_workers=0)
    >>> loader.batch_size
    32
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"settings should be among {list(SETTINGS)}, but got {unknown}; set "
                        f"other options on the DataLoader you pass in.")
    kwargs = source_kwargs(loader_or_dataset)
    batch_size = settings.pop("batch_size", None)
    if batch_size is not None:
        if "batch_sampler" in kwargs:
            raise ValueError(f"batch_size should be None for a DataLoader with its own "
                             f"batch_sampler, but got batch_size={batch_size!r}; change the "
                             f"batch_sampler instead.")
        kwargs["batch_size"] = batch_size
    kwargs.update(settings)
    if not kwargs.get("num_workers"):  # DataLoader rejects these without workers
        kwargs.update(num_workers=0, prefetch_factor=None, persistent_workers=False,
                      multiprocessing_context=None)
    return DataLoader(**kwargs)


def measure_loader(loader_or_dataset: DataLoader | Any, *, num_workers: int = 0,
                   pin_memory: bool = False, prefetch_factor: int | None = None,
                   persistent_workers: bool = False, batch_size: int | None = None,
                   device: torch.device | str | None = None, duration_s: float = 1.0,
                   max_batches: int | None = None, clock: Clock = time.perf_counter,
                   should_stop: ShouldStop | None = None) -> LoaderTrial:
    """Measure the input pipeline's throughput with one set of DataLoader settings.

    The warm-up (creating the iterator, starting workers, the first batch) is timed apart as
    ``first_batch_s``; then batches are drawn for ``duration_s`` (or ``max_batches``), each
    copied to ``device`` (``non_blocking`` when pinned), and the device synchronised before the
    clock stops. An epoch that ends inside the window is restarted, and its restart counted.
    The workers are shut down before this returns or raises (NOTE [ Shut workers down ]).

    Parameters
    ----------
    loader_or_dataset : DataLoader or Dataset
        Its dataset, sampler, collate_fn... are reused (see ``make_loader``).
    num_workers, pin_memory, prefetch_factor, persistent_workers, batch_size
        The DataLoader settings measured. ``batch_size=None``: the loader's (32 for a Dataset).
    device : str or torch.device, optional
        Where batches are copied; default the accelerator when present, else no copy ("cpu").
    duration_s : float
        Seconds of steady-state timing.
    max_batches : int, optional
        Stop after this many timed batches.
    clock : callable
        Seconds, ``time.perf_counter`` by default (injectable for tests).
    should_stop : callable, optional
        Polled between batches; True ends the timing early (the trial is marked ``cancelled``).

    Returns
    -------
    LoaderTrial

    Raises
    ------
    TypeError
        When workers started by spawn/forkserver could not unpickle the dataset (with the fix).
    Exception
        Whatever the dataset or a worker raised, unchanged (DataLoader names the worker).

    Examples
    --------
    >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    >>> measure_loader(data, batch_size=16, max_batches=2).n_batches
    2
    """
    check_source(loader_or_dataset)
    check_measure_arguments(num_workers, prefetch_factor, batch_size, duration_s, max_batches)
    loader = make_loader(loader_or_dataset, num_workers=num_workers, pin_memory=pin_memory,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         batch_size=batch_size)
    check_workers_can_unpickle(loader)
    trial = time_loader(loader, resolve_device(device), duration_s, max_batches, clock,
                         should_stop)
    for note in trial.warnings:
        warnings.warn(note, BatchwidgetsWarning, stacklevel=2)
    return trial


def tune_loader(loader_or_dataset: DataLoader | Any, device: torch.device | str | None = None, *,
                batch_size: int | None = None, max_workers: int | None = None,
                duration_s: float = 1.0, threshold: float = 0.05, step: TrainStep | None = None,
                clock: Clock = time.perf_counter, on_progress: OnProgress | None = None,
                should_stop: ShouldStop | None = None) -> LoaderReport:
    """Find the fastest DataLoader settings by measuring a few, not the whole grid.

    The grid is num_workers in {0, 1, 2, 4, ..., max_workers} x pin_memory (True only with an
    accelerator) x prefetch_factor {2, 4} x persistent_workers. The search measures no workers
    first (the per-batch cost), starts from the number of workers that should keep up, climbs
    while a step gains ``threshold`` or more, then tries the other options at the best
    (see ``_search.next_setting``). A setting whose workers raise is recorded as a
    failed trial and the search goes on; an error with no workers propagates.

    Parameters
    ----------
    loader_or_dataset : DataLoader or Dataset
        What to tune; a Dataset is batched by ``batch_size`` (default 32).
    device : str or torch.device, optional
        Where batches go; default the accelerator when present, else no copy.
    batch_size : int, optional
        Overrides the loader's batch size.
    max_workers : int, optional
        Largest num_workers tried; default the CPUs this process may use.
    duration_s : float
        Seconds of timing per setting (the warm-up comes on top).
    threshold : float
        Smallest relative gain that is worth one more rung of workers.
    step : callable, optional
        ``step(batch)``, one training step: fills ``report.stall`` (see ``data_stall``).
    clock, on_progress, should_stop : callable, optional
        Time source; called with each ``LoaderTrial`` as it is measured; polled to cancel
        (returns what ran).

    Returns
    -------
    LoaderReport
        ``best`` (and ``current``) is the fastest trial; ``report.make_loader()`` builds it.

    Examples
    --------
    >>> data = torch.utils.data.TensorDataset(torch.randn(512, 8))
    >>> report = tune_loader(data, "cpu", max_workers=1, duration_s=0.05)
    >>> report.best.num_workers in (0, 1)
    True
    """
    check_source(loader_or_dataset)
    check_tune_arguments(max_workers, duration_s, threshold, batch_size)
    target = resolve_device(device)
    accelerator = target.type not in ("cpu", "mps", "meta")  # where pinned memory helps
    max_workers = usable_cpus() if max_workers is None else max_workers
    if max_workers:  # fail before any measurement, with the fix (not once per setting)
        check_workers_can_unpickle(make_loader(loader_or_dataset, num_workers=max_workers,
                                               batch_size=batch_size))
    started = clock()
    trials: list[LoaderTrial] = []
    while (chosen := _search.next_setting(trials, max_workers=max_workers,
                                                 accelerator=accelerator,
                                                 threshold=threshold)) is not None:
        loader = make_loader(loader_or_dataset, batch_size=batch_size, **chosen)
        try:
            trials.append(time_loader(loader, target, duration_s, None, clock, should_stop))
        except Exception as error:  # a worker's error is data; without workers it is the user's
            if loader.num_workers == 0:
                raise
            trials.append(failed_trial(loader, target, error))
        if on_progress is not None:
            on_progress(trials[-1])
        if trials[-1].cancelled:
            break
    report = loader_report(trials, max_workers=max_workers, search_time_s=clock() - started)
    for note in report.warnings:
        warnings.warn(note, BatchwidgetsWarning, stacklevel=2)
    if step is not None and not trials[-1].cancelled:
        stall = data_stall(make_loader(loader_or_dataset, **report.best.settings), step,
                           device=target, clock=clock)
        report = dataclasses.replace(report, stall=stall)
    return with_data(report, loader_or_dataset)


# NOTE [ Advice that agrees with its warnings ]
# A setting the engine warns about (pin_memory=True with no accelerator, more workers than CPUs,
# workers whose batches overflow /dev/shm, batches pinning cannot reach) is never the one it
# recommends while another setting ran without a warning: tune_loader's and a panel's best rank
# the warned-against trials below every other that ran to its end, and the live autotune fixes
# the settings it was warned about first and never settles on them while another tied. So no
# report or panel shows "best: pin_memory=True" beside "use pin_memory=False".


def with_data(report: LoaderReport, data: Any) -> LoaderReport:
    """``report``, whose ``make_loader()`` builds a DataLoader over ``data`` (the loader or
    dataset measured); the report keeps no field of it (NOTE [ A LoaderReport holds no data ])."""
    return with_factory(report, functools.partial(make_loader, data))


def loader_report(trials: Sequence[LoaderTrial], *, current_index: int | None = None,
                  data: Any = None, max_workers: int | None = None,
                  search_time_s: float = 0.0) -> LoaderReport:
    """A LoaderReport over trials measured so far (``tune_loader``'s, or a panel's).

    With ``data`` (the loader or dataset measured), ``report.make_loader()`` works; the report
    keeps no field of it (NOTE [ A LoaderReport holds no data ]).

    ``best_index`` is the fastest trial that ran to the end (failed and cancelled ones rank
    last, then those warned against: NOTE [ Advice that agrees with its warnings ]);
    ``current_index`` defaults to the best (a panel passes its latest, ``-1``); the
    warnings are the trials', each once; ``grid_size`` counts the full grid for ``max_workers``
    (default the usable CPUs) on the trials' device.
    """
    if not trials:
        raise ValueError("trials should hold at least one LoaderTrial, but got trials=[]; "
                         "measure one with measure_loader first.")
    best = max(range(len(trials)), key=lambda i: (trials[i].ok and not trials[i].cancelled,
                                                   not trials[i].warnings,
                                                   trials[i].samples_per_s))
    device = trials[-1].device
    accelerator = torch.device(device).type not in ("cpu", "mps", "meta")
    workers = usable_cpus() if max_workers is None else max_workers
    report = LoaderReport(
        trials=tuple(trials), best_index=best,
        current_index=best if current_index is None else range(len(trials))[current_index],
        device=device, grid_size=_search.grid_size(workers, accelerator),
        search_time_s=search_time_s,
        warnings=tuple(dict.fromkeys(note for trial in trials for note in trial.warnings)))
    return report if data is None else with_data(report, data)


def _replay(step: TrainStep, batch: Any, n_steps: int, device: torch.device,
            clock: Clock) -> float:
    started = clock()
    for _ in range(n_steps):
        step(batch)
    synchronize(device)
    return (clock() - started) / n_steps


def data_stall(loader: DataLoader | Any, step: TrainStep, *,
               device: torch.device | str | None = None,
               n_steps: int = 20, clock: Clock = time.perf_counter) -> DataStallReport:
    """The share of a training step spent waiting on the input pipeline.

    Times ``n_steps`` of ``step(batch)`` fed by the loader (batches copied to ``device``, after
    as many warm-up steps as batches the workers prefetch, so the queue they filled at start
    does not hide the wait), then ``n_steps`` on one batch replayed from the device; the
    difference per step is the wait. The step runs for real, ``2 * n_steps`` times and more:
    give it a copy of the model if its weights matter. The loader's workers are shut down.

    Parameters
    ----------
    loader : DataLoader or Dataset
        Measured with its own settings (on a copy, see ``make_loader``).
    step : callable
        ``step(batch)``: one training step on a batch already on ``device``.
    device : str or torch.device, optional
        Default the accelerator when present, else the CPU (no copy).
    n_steps : int
        Steps timed with each source of batches.
    clock : callable
        Seconds (injectable for tests).

    Returns
    -------
    DataStallReport

    Examples
    --------
    >>> data = torch.utils.data.TensorDataset(torch.randn(256, 8))
    >>> data_stall(data, lambda batch: batch[0].sum(), n_steps=4).n_steps
    4
    """
    if not callable(step):
        raise TypeError(f"step should be a callable step(batch), but got step={step!r}.")
    check_int("n_steps", n_steps, 1)
    own = make_loader(loader)
    check_workers_can_unpickle(own)
    target = resolve_device(device)
    non_blocking = own.pin_memory and has_accelerator()
    iterator = iter(own)
    try:
        first = copy_batch(next(iterator), target, non_blocking)

        def batches():  # the loader's batches, epoch after epoch
            nonlocal iterator
            while True:
                for batch in iterator:
                    yield copy_batch(batch, target, non_blocking)
                iterator = iter(own)  # an ended epoch stopped its workers, or they persist

        feed = batches()
        step(first)  # warm-up: lazy initialisation, kernel selection
        for _ in range(own.num_workers * (own.prefetch_factor or 0)):
            step(next(feed))
        synchronize(target)
        started = clock()
        for _ in range(n_steps):
            step(next(feed))
        synchronize(target)
        step_time_s = (clock() - started) / n_steps
        replay_s = _replay(step, first, n_steps, target, clock)
    finally:
        shutdown(iterator)
    wait = max(0.0, step_time_s - replay_s)
    return DataStallReport(stall_fraction=wait / step_time_s if step_time_s > 0 else 0.0,
                           step_time_s=step_time_s, replay_step_time_s=replay_s,
                           data_wait_s=wait, n_steps=n_steps, device=str(target))
