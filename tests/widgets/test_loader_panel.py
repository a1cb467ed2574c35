"""LoaderPanel driven as a user would: widget ``.value``s and ``.click()`` on real DataLoaders over
tiny datasets, measured off the main thread; workers and shared memory never left behind."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import re
import threading
import time

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    TensorDataset,
    get_worker_info,
)

import batchwidgets as bw
from batchwidgets.datasets import SlowDataset
from batchwidgets.engine.loader import loader_report
from batchwidgets.results import LoaderReport
from batchwidgets.widgets import WIDGET_VIEW

WAIT_S = 60
FAST = {"duration_s": 0.02, "max_workers": 2}
NO_ACCELERATOR = not torch.accelerator.is_available()


def tiny() -> TensorDataset:
    return TensorDataset(torch.arange(64.0).reshape(32, 2), torch.arange(32))


class SleepyDataset(Dataset):
    """Each sample takes ``seconds`` of wall time: measurements that are still running."""

    def __init__(self, n: int = 64, seconds: float = 0.002) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.full((4,), float(i))


class FailsInWorkers(SleepyDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            raise ValueError(f"cannot open shard {i}")
        return super().__getitem__(i)


def shm_entries() -> set[str]:
    """Shared memory that DataLoader workers and multiprocessing leave when not cleaned up."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith(("torch_", "sem.mp"))}


class Seen:
    """Records a widget's values and the threads that set them."""

    def __init__(self, widget) -> None:
        self.values: list = []
        self.threads: set[threading.Thread] = set()
        widget.observe(self, names="value")

    def __call__(self, change: dict) -> None:
        self.values.append(change["new"])
        self.threads.add(threading.current_thread())


@pytest.fixture
def panels():
    """Panels made by a test, closed afterwards even when it fails."""
    made: list[bw.LoaderPanel] = []

    def make(*args, **kwargs) -> bw.LoaderPanel:
        made.append(bw.LoaderPanel(*args, **kwargs))
        return made[-1]
    yield make
    for panel in made:
        panel.close()
    assert multiprocessing.active_children() == []


def test_the_controls_start_from_the_loaders_options(panels):
    loader = DataLoader(tiny(), batch_size=8, num_workers=1, prefetch_factor=4,
                        persistent_workers=True)
    panel = panels(loader, start=False, **FAST)
    assert (panel.num_workers.value, panel.pin_memory.value, panel.prefetch_factor.value,
            panel.persistent_workers.value, panel.batch_size.value) == (1, False, 4, True, 8)
    assert not panel.prefetch_factor.disabled
    assert not panel.persistent_workers.disabled
    assert panel.report is None
    assert panel.status.value == "ready"
    dataset = panels(tiny(), start=False, **FAST)
    assert dataset.settings == {"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
                                "persistent_workers": False, "batch_size": 32}
    assert dataset.prefetch_factor.disabled
    assert dataset.prefetch_factor.label == "default"  # not an empty dropdown
    assert dataset.persistent_workers.disabled
    assert list(dataset.num_workers.options) == [0, 1, 2]


def test_without_workers_prefetch_factor_and_persistent_workers_are_none_and_disabled(panels):
    panel = panels(tiny(), start=False, **FAST)
    panel.num_workers.value = 2
    panel.prefetch_factor.value = 4
    panel.persistent_workers.value = True
    assert panel.settings["prefetch_factor"] == 4
    assert panel.settings["persistent_workers"] is True
    panel.num_workers.value = 0
    assert (panel.prefetch_factor.value, panel.persistent_workers.value) == (None, False)
    assert panel.prefetch_factor.label == "default"
    assert panel.prefetch_factor.disabled
    assert panel.persistent_workers.disabled
    panel.wait(WAIT_S)
    assert panel.report.current.settings == {"num_workers": 0, "pin_memory": False,
                                             "prefetch_factor": None,
                                             "persistent_workers": False, "batch_size": 32}


