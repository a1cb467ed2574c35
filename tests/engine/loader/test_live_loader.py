"""live_loader on the CPU: the wrapped DataLoader's batches and order, epoch after epoch, across
switches made mid-epoch (from the loop, another thread, attribute assignment); worker seeds and
generators as PyTorch draws them; workers always shut down; bad settings refused at set() with
the loader carrying on; the loop's own numbers in the report. PyTorch's DataLoader is the oracle."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    get_worker_info,
)

import batchwidgets as bw
from batchwidgets import BatchwidgetsWarning

pytestmark = pytest.mark.usefixtures("pythons_ctrl_c")  # some tests press Ctrl-C


class Noisy(Dataset):
    """Each sample carries a draw from the loading process's torch RNG: worker seeds show."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(i), "noise": torch.randint(0, 2**30, ())}


class Stream(IterableDataset):
    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(torch.arange(self.n, dtype=torch.float32)[start::step])


class DiesAt(Dataset):
    """A worker process that dies (as by the OOM killer) when it loads sample ``at``."""

    def __init__(self, n: int = 32, at: int = 20) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at and get_worker_info() is not None:
            os._exit(1)
        return torch.tensor(float(i))


def indices(batch) -> list[int]:
    if isinstance(batch, dict):
        return batch["index"].reshape(-1).tolist()
    if isinstance(batch, (list, tuple)):
        return batch[0].reshape(-1).tolist()
    return batch.reshape(-1).tolist()


SWITCHES = {2: {"num_workers": 2}, 5: {"num_workers": 1, "prefetch_factor": 4},
            7: {"num_workers": 0}, 9: {"num_workers": 2, "persistent_workers": True}}


def run_epochs(loader, epochs: int, switches=None, set_epoch: bool = False):
    out = []
    for epoch in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        batches = []
        for i, batch in enumerate(loader):
            batches.append(indices(batch))
            if switches and i in switches:
                loader.set(**switches[i])
        out.append(batches)
    return out


def make(kind: str, seed: int = 0) -> DataLoader:
    data = TensorDataset(torch.arange(60))
    generator = torch.Generator().manual_seed(seed)
    if kind == "shuffle":
        return DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    if kind == "drop_last":
        return DataLoader(data, batch_size=4, shuffle=True, drop_last=True, generator=generator)
    if kind == "batch_sampler":
        sampler = RandomSampler(data, generator=generator)
        return DataLoader(data, batch_sampler=BatchSampler(sampler, 3, drop_last=False))
    if kind == "no_batching":
        return DataLoader(data, batch_size=None, shuffle=True, generator=generator)
    if kind == "distributed":
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(
            data, num_replicas=2, rank=1, shuffle=True, seed=seed))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["shuffle", "drop_last", "batch_sampler", "no_batching",
                                  "distributed"])
def test_the_batches_and_order_of_the_wrapped_loader_across_switches_epoch_after_epoch(kind):
    want = run_epochs(make(kind), 3, set_epoch=kind == "distributed")
    live = bw.live_loader(make(kind))
    got = run_epochs(live, 3, SWITCHES, set_epoch=kind == "distributed")
    assert got == want
    assert len(live.report.switches) >= 3
    live.close()
    assert multiprocessing.active_children() == []


def test_the_global_generator_is_drawn_as_the_wrapped_loader_draws_it():
    data = TensorDataset(torch.arange(30))
    torch.manual_seed(7)
    want = run_epochs(DataLoader(data, batch_size=4, shuffle=True), 2)
    after = torch.rand(3)
    torch.manual_seed(7)
    live = bw.live_loader(data, batch_size=4, shuffle=True)
    assert run_epochs(live, 2, SWITCHES) == want
    assert torch.equal(torch.rand(3), after)  # the switches drew nothing from the user's RNG
    live.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_seeds_are_the_wrapped_loaders_with_its_starting_settings(persistent):
    def loader():
        return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=persistent,
                          generator=torch.Generator().manual_seed(3))
    reference = loader()
    want = [[batch["noise"].tolist() for batch in reference] for _ in range(2)]
    del reference
    live = bw.live_loader(loader())
    got = [[batch["noise"].tolist() for batch in live] for _ in range(2)]
    assert got == want
    live.close()
    assert multiprocessing.active_children() == []


