"""tune_loader, measure_loader, make_loader and data_stall on the CPU: exact numbers under a fake
clock, the search policy on known throughput functions (no DataLoader), workers always shut
down, errors from workers and unpicklable datasets, warnings with numbers, the report's display."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
import sys
import time
import types
import warnings

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

import batchwidgets as bw
from batchwidgets.engine.loader import DEFAULT_BATCH_SIZE, loader_report, make_loader
from batchwidgets.engine.loader import _checks as _loader_checks
from batchwidgets.engine.loader import _search as _loader_search
from batchwidgets.plots import plot_loader
from batchwidgets.results import DataStallReport, LoaderReport, LoaderTrial

matplotlib.use("Agg")
NO_ACCELERATOR = not torch.accelerator.is_available()


class FakeClock:
    """Time moves only when the data or the step says so (tqdm's DiscreteTimer idea)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TimedDataset(Dataset):
    """Each sample costs ``seconds`` on the fake clock; samples are 4 float32 values (16 B)."""

    def __init__(self, clock: FakeClock, n: int = 1000, seconds: float = 0.01) -> None:
        self.clock, self.n, self.seconds = clock, n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.clock.advance(self.seconds)
        return torch.full((4,), float(i)), i


class SleepyDataset(Dataset):
    """Each sample takes ``seconds`` of wall time (a real, slow pipeline)."""

    def __init__(self, n: int = 64, seconds: float = 0.0) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return torch.full((8,), float(i))


class FailsInWorkers(SleepyDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            raise ValueError(f"cannot open shard {i} in a worker")
        return super().__getitem__(i)


class FailsAt(SleepyDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            raise KeyError(f"sample {i} is missing")
        return super().__getitem__(i)


class Record:
    """A batch type DataLoader cannot pin (no pin_memory method)."""

    def __init__(self, samples: list) -> None:
        self.x = torch.stack(samples)


def collate_records(samples: list) -> Record:
    return Record(samples)


# measure_loader: exact numbers under a fake clock


def test_fake_clock_gives_exact_samples_per_s_and_first_batch_time():
    clock = FakeClock()
    trial = bw.measure_loader(TimedDataset(clock, seconds=0.01), batch_size=4, device="cpu",
                              duration_s=0.2, clock=clock)
    # each batch is 4 samples x 0.01 s: 400 samples/s, 100 batches/s, 4 x 24 bytes per batch
    assert trial.first_batch_s == pytest.approx(0.04)
    assert trial.samples_per_s == pytest.approx(100.0)
    assert trial.batches_per_s == pytest.approx(25.0)
    assert trial.bytes_per_s == pytest.approx(25.0 * 4 * 16 + 25.0 * 4 * 8)
    assert trial.n_samples == 4 * trial.n_batches
    assert trial.duration_s == pytest.approx(trial.n_batches * 0.04)
    assert (trial.num_workers, trial.prefetch_factor, trial.device, trial.ok) == (
        0, None, "cpu", True)


def test_the_timing_window_excludes_the_warm_up_and_stops_at_max_batches():
    clock = FakeClock()
    trial = bw.measure_loader(TimedDataset(clock, seconds=0.5), batch_size=2, device="cpu",
                              duration_s=100.0, max_batches=3, clock=clock)
    assert (trial.n_batches, trial.n_samples) == (3, 6)
    assert trial.first_batch_s == pytest.approx(1.0)
    assert trial.duration_s == pytest.approx(3.0)  # not 4: the first batch is warm-up


def test_an_epoch_that_ends_inside_the_window_is_restarted_and_counted():
    clock = FakeClock()
    trial = bw.measure_loader(TimedDataset(clock, n=10, seconds=0.01), batch_size=5,
                              device="cpu", duration_s=0.3, clock=clock)
    assert trial.n_epoch_ends >= 2
    assert trial.samples_per_s == pytest.approx(100.0)


def test_should_stop_cancels_between_batches():
    clock = FakeClock()
    calls = []
    trial = bw.measure_loader(TimedDataset(clock), batch_size=2, device="cpu", duration_s=10.0,
                              clock=clock, should_stop=lambda: len(calls) >= 2 or calls.append(1))
    assert trial.cancelled
    assert trial.n_batches == 2


@pytest.mark.parametrize(("batch", "samples", "n_bytes"), [
    (torch.zeros(6, 3), 6, 72),
    ((torch.zeros(6, 3), torch.zeros(6, dtype=torch.int64)), 6, 120),
    ({"image": torch.zeros(6, 2, dtype=torch.uint8), "label": torch.zeros(6)}, 6, 36),
    ([torch.zeros(()), torch.zeros(5)], 5, 24),  # a 0-d tensor has no samples to count
])
def test_samples_come_from_the_first_tensor_and_bytes_from_all(batch, samples, n_bytes):
    loader = DataLoader([batch], batch_size=None)  # the dataset yields whole batches
    trial = bw.measure_loader(loader, device="cpu", max_batches=1)
    assert trial.n_samples == samples
    assert trial.bytes_per_s * trial.duration_s == pytest.approx(n_bytes)


def test_a_dataset_is_batched_by_default_batch_size():
    trial = bw.measure_loader(SleepyDataset(n=100), device="cpu", max_batches=1)
    assert trial.batch_size == DEFAULT_BATCH_SIZE == 32
    assert trial.n_samples == 32


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="num_workers should be an int >= 0") as error:
        bw.measure_loader(SleepyDataset(), num_workers=-1)
    assert "num_workers=-1" in str(error.value)
    with pytest.raises(ValueError, match="duration_s should be a positive number"):
        bw.measure_loader(SleepyDataset(), duration_s=0)
    with pytest.raises(ValueError, match="at least one batch"):
        bw.measure_loader(SleepyDataset(n=0), device="cpu")
    with pytest.raises(TypeError, match="should be a DataLoader or a Dataset"):
        bw.measure_loader(42)
    with pytest.raises(ValueError, match=r"prefetch_factor should be an int >= 1 or None, but "
                                         r"got prefetch_factor=True; DataLoader's default is 2\."):
        bw.measure_loader(SleepyDataset(), num_workers=1, prefetch_factor=True)
    with pytest.raises(ValueError, match=r"max_workers should be an int >= 0 or None, but got "
                                         r"max_workers=-1; None means the \d+ usable CPUs\."):
        bw.tune_loader(SleepyDataset(), max_workers=-1)
    with pytest.raises(ValueError, match=r"n_steps should be an int >= 1, but got n_steps=0\."):
        bw.data_stall(SleepyDataset(), lambda batch: None, n_steps=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("call", ["measure_loader", "tune_loader", "data_stall"])
def test_a_device_this_process_cannot_use_is_one_line_before_any_worker_starts(call):
    """device="cuda" without CUDA: torch's AssertionError from the first copy before."""
    arguments = {"data_stall": (lambda batch: None,)}.get(call, ())
    with pytest.raises(ValueError, match=r"device should be a device this process can "
                                         r"train on, but got device='cuda'; available") as error:
        getattr(bw, call)(SleepyDataset(), *arguments, device="cuda")
    assert "\n" not in str(error.value)


# make_loader


def test_make_loader_keeps_data_sampler_collate_and_options_and_changes_the_settings():
    def init(worker_id: int) -> None:
        pass

    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.arange(20.0))
    source = DataLoader(data, batch_size=3, shuffle=True, drop_last=True, collate_fn=list,
                        worker_init_fn=init, generator=generator, timeout=5, num_workers=1,
                        multiprocessing_context="fork")
    loader = make_loader(source, num_workers=2, pin_memory=True, prefetch_factor=4,
                         persistent_workers=True, batch_size=5)
    assert loader.dataset is data
    assert loader.sampler is source.sampler
    assert (loader.collate_fn, loader.worker_init_fn, loader.generator) == (list, init, generator)
    assert (loader.drop_last, loader.timeout) == (True, 5)
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor,
            loader.persistent_workers, loader.batch_size) == (2, True, 4, True, 5)
    same = make_loader(source)
    assert (same.batch_size, same.num_workers) == (3, 1)
    assert make_loader(source, num_workers=0).multiprocessing_context is None  # else rejected


def test_make_loader_keeps_a_batch_sampler_and_drops_worker_options_without_workers():
    batches = [[0, 1], [2, 3, 4]]
    source = DataLoader(TensorDataset(torch.arange(5.0)), batch_sampler=batches, num_workers=2,
                        prefetch_factor=4, persistent_workers=True)
    loader = make_loader(source, num_workers=0)
    assert loader.batch_sampler is batches
    assert loader.batch_size is None
    assert (loader.prefetch_factor, loader.persistent_workers) == (None, False)
    assert [len(b[0]) for b in loader] == [2, 3]
    with pytest.raises(ValueError, match="batch_size should be None for a DataLoader with its"):
        make_loader(source, batch_size=4)
    with pytest.raises(TypeError, match="settings should be among"):
        make_loader(source, shuffle=True)


# the search policy, with no DataLoader at all


def trial_for(setting: dict, samples_per_s: float, bytes_per_batch: float = 1e3,
              batch_size: int = 32, epoch_ends: int = 0) -> LoaderTrial:
    batches = samples_per_s / batch_size
    return LoaderTrial(**setting, batch_size=batch_size, samples_per_s=samples_per_s,
                       batches_per_s=batches, bytes_per_s=batches * bytes_per_batch,
                       first_batch_s=0.1, n_batches=int(batches), n_samples=int(samples_per_s),
                       duration_s=1.0, device="cuda", n_epoch_ends=epoch_ends)


def cpu_heavy(s: dict) -> float:  # 100 samples/s per worker; 14 cores' worth at most
    return 100.0 * min(max(s["num_workers"], 1), 14) * (1.1 if s["pin_memory"] else 1)


def light(s: dict) -> float:  # receiving from workers costs more than loading in place
    return 20000.0 if s["num_workers"] == 0 else 9000.0 + 10 * s["num_workers"]


def large_tensors(s: dict) -> float:  # the copy bounds it: pinning matters most
    rate = min(500.0 * max(s["num_workers"], 1), 1300.0)
    return rate * (1.4 if s["pin_memory"] else 1) * (1.02 if s["prefetch_factor"] == 4 else 1)


def oversubscribed(s: dict) -> float:  # best at 4, worse with more (contention)
    w = s["num_workers"]
    return 300.0 * (max(w, 1) if w <= 4 else 4 - 0.3 * (w - 4))


def short_epochs(s: dict) -> float:  # restarting workers every epoch costs 30%
    w = s["num_workers"]
    return 200.0 * max(w, 1) * (1.0 if s["persistent_workers"] or w == 0 else 0.7)


FUNCTIONS = {"cpu-heavy": (cpu_heavy, 1e3, 0), "light": (light, 1e3, 0),
             "large tensors": (large_tensors, 64e6, 0), "oversubscribed": (oversubscribed, 1e3, 0),
             "short epochs": (short_epochs, 1e3, 3)}


@pytest.mark.parametrize("accelerator", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_search_finds_the_best_within_5_percent_trying_at_most_40_percent(name, accelerator):
    throughput, bytes_per_batch, epoch_ends = FUNCTIONS[name]
    history: list[LoaderTrial] = []
    while (s := _loader_search.next_setting(history, max_workers=16,
                                            accelerator=accelerator)) is not None:
        assert s not in [t.settings for t in history], "a setting was measured twice"
        history.append(trial_for(s, throughput(s), bytes_per_batch, epoch_ends=epoch_ends))
    grid = _loader_search.full_grid(16, accelerator)
    best = max(throughput(s) for s in grid)
    assert max(t.samples_per_s for t in history) >= 0.95 * best
    assert len(history) <= 0.4 * len(grid)


def test_the_search_starts_where_workers_should_keep_up():
    ladder = _loader_search.worker_ladder(16)
    assert ladder == [0, 1, 2, 4, 8, 16]
    # 10 ms per batch with no workers, ~1 ms to receive one: 10 workers, rounded up to 16
    slow = trial_for(_loader_search.setting(0, False), 32 / 0.010)
    assert _loader_search.start_workers(slow, ladder) == 16
    # 3 ms per batch: 3 -> 4; under 1 ms: 1
    assert _loader_search.start_workers(trial_for(_loader_search.setting(0, False), 32 / 0.003),
                                        ladder) == 4
    assert _loader_search.start_workers(trial_for(_loader_search.setting(0, False), 32 / 1e-4),
                                        ladder) == 1


def test_the_grid_and_the_first_steps():
    assert _loader_search.worker_ladder(2) == [0, 1, 2]
    assert _loader_search.worker_ladder(6) == [0, 1, 2, 4, 6]
    assert _loader_search.grid_size(2) == 1 + 2 * 4
    assert _loader_search.grid_size(2, accelerator=True) == 2 * (1 + 2 * 4)
    assert _loader_search.next_setting([], max_workers=2) == {
        "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
        "persistent_workers": False}


def test_failed_worker_trials_count_as_zero_and_the_search_ends():
    base = trial_for(_loader_search.setting(0, False), 32 / 0.01)
    failed = dataclasses.replace(trial_for(_loader_search.setting(4, False), 0.0),
                                 error="ValueError: boom")
    assert _loader_search.next_setting([base, failed], max_workers=4) is None
    assert _loader_search.next_setting([dataclasses.replace(base, error="x")],
                                       max_workers=4) is None


# tune_loader and data_stall on real DataLoaders


def test_tune_loader_measures_a_few_settings_and_reports_the_fastest():
    seen = []
    report = bw.tune_loader(SleepyDataset(n=64, seconds=0.002), "cpu", batch_size=8,
                            max_workers=2, duration_s=0.1, on_progress=seen.append)
    assert isinstance(report, LoaderReport)
    assert list(report.trials) == seen
    assert report.trials[0].num_workers == 0
    assert 2 <= len(report.trials) <= 3 < report.grid_size == 9
    assert report.best == max(report.trials, key=lambda t: t.samples_per_s)
    assert report.current == report.best
    assert report.samples_per_s == report.best.samples_per_s
    loader = report.make_loader(persistent_workers=False)
    assert isinstance(loader, DataLoader)
    assert (loader.num_workers, loader.batch_size) == (report.best.num_workers, 8)
    assert multiprocessing.active_children() == []


def test_tune_loader_with_a_step_reports_the_data_stall_of_the_best_setting():
    report = bw.tune_loader(SleepyDataset(n=64), "cpu", batch_size=8, max_workers=0,
                            duration_s=0.05, step=lambda batch: batch.sum())
    assert len(report.trials) == 1
    assert report.grid_size == 1
    assert isinstance(report.stall, DataStallReport)
    assert 0 <= report.stall.stall_fraction <= 1


def test_data_stall_is_the_share_of_the_step_spent_waiting_on_data():
    clock = FakeClock()
    loader = DataLoader(TimedDataset(clock, seconds=0.005), batch_size=4)
    stall = bw.data_stall(loader, lambda batch: clock.advance(0.01), device="cpu", n_steps=5,
                          clock=clock)
    # a step: 10 ms of compute, plus 4 x 5 ms loading with the real loader
    assert stall.step_time_s == pytest.approx(0.03)
    assert stall.replay_step_time_s == pytest.approx(0.01)
    assert stall.data_wait_s == pytest.approx(0.02)
    assert stall.stall_fraction == pytest.approx(2 / 3)
    assert "67% of each step waits on data" in stall.summary()


def test_data_stall_runs_epoch_after_epoch_with_persistent_workers_and_stops_them():
    loader = DataLoader(SleepyDataset(n=8), batch_size=4, num_workers=1, persistent_workers=True)
    steps = []
    stall = bw.data_stall(loader, steps.append, device="cpu", n_steps=6)
    assert stall.n_steps == 6
    assert len(steps) == 1 + 2 + 6 + 6  # warm-up, the prefetched batches, real, replayed
    assert multiprocessing.active_children() == []
    assert loader._iterator is None  # the user's loader was never iterated


def test_should_stop_ends_tune_loader_with_what_ran():
    report = bw.tune_loader(SleepyDataset(n=64), "cpu", batch_size=8, max_workers=2,
                            duration_s=5.0, should_stop=lambda: True)
    assert len(report.trials) == 1
    assert report.trials[0].cancelled


# workers: always shut down, errors shown, datasets that cannot travel


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def held_elsewhere(names: set[str]) -> set[str]:
    """The names another process (not this one) has open or mapped: under pytest-xdist the other
    worker's spawned processes hold their own ``sem.mp-*`` while this test runs."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = maps.read()
            opened = " ".join(os.readlink(f"/proc/{pid}/fd/{fd}")
                              for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:  # gone, or not ours to read
            continue
        held |= {name for name in names if f"/dev/shm/{name}" in mapped + opened}
    return held


def test_after_100_toggles_no_worker_process_and_no_shared_memory_is_left():
    before = shm_entries()
    data = TensorDataset(torch.randn(64, 16))
    settings = [{"num_workers": w, "persistent_workers": p, "prefetch_factor": f}
                for w in (1, 0, 2) for p in (True, False) for f in (2, 4)]
    for i in range(100):
        bw.measure_loader(data, **settings[i % len(settings)], batch_size=4, device="cpu",
                          duration_s=0.005, max_batches=2)
    assert multiprocessing.active_children() == []
    time.sleep(0.1)
    left = shm_entries() - before
    assert left - held_elsewhere(left) == set()


def test_a_worker_error_is_raised_unchanged_and_the_workers_are_gone():
    with pytest.raises(KeyError) as error:
        bw.measure_loader(FailsAt(), num_workers=1, batch_size=2, device="cpu")
    assert "sample 3 is missing" in str(error.value)
    assert "DataLoader worker process 0" in str(error.value)
    assert multiprocessing.active_children() == []


def test_tune_loader_records_settings_whose_workers_fail_and_goes_on():
    report = bw.tune_loader(FailsInWorkers(n=64), "cpu", batch_size=8, max_workers=2,
                            duration_s=0.05)
    failed = [t for t in report.trials if not t.ok]
    assert failed
    assert all(t.num_workers > 0 for t in failed)
    assert failed[0].error == ("ValueError: cannot open shard 0 in a worker (in a DataLoader "
                               "worker)")
    assert failed[0].samples_per_s == 0.0
    assert report.best.num_workers == 0
    assert "ValueError: cannot open shard 0 in a worker" in report._repr_html_()


def test_tune_loader_raises_when_loading_fails_without_workers_too():
    with pytest.raises(KeyError, match="sample 3 is missing"):
        bw.tune_loader(FailsAt(), "cpu", batch_size=2, max_workers=1, duration_s=0.05)


def test_a_dataset_that_spawned_workers_cannot_unpickle_gets_the_fix_not_a_traceback():
    class LocalDataset(Dataset):  # like a class defined in a notebook
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(2)

    loader = DataLoader(LocalDataset(), batch_size=2, num_workers=1,
                        multiprocessing_context="spawn")
    with pytest.raises(TypeError) as error:
        bw.measure_loader(loader, num_workers=2, device="cpu")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("dataset should be picklable for DataLoader workers started by "
                              "'spawn', but got dataset=<")
    assert "move the Dataset class into a .py module and import it" in message
    assert "or use num_workers=0" in message
    assert "multiprocessing_context='fork'" in message
    assert bw.measure_loader(loader, num_workers=0, device="cpu", max_batches=1).ok
    with pytest.raises(TypeError, match="should be picklable"):
        bw.tune_loader(loader, "cpu", max_workers=1)
    assert multiprocessing.active_children() == []


class NotebookDataset(SleepyDataset):
    pass


def test_a_class_from_an_interactive_main_is_caught_although_pickle_accepts_it(monkeypatch):
    notebook_main = types.ModuleType("__main__")  # a notebook's __main__ has no __file__
    notebook_main.NotebookDataset = NotebookDataset
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)
    monkeypatch.setattr(NotebookDataset, "__module__", "__main__")
    pickle.dumps(NotebookDataset())  # fine here; a spawned worker could not import it
    loader = DataLoader(NotebookDataset(), num_workers=1, multiprocessing_context="forkserver")
    with pytest.raises(TypeError, match=r"\(NotebookDataset is defined in the notebook"):
        _loader_checks.check_workers_can_unpickle(loader)


def test_collate_fn_lambda_under_spawn_is_named():
    loader = DataLoader(SleepyDataset(), num_workers=1, collate_fn=lambda b: b,
                        multiprocessing_context="spawn")
    with pytest.raises(TypeError, match="collate_fn should be picklable"):
        _loader_checks.check_workers_can_unpickle(loader)


# warnings with numbers


def test_more_workers_than_cpus_is_a_warning_with_the_numbers():
    cpus = _loader_checks.usable_cpus()
    with pytest.warns(bw.BatchwidgetsWarning, match=f"num_workers={cpus + 1} is more than the "
                                                    f"{cpus} CPUs") as record:
        trial = bw.measure_loader(SleepyDataset(), num_workers=cpus + 1, batch_size=4,
                                  device="cpu", max_batches=1)
    assert any(w.filename == __file__ for w in record)  # stacklevel=2: the user's line
    assert any("use at most" in note for note in trial.warnings)


@pytest.mark.skipif(not NO_ACCELERATOR, reason="pinning works here")
def test_pin_memory_without_an_accelerator_and_unpinnable_batches_are_warned_about():
    loader = DataLoader(SleepyDataset(), batch_size=4, collate_fn=collate_records)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trial = bw.measure_loader(loader, pin_memory=True, device="cpu", max_batches=1)
    ours = [str(w.message) for w in record if w.category is bw.BatchwidgetsWarning]
    assert any("pin_memory=True does nothing here" in note for note in ours)
    assert any("leaves batches of type Record unpinned" in note for note in ours)
    assert len(trial.warnings) == 2


def test_shm_too_small_for_the_batches_in_flight_is_a_warning_with_the_numbers():
    mib = 2**20
    note = _loader_checks.shm_warning(100 * mib, 4, 2, free_bytes=64 * mib)
    assert note.startswith("/dev/shm has 64 MiB free, but 4 workers x prefetch_factor 2 x "
                           "100.0 MiB per batch keep about 800 MiB in flight there")
    assert _loader_checks.shm_warning(1 * mib, 4, 2, free_bytes=64 * mib) is None
    assert _loader_checks.shm_warning(100 * mib, 0, None, free_bytes=64 * mib) is None


# the report


def report_for_display() -> LoaderReport:
    trials = tuple(trial_for(_loader_search.setting(w, False), r)
                   for w, r in ((0, 1000.0), (2, 2500.0), (1, 1800.0)))
    trials += (dataclasses.replace(trial_for(_loader_search.setting(4, False), 0.0),
                                   error="ValueError: <boom>"),)
    return LoaderReport(trials=trials, best_index=1, current_index=2, device="cpu", grid_size=9,
                        search_time_s=3.2, warnings=("num_workers=4 is more than the 2 CPUs",))


def test_the_report_renders_as_escaped_html_with_a_plot_and_a_summary():
    report = report_for_display()
    page = report._repr_html_()
    assert "ValueError: &lt;boom&gt;" in page
    assert "<boom>" not in page
    assert "4 of 9 in the full grid" in page
    assert "2.50x" in page
    assert "current setting" in page
    assert 'src="data:image/png;base64,' in page
    assert report.summary() == ("best: 2 workers, prefetch 2 at 2.5e+03 samples/s, 2.5x no "
                                "workers (4 of 9 settings tried in 3.2 s on cpu)")
    assert report == pickle.loads(pickle.dumps(report))
    with pytest.raises(ValueError, match=r"call batchwidgets.make_loader\(data, "
                                         r"\*\*report.best.settings\)"):
        report.make_loader()


def test_plot_loader_draws_samples_per_s_per_setting_with_the_best_highlighted():
    report = report_for_display()
    figure = plot_loader(report)
    assert isinstance(figure, Figure)
    ax = figure.axes[0]
    widths = [bar.get_width() for bar in ax.patches]
    assert widths == [1000.0, 2500.0, 1800.0, 0.0]
    assert ax.patches[1].get_facecolor() == matplotlib.colors.to_rgba("tab:green")
    assert ax.patches[3].get_facecolor() == matplotlib.colors.to_rgba("tab:red")
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["no workers",
                                                                "2 workers, prefetch 2"]
    assert ax.get_xlabel() == "samples/s (steady state, warm-up excluded)"
    assert any("first batch 0.10 s" in t.get_text() for t in ax.texts)
    assert math.isclose(ax.patches[2].get_linewidth(), 1.5)  # the current setting, outlined


def test_loader_report_builds_a_panel_report_from_trials_measured_one_by_one():
    trials = report_for_display().trials
    report = loader_report(trials, current_index=-1, max_workers=2,
                           data=TensorDataset(torch.zeros(4, 1)))
    assert (report.best_index, report.current_index) == (1, 3)
    assert report.grid_size == 18  # the trials copied to "cuda": pin_memory doubles the grid
    assert report.current.summary() == "4 workers, prefetch 2: failed: ValueError: <boom>"
    assert report.best.summary() == "2 workers, prefetch 2: 2.5e+03 samples/s, first batch " \
                                    "after 0.100 s"
    assert report.make_loader().num_workers == 2
    with pytest.raises(ValueError, match="trials should hold at least one"):
        loader_report([])


# Reports are plain data: no field holds the data measured (NOTE [ A LoaderReport holds no data ])


class Marked(TensorDataset):
    """A dataset whose pickle and deep copy would show: both are counted."""

    copies = 0

    def __reduce_ex__(self, protocol):
        Marked.copies += 1
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        Marked.copies += 1
        return self


def test_a_tuned_report_keeps_no_data_but_still_makes_its_loader():
    data = Marked(torch.zeros(64, 4))
    report = bw.tune_loader(data, "cpu", max_workers=0, duration_s=0.02)
    assert [field.name for field in dataclasses.fields(report)] == [
        "trials", "best_index", "current_index", "device", "grid_size", "search_time_s",
        "warnings", "stall"]
    Marked.copies = 0
    as_dict = dataclasses.asdict(report)
    pickled = pickle.dumps(report)
    assert Marked.copies == 0  # neither copied nor pickled the data
    assert len(pickled) < 5_000  # the 64x4 floats would be 1,024 bytes alone, plus the class
    assert b"Marked" not in pickled
    assert data not in as_dict.values()
    loader = report.make_loader(batch_size=16)
    assert loader.dataset is data
    assert loader.batch_size == 16
    assert bw.make_loader(data, **report.best.settings).num_workers == report.best.num_workers
    assert report == pickle.loads(pickled)


def test_a_report_without_its_data_says_to_call_bw_make_loader():
    data = TensorDataset(torch.zeros(8, 1))
    report = loader_report([trial_for(_loader_search.setting(0, False), 100.0)], data=data)
    assert report.make_loader().dataset is data
    for lost in (pickle.loads(pickle.dumps(report)), dataclasses.replace(report),
                 LoaderReport(**{f.name: getattr(report, f.name)
                                 for f in dataclasses.fields(report)})):
        assert lost == report
        with pytest.raises(ValueError, match="report should come from tune_loader") as error:
            lost.make_loader()
        assert "\n" not in str(error.value)
        assert str(error.value).endswith("call batchwidgets.make_loader(data, "
                                         "**report.best.settings).")
    assert "data" not in repr(report).replace("DataStall", "")


def test_make_loader_takes_the_data_positionally_and_only_known_settings():
    data = TensorDataset(torch.zeros(8, 1))
    assert bw.make_loader is make_loader
    assert bw.make_loader(data, batch_size=4).batch_size == 4
    with pytest.raises(TypeError, match="settings should be among"):
        bw.make_loader(data, data=data)