def test_a_changed_control_is_measured_off_the_main_thread_and_shown(panels):
    panel = panels(tiny(), **FAST)
    readout = Seen(panel.readout)
    first = panel.wait(WAIT_S)
    assert first.current.num_workers == 0
    panel.num_workers.value = 1
    report = panel.wait(WAIT_S)
    assert isinstance(report, LoaderReport)
    assert report.current.num_workers == 1
    assert report.samples_per_s == report.current.samples_per_s > 0
    assert [t.num_workers for t in report.trials] == [0, 1]
    assert threading.main_thread() not in readout.threads
    assert f">{report.samples_per_s:,.0f}</span> samples/s" in panel.readout.value
    assert f">{report.current.first_batch_s:.3f} s</span>" in panel.readout.value
    assert panel.status.value.startswith(f"1 worker, prefetch 2: {report.samples_per_s:,.0f}")
    assert bytes(panel.chart.value).startswith(b"\x89PNG")
    assert panel.error is None


def test_quick_changes_return_at_once_and_only_the_latest_setting_is_measured(panels):
    panel = panels(SleepyDataset(), batch_size=16, start=False, duration_s=0.5)
    renders = Seen(panel.chart)
    started = time.perf_counter()
    for batch_size in [*range(2, 22), 5]:
        panel.batch_size.value = batch_size
    assert time.perf_counter() - started < 1.0  # each callback only queues the request
    report = panel.wait(WAIT_S)
    assert report.current.batch_size == 5
    assert len(renders.values) <= 2  # the one in flight stops early, unrendered
    assert len(report.trials) == len(renders.values)


def test_measuring_the_same_setting_again_replaces_it_in_the_report(panels):
    panel = panels(tiny(), start=False, **FAST)
    panel.measure()
    panel.num_workers.value = 1
    panel.wait(WAIT_S)
    panel.num_workers.value = 0
    report = panel.wait(WAIT_S)
    assert [t.num_workers for t in report.trials] == [0, 1]
    assert report.current_index == 0
    assert panel.measure().current_index == 0