class BaseSeeds(Dataset):
    """Each sample is the base seed of the worker that loads it (worker k seeds base + k)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor(info.seed - info.id)


def test_new_workers_of_a_later_epoch_keep_the_persistent_loaders_one_base_seed():
    # a persistent DataLoader draws its workers' base seed once, in epoch 0; workers started
    # by a switch in epoch 1 were seeded from a draw of epoch 1 the DataLoader never makes
    def loader():
        return DataLoader(BaseSeeds(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True, generator=torch.Generator().manual_seed(3))
    reference = loader()
    want = {int(seed) for _ in range(2) for batch in reference for seed in batch}
    del reference
    assert len(want) == 1
    live = bw.live_loader(loader())
    got = set()
    for epoch in range(2):
        for i, batch in enumerate(live):
            got.update(int(seed) for seed in batch)
            if (epoch, i) == (1, 2):
                live.set(prefetch_factor=4)  # new workers, as many, for the rest of epoch 1
    assert len(live.report.switches) == 1
    assert got == want
    live.close()
    assert multiprocessing.active_children() == []


def test_a_switch_between_epochs_stops_kept_workers_it_does_not_keep_at_once():
    live = bw.live_loader(make("shuffle"), num_workers=2, persistent_workers=True)
    run_epochs(live, 1)
    assert len(multiprocessing.active_children()) == 2  # kept for the next epoch
    live.set(num_workers=0)  # between epochs: in force now, so the kept workers go now
    assert multiprocessing.active_children() == []
    assert sorted(i for batch in run_epochs(live, 1)[0] for i in batch) == list(range(60))
    assert multiprocessing.active_children() == []
    live.close()


@pytest.mark.parametrize(("settings", "message"), [
    ({"prefetch_factor": 4}, "prefetch_factor should be None with num_workers=0"),
    ({"persistent_workers": True}, "persistent_workers should be False with num_workers=0"),
])
def test_what_only_workers_take_given_without_workers_is_refused_as_dataloader_does(
        settings, message):
    with pytest.raises(ValueError, match=message) as error:
        bw.live_loader(TensorDataset(torch.arange(8)), batch_size=2, **settings)
    assert "e.g. live_loader(data, num_workers=2" in str(error.value)
    with pytest.raises(ValueError, match="num_workers"):  # the oracle: DataLoader refuses them
        DataLoader(TensorDataset(torch.arange(8)), batch_size=2, **settings)
    # a wrapped loader's own are dropped with its workers, as set(num_workers=0) drops them
    assert bw.live_loader(DataLoader(TensorDataset(torch.arange(8)), num_workers=2,
                                     prefetch_factor=4), num_workers=0).prefetch_factor is None


def test_a_switch_from_another_thread_lands_at_the_next_batch_without_losing_the_place():
    live = bw.live_loader(make("shuffle"))
    want = run_epochs(make("shuffle"), 1)[0]
    got, asked = [], threading.Event()
    for i, batch in enumerate(live):
        got.append(indices(batch))
        if i == 1:
            thread = threading.Thread(target=lambda: (live.set(num_workers=1), asked.set()))
            thread.start()
            thread.join()
    assert asked.is_set()
    assert got == want
    (switch,) = live.report.switches
    assert (switch.epoch, switch.batch) == (0, 2)
    assert switch.old["num_workers"] == 0
    assert switch.new == {"num_workers": 1, "pin_memory": False, "prefetch_factor": 2,
                          "persistent_workers": False}
    assert switch.cost_s > 0
    assert live.num_workers == 1


def test_it_is_used_where_the_dataloader_was():
    source = make("distributed")
    live = bw.live_loader(source)
    assert isinstance(live, DataLoader)
    assert len(live) == len(source) == 8
    assert live.dataset is source.dataset
    assert live.sampler is source.sampler
    assert live.batch_size == 4
    live.sampler.set_epoch(1)
    assert run_epochs(live, 1) == run_epochs(source, 1)


def test_assigning_a_setting_switches_it_as_set_does():
    live = bw.live_loader(make("shuffle"))
    live.num_workers = 2  # between epochs: in force now
    live.pin_memory = False
    assert live.num_workers == 2
    assert live.prefetch_factor == 2
    assert run_epochs(live, 1) == run_epochs(make("shuffle"), 1)
    live.close()


def test_switching_to_zero_workers_drops_what_only_workers_take():
    live = bw.live_loader(make("shuffle"), num_workers=2, prefetch_factor=4,
                          persistent_workers=True)
    live.set(num_workers=0)
    assert run_epochs(live, 1) == run_epochs(make("shuffle"), 1)
    assert live.settings == {"num_workers": 0, "pin_memory": False, "prefetch_factor": None,
                             "persistent_workers": False}
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_workers": -1}, "num_workers should be an int >= 0, but got num_workers=-1"),
    ({"num_workers": 0, "prefetch_factor": 4},
     "prefetch_factor should be None with num_workers=0"),
    ({"persistent_workers": True}, "persistent_workers should be False with num_workers=0"),
    ({"pin_memory": "yes"}, "pin_memory should be True or False"),
    ({"batch_size": 8}, "settings should be among"),
])
def test_bad_settings_are_one_line_errors_and_the_loader_carries_on(settings, message):
    live = bw.live_loader(make("shuffle"))
    got = []
    for i, batch in enumerate(live):
        got.append(indices(batch))
        if i == 1:
            with pytest.raises((ValueError, TypeError)) as error:
                live.set(**settings)
            assert message in str(error.value)
            assert "\n" not in str(error.value)
    assert got == run_epochs(make("shuffle"), 1)[0]
    assert live.report.switches == ()


def test_a_dataset_spawned_workers_cannot_unpickle_is_refused_at_set():
    class LocalDataset(TensorDataset):  # like a class defined in a notebook
        pass

    live = bw.live_loader(LocalDataset(torch.arange(8)), batch_size=2,
                          multiprocessing_context="spawn")
    with pytest.raises(TypeError, match="dataset should be picklable for DataLoader workers "
                                        "started by 'spawn'"):
        live.set(num_workers=2)
    assert live.num_workers == 0
    assert [indices(b) for b in live] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_worker_that_dies_mid_epoch_raises_in_the_loop_and_leaves_nothing_running():
    live = bw.live_loader(DiesAt(), batch_size=2)
    # PyTorch raises RuntimeError, EOFError or ConnectionError, by when it notices; we raise one.
    with pytest.raises(RuntimeError, match="exited unexpectedly"):  # noqa: PT012
        for i, _ in enumerate(live):
            if i == 1:
                live.set(num_workers=2)
    assert multiprocessing.active_children() == []


def test_breaking_out_keeps_persistent_workers_and_close_stops_them():
    live = bw.live_loader(make("shuffle"), num_workers=1, persistent_workers=True)
    for i, _ in enumerate(live):
        if i == 2:
            break
    assert len(multiprocessing.active_children()) == 1
    reference = DataLoader(live.dataset, batch_size=4, shuffle=True, num_workers=1,
                           persistent_workers=True, generator=torch.Generator().manual_seed(0))
    for i, _ in enumerate(reference):  # the oracle: a DataLoader, broken off alike
        if i == 2:
            break
    assert run_epochs(live, 1) == run_epochs(reference, 1)
    reference._iterator._shutdown_workers()
    assert len(multiprocessing.active_children()) == 1  # the same worker, next epoch
    live.close()
    assert multiprocessing.active_children() == []


def test_on_batch_runs_before_each_batch_with_its_place_and_can_be_removed():
    live = bw.live_loader(TensorDataset(torch.arange(12)), batch_size=4)
    places = []

    def callback(epoch: int, batch: int) -> None:
        places.append((epoch, batch))
    live.on_batch(callback)
    assert [indices(b) for b in live] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert places == [(0, 0), (0, 1), (0, 2), (0, 3)]  # the last: the epoch's end
    live.on_batch(callback, remove=True)
    list(live)
    assert len(places) == 4
    with pytest.raises(TypeError, match="callback should be a function of") as error:
        live.on_batch("poll")
    assert "callback='poll'" in str(error.value)


def test_what_on_batch_raises_ends_the_epoch_and_stops_its_workers():
    live = bw.live_loader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2)

    def fails(epoch: int, batch: int) -> None:
        if batch == 3:
            raise ValueError("the callback failed")
    live.on_batch(fails)
    with pytest.raises(ValueError, match="the callback failed") as error:
        for _ in live:
            pass
    assert error.value.__traceback__ is not None  # held, and still nothing runs
    assert multiprocessing.active_children() == []
    live.on_batch(fails, remove=True)
    assert len(list(live)) == 10  # the next epoch runs whole
    live.close()


def test_an_iterable_dataset_switches_at_the_next_epoch_and_says_so():
    live = bw.live_loader(Stream(), batch_size=5)
    first = []
    for i, batch in enumerate(live):
        first.append(indices(batch))
        if i == 1:
            with pytest.warns(BatchwidgetsWarning, match="IterableDataset cannot resume at a"):
                live.set(num_workers=2)
    assert live.num_workers == 0
    assert [i for batch in first for i in batch] == list(range(24))
    second = [indices(b) for b in live]
    assert live.num_workers == 2
    assert sorted(i for batch in second for i in batch) == list(range(24))
    (switch,) = live.report.switches
    assert (switch.epoch, switch.batch) == (1, 0)
    assert "next epoch" in switch.note
    live.close()


def test_the_report_is_the_loops_own_time_per_setting():
    class Slow(TensorDataset):
        def __getitem__(self, i):
            time.sleep(0.004)
            return super().__getitem__(i)

    live = bw.live_loader(Slow(torch.arange(24)), batch_size=2)
    for i, _ in enumerate(live):
        time.sleep(0.002)  # the step
        if i == 5:
            live.set(num_workers=2)
    report = live.report
    assert report.n_batches == 12
    assert report.n_samples == 24
    assert [s.n_batches for s in report.segments] == [6, 6]
    first, second = report.segments
    assert first.settings["num_workers"] == 0
    assert second.settings["num_workers"] == 2
    assert (second.epoch, second.batch) == (0, 6)
    assert report.samples_per_s == pytest.approx(24 / report.wall_s)
    assert report.stall_fraction == pytest.approx(report.wait_s / report.wall_s)
    # each batch waited >= 8 ms of loading without workers, the step took >= 2 ms
    assert first.stall_fraction > 0.5
    assert first.step_s >= 0.001  # 5 steps of 2 ms over 6 batches
    assert report.current is second
    assert "2 workers" in report.summary()
    assert "switch" in report._repr_html_()
    live.close()


def test_no_worker_process_or_shared_memory_is_left_after_many_switches():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    live = bw.live_loader(TensorDataset(torch.randn(64, 16)), batch_size=2)
    options = [{"num_workers": 1}, {"num_workers": 2, "persistent_workers": True},
               {"num_workers": 0}, {"num_workers": 2, "prefetch_factor": 1}]
    pids = {os.getpid()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _epoch in range(2):
            for i, _ in enumerate(live):
                live.set(**options[i % len(options)])
                pids |= {child.pid for child in multiprocessing.active_children()}
    live.close()
    assert multiprocessing.active_children() == []
    time.sleep(0.1)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # torch names a segment after the process that made it (torch_<pid>_...); other processes
    # on the machine (a CI run beside this one) come and go in /dev/shm too
    assert len(pids) > 2
    assert {name for name in after - before if any(f"_{pid}_" in name for pid in pids)} == set()


def test_workers_started_by_spawn_switch_with_the_order_kept_and_the_cost_said():
    threads = threading.active_count()
    live = bw.live_loader(TensorDataset(torch.arange(60)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(0),
                          multiprocessing_context="spawn")
    got = run_epochs(live, 1, {1: {"num_workers": 1}, 6: {"num_workers": 0}})
    assert got == run_epochs(make("shuffle"), 1)
    first, _back = live.report.switches
    assert first.cost_s > first.shutdown_s >= 0  # a new interpreter per worker: seconds, said
    live.close()
    assert multiprocessing.active_children() == []
    # a closed worker queue's feeder thread ends on its own, a moment after the close
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads


# -- an abandoned epoch (issue 41) ---------------------------------------------------------------

class SlowSteps(TensorDataset):
    """Batches that take a moment to load, so workers are busy when the loop leaves."""

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return super().__getitem__(i)


def worker_leftovers(threads_before: set[int], shm_before: set[str], pids: set[int]) -> dict:
    """What is still there of an epoch's workers: processes, threads of this process started
    since (queue feeders, the pin-memory thread), shared-memory segments of its workers."""
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {"processes": [child.pid for child in multiprocessing.active_children()],
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.ident not in threads_before),
            "shm": sorted(name for name in shm - shm_before
                          if any(f"_{pid}_" in name for pid in pids))}


def settled(leftovers, within_s: float = 1.0) -> dict:
    deadline = time.monotonic() + within_s
    found = leftovers()
    while any(found.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
        found = leftovers()
    return found


def abandon(loader, how: str, pids: set[int]) -> object:
    """Leave an epoch of ``loader`` after 3 batches, as ``how`` says; return what a notebook
    would keep afterwards (the exception, with its traceback and the frames it holds)."""
    def step(i: int) -> None:
        pids.update(child.pid for child in multiprocessing.active_children())
        if i == 2 and how == "exception":
            raise ValueError("the step failed")
        if i == 2 and how == "interrupt":
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the step runs
            time.sleep(1)  # the interrupt lands here, in the loop's body

    if how == "del":
        epoch = iter(loader)
        for i in range(3):
            next(epoch)
            step(i)
        del epoch
        return None
    try:
        for i, _ in enumerate(loader):
            step(i)
            if i == 2:
                break
    except (ValueError, KeyboardInterrupt) as error:
        return error
    return None


@pytest.mark.parametrize("how", ["break", "del", "exception", "interrupt"])
@pytest.mark.parametrize("make_loader", [DataLoader, bw.live_loader], ids=["plain", "live"])
def test_an_abandoned_epoch_leaves_no_worker_thread_or_shared_memory_within_a_second(
        make_loader, how):
    threads_before = {t.ident for t in threading.enumerate()}
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    loader = make_loader(SlowSteps(torch.randn(64, 8)), batch_size=4, num_workers=2,
                         pin_memory=torch.cuda.is_available())  # a pin-memory thread too
    pids: set[int] = set()
    try:
        kept = abandon(loader, how, pids)
        assert len(pids) == 2  # the epoch did run on two worker processes
        if how in ("exception", "interrupt"):
            assert kept.__traceback__ is not None  # held, as a notebook holds it
        leftovers = settled(lambda: worker_leftovers(threads_before, shm_before, pids))
        assert leftovers == {"processes": [], "threads": [], "shm": []}
    finally:  # the loader itself lives on, as in a notebook; only then closed
        if isinstance(loader, bw.LiveLoader):
            loader.close()


@pytest.mark.parametrize("make_loader", [DataLoader, bw.live_loader], ids=["plain", "live"])
def test_breaking_out_keeps_persistent_workers_as_a_dataloader_does(make_loader):
    loader = make_loader(SlowSteps(torch.randn(64, 8)), batch_size=4, num_workers=2,
                         persistent_workers=True)
    try:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        time.sleep(0.2)
        assert len(multiprocessing.active_children()) == 2
    finally:
        if isinstance(loader, bw.LiveLoader):
            loader.close()
        else:
            loader._iterator._shutdown_workers()
    assert multiprocessing.active_children() == []


class Slower(TensorDataset):
    def __getitem__(self, i: int):
        time.sleep(0.1)
        return super().__getitem__(i)


def test_ctrl_c_while_the_loop_waits_for_a_batch_stops_the_workers_while_the_traceback_lives():
    # A plain DataLoader keeps them then: the traceback holds its iterator's frames.
    live = bw.live_loader(Slower(torch.arange(64)), batch_size=2, num_workers=2)
    press = threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT))
    try:
        press.start()
        with pytest.raises(KeyboardInterrupt) as interrupted:
            for _ in live:
                pass  # the loop waits in next() nearly all the time
        frames = []
        traceback = interrupted.value.__traceback__
        while traceback is not None:
            frames.append(traceback.tb_frame.f_code.co_name)
            traceback = traceback.tb_next
        assert "_next" in frames  # it landed while the loop waited for a batch
        assert settled(lambda: {"processes": multiprocessing.active_children()}) == {
            "processes": []}
    finally:
        press.cancel()
        live.close()