def test_after_100_toggles_no_worker_process_and_no_shared_memory_is_left(panels):
    before = shm_entries()
    panel = panels(tiny(), batch_size=4, **FAST)
    for i in range(100):
        if i % 2:
            panel.num_workers.value = (1, 2, 0)[i // 2 % 3]
        else:
            panel.persistent_workers.value = not panel.persistent_workers.value
        if i % 10 == 9:  # let some measurements finish, cancel the others mid-way
            panel.wait(WAIT_S)
    report = panel.wait(WAIT_S)
    assert panel.error is None
    assert multiprocessing.active_children() == []
    assert shm_entries() - before == set()
    assert any(t.num_workers and t.persistent_workers for t in report.trials)
    current = report.current
    assert (current.num_workers, current.persistent_workers) == (
        panel.num_workers.value, panel.settings["persistent_workers"])


def test_the_panels_loader_has_the_current_settings_and_belongs_to_the_caller(panels):
    panel = panels(tiny(), start=False, **FAST)
    panel.num_workers.value = 1
    panel.persistent_workers.value = True
    panel.batch_size.value = 4
    panel.wait(WAIT_S)
    assert multiprocessing.active_children() == []  # the measurements shut their workers down
    loader = panel.loader
    assert isinstance(loader, DataLoader)
    assert (loader.num_workers, loader.persistent_workers, loader.batch_size) == (1, True, 4)
    assert panel.loader is not loader  # a new one each time
    assert multiprocessing.active_children() == []  # the panel never iterates it
    first = next(iter(loader))
    assert first[0].shape == (4, 2)
    assert len(multiprocessing.active_children()) == 1  # the caller's persistent worker
    del loader, first
    gc.collect()  # dropping the DataLoader stops its workers, as for any DataLoader
    deadline = time.monotonic() + WAIT_S
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


def test_a_worker_that_raises_shows_its_error_and_the_next_setting_works(panels):
    panel = panels(FailsInWorkers(seconds=0), batch_size=4, **FAST)
    before = panel.wait(WAIT_S)  # no workers: it loads
    panel.num_workers.value = 2
    assert panel.wait(WAIT_S) is before  # wait() raises nothing; the report is unchanged
    assert isinstance(panel.error, ValueError)
    assert re.fullmatch(r"ValueError: cannot open shard \d+ \(in a DataLoader worker\)",
                        panel.status.value)
    assert not panel.autotune.disabled
    assert '"batchwidgets-loader-samples-per-s">-</span>' in panel.readout.value
    assert multiprocessing.active_children() == []
    panel.num_workers.value = 0
    report = panel.wait(WAIT_S)
    assert panel.error is None
    assert report.current.num_workers == 0
    assert report.samples_per_s > 0


class LocalTensors(Dataset):
    """Pickled by reference, so a spawned worker could import it; made unpicklable below."""

    def __init__(self) -> None:
        self.transform = lambda x: x  # a lambda: no worker started by spawn can receive it

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(torch.zeros(2))


def test_a_dataset_spawned_workers_cannot_unpickle_is_a_one_line_error(panels):
    loader = DataLoader(LocalTensors(), batch_size=2, num_workers=1,
                        multiprocessing_context="spawn")
    panel = panels(loader, **FAST)
    panel.wait(WAIT_S)
    assert isinstance(panel.error, TypeError)
    assert panel.status.value.startswith("TypeError: dataset should be picklable for "
                                         "DataLoader workers started by 'spawn'")
    assert "\n" not in panel.status.value
    panel.num_workers.value = 0  # no workers, nothing to pickle
    assert panel.wait(WAIT_S).current.num_workers == 0


def test_autotune_sets_the_controls_to_the_best_setting_without_measuring_again(panels):
    panel = panels(tiny(), start=False, duration_s=0.05, max_workers=1)
    renders, status = Seen(panel.chart), Seen(panel.status)
    panel.autotune.click()
    report = panel.wait(WAIT_S)
    assert len(report.trials) >= 2
    assert report.current_index == report.best_index
    assert panel.settings == {**report.best.settings, "batch_size": 32}
    assert len(renders.values) == len(report.trials) + 1  # one per trial, then the best
    assert any(v.startswith("auto-tuning: no workers ran at") for v in status.values)
    assert threading.main_thread() not in renders.threads
    assert report.grid_size > len(report.trials)
    assert not panel.autotune.disabled
    assert multiprocessing.active_children() == []


def agrees_with_its_report(panel) -> bool:
    """The controls hold the report's current setting, which is its best, and the readout and
    the status line show that setting's samples/s."""
    report = panel.report
    rate = f"{report.best.samples_per_s:,.0f}"
    return (report.current_index == report.best_index
            and panel.settings == {"batch_size": None, **report.best.settings}
            and f">{rate}</span> samples/s" in panel.readout.value
            and panel.status.value.startswith(f"{report.best.label}: {rate} samples/s; best "
                                              f"so far: {report.best.label}, {rate}"))


def test_after_autotune_the_controls_readout_and_report_show_the_same_best_setting(panels):
    panel = panels(tiny(), start=False, duration_s=0.05, max_workers=1)
    panel.num_workers.value = 1
    panel.prefetch_factor.value = 8  # outside tune_loader's grid: kept in the panel's report
    earlier = panel.wait(WAIT_S).current
    panel.autotune.click()
    report = panel.wait(WAIT_S)
    assert earlier in report.trials
    assert agrees_with_its_report(panel)


def test_a_setting_measured_before_autotune_that_ran_faster_stays_the_best_shown(panels):
    panel = panels(tiny(), start=False, duration_s=0.05, max_workers=1)
    fast = dataclasses.replace(  # a setting tune_loader never tries, faster than any it does
        bw.measure_loader(tiny(), device="cpu", max_batches=1), num_workers=1,
        prefetch_factor=8, samples_per_s=1e12)
    panel.render(loader_report([fast], max_workers=1))
    panel.autotune.click()
    report = panel.wait(WAIT_S)
    assert len(report.trials) >= 3
    assert report.best == fast
    assert (panel.num_workers.value, panel.prefetch_factor.value) == (1, 8)
    assert agrees_with_its_report(panel)
    assert report.make_loader().prefetch_factor == 8


def test_a_control_changed_during_autotune_stops_it_and_measures_the_new_setting(panels):
    panel = panels(SleepyDataset(seconds=0.001), start=False, duration_s=0.2, max_workers=2)
    tuning = threading.Event()
    panel.chart.observe(lambda _change: tuning.set(), names="value")
    panel.autotune.click()
    assert tuning.wait(WAIT_S)  # the first trial is in the chart
    panel.batch_size.value = 8
    report = panel.wait(WAIT_S)
    assert report.current.batch_size == 8
    assert panel.settings["batch_size"] == 8
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(not NO_ACCELERATOR, reason="pin_memory does something here")
def test_the_engines_warnings_are_shown_in_the_panel(panels):
    panel = panels(tiny(), start=False, **FAST)
    panel.pin_memory.value = True
    report = panel.wait(WAIT_S)
    assert any("pin_memory=True does nothing here" in w for w in report.warnings)
    assert "pin_memory=True does nothing here" in panel.messages.value
    panel.pin_memory.value = False
    assert "pin_memory=True does nothing here" in panel.wait(WAIT_S).warnings[0]  # kept


def test_a_loader_with_its_own_batch_sampler_keeps_it(panels):
    sampler = BatchSampler(SequentialSampler(range(32)), batch_size=5, drop_last=False)
    panel = panels(DataLoader(tiny(), batch_sampler=sampler), **FAST)
    assert panel.batch_size.disabled
    assert panel.settings["batch_size"] is None
    report = panel.wait(WAIT_S)
    assert panel.error is None
    assert report.current.batch_size is None
    assert panel.loader.batch_sampler is sampler


def test_close_stops_the_measurement_in_flight(panels):
    panel = panels(SleepyDataset(seconds=0.01), duration_s=30, max_workers=1)
    panel.num_workers.value = 1
    started = time.perf_counter()
    panel.close()
    assert time.perf_counter() - started < 10
    assert multiprocessing.active_children() == []
    panel.num_workers.value = 0  # a closed panel measures nothing
    assert panel.wait(1) is None


def test_the_panel_displays_live_with_the_static_report_as_fallback(panels):
    panel = panels(tiny(), start=False, **FAST)
    bundle = panel._repr_mimebundle_()
    assert bundle["text/html"] == "<p>batchwidgets: ready</p>"
    assert bundle[WIDGET_VIEW]["model_id"] == panel.model_id
    report = panel.measure()
    bundle = panel._repr_mimebundle_()
    assert bundle["text/html"] == report._repr_html_()
    assert bundle["text/plain"] == report.summary()


def test_the_parts_have_css_classes_for_stylesheets_and_browser_tests(panels):
    panel = panels(tiny(), start=False, **FAST)
    assert panel.css_name == "loader"  # the front end: "batchwidgets-loader" on the panel
    laid_out = [name for section in panel.layout_spec for name in section["parts"]]
    assert sorted(laid_out) == sorted(panel.parts)  # every part drawn, once
    for control, part in [(panel.readout, "readout"), (panel.chart, "chart"),
                          (panel.status, "status"), (panel.autotune, "autotune"),
                          (panel.num_workers, "num_workers"),
                          (panel.persistent_workers, "persistent_workers")]:
        assert panel.controls[part] is control  # "batchwidgets-loader-num-workers", ...


def test_slow_dataset_is_deterministic_and_costs_cpu():
    data = SlowDataset(16, shape=(3, 8, 8), rounds=200)
    image, label = data[7]
    assert torch.equal(image, SlowDataset(16, shape=(3, 8, 8), work_ms=0)[7][0])
    assert label == 7
    assert not torch.equal(image, data[8][0])
    started = time.thread_time()
    data[0]
    assert time.thread_time() - started > 0
    with pytest.raises(ValueError, match="n should be >= 1"):
        SlowDataset(0)
    with pytest.raises(IndexError):
        data[16]
