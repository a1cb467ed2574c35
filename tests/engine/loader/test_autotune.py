"""live_loader(autotune=True): the policy on simulated loops whose samples/s is a known function
of the settings (with the start-up and bursts of fresh workers, and noise), then a real live
loader over a dataset whose items cost real CPU: it leaves num_workers=0, keeps the wrapped
loader's batches and order, and leaves no worker behind."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from _sim_loader import BATCH, SimLoop, cpu_bound, start
from torch.utils.data import DataLoader, Dataset

import batchwidgets as bw
from batchwidgets.engine.loader import usable_cpus
from batchwidgets.engine.loader._autotune import Autotune


def test_from_no_workers_it_jumps_to_the_workers_that_keep_up_with_the_step():
    # loading a batch takes 30 ms of a core, the step 15 ms: two workers keep up
    tuner = Autotune(start(), max_workers=4, pin_memory=False)
    advice = SimLoop(cpu_bound(load_s=0.03, step_s=0.015), step_s=0.015).run(tuner, start())
    assert advice == [start(2, 2)]
    assert tuner.done
    # the judged samples/s is the steady state's, the start-up and the free burst left out
    assert tuner.best.samples_per_s == pytest.approx(BATCH / 0.015)
    assert "settled on 2 workers, prefetch 2" in tuner.status
    assert "stall under 5%" in tuner.status


def test_from_workers_it_climbs_the_ladder_to_the_fastest_and_settles_there():
    tuner = Autotune(start(1, 2), max_workers=4, pin_memory=False)
    advice = SimLoop(cpu_bound()).run(tuner, start(1, 2))
    # the loop waits in every period: the workers are too slow, prefetching more cannot help
    assert advice == [start(2, 2), start(4, 2)]
    assert tuner.done
    assert tuner.best.settings == start(4, 2)
    assert tuner.best.samples_per_s == pytest.approx(BATCH / 0.02)
    assert "settled on 4 workers, prefetch 2" in tuner.status


def test_where_the_loop_waits_now_and_then_a_deeper_prefetch_is_tried_and_kept_if_faster():
    def cost(settings):  # one slow batch in four: a deeper queue absorbs it, up to a point
        if settings["num_workers"] < 2:
            return 0.04
        return {2: 0.02, 4: 0.016, 8: 0.024}[settings["prefetch_factor"]]
    tuner = Autotune(start(2, 2), max_workers=2, pin_memory=False)
    advice = SimLoop(cost, every=4).run(tuner, start(2, 2))
    assert advice == [start(1, 2), start(2, 4), start(2, 8), start(2, 4)]
    assert tuner.best.settings == start(2, 4)
    # lumps and all (a trial of ~9 periods holds a part of a lump's cycle: within 15%)
    assert tuner.best.samples_per_s == pytest.approx(BATCH / 0.016, rel=0.15)
    assert tuner.done


def test_turned_on_in_the_middle_of_a_segment_it_judges_from_the_next_batch():
    tuner = Autotune(start(), max_workers=4, pin_memory=False)
    loop = SimLoop(cpu_bound(load_s=0.03, step_s=0.015), step_s=0.015)
    assert loop.run(tuner, start(), first=50) == [start(2, 2)]
    assert tuner.trials[0].samples_per_s == pytest.approx(BATCH / 0.045)


def test_each_epochs_restart_of_the_workers_is_left_out_as_a_switchs_is():
    tuner = Autotune(start(), max_workers=4, pin_memory=False)
    loop = SimLoop(cpu_bound(load_s=0.03, step_s=0.015), step_s=0.015, startup_s=0.5, epoch=5)
    assert loop.run(tuner, start()) == [start(2, 2)]
    assert tuner.best.samples_per_s == pytest.approx(BATCH / 0.015)


def test_where_a_switch_takes_over_a_second_only_num_workers_is_tried():
    tuner = Autotune(start(1, 2), max_workers=4, pin_memory=True)
    advice = SimLoop(cpu_bound(), startup_s=1.5).run(tuner, start(1, 2))  # as with spawn
    assert advice == [start(2, 2), start(4, 2)]  # no prefetch_factor, no pin_memory trial
    assert tuner.done
    assert tuner.switch_s >= 1.5


def test_it_stops_exploring_once_the_loop_hardly_waits():
    tuner = Autotune(start(), max_workers=4, pin_memory=False)
    advice = SimLoop(cpu_bound(load_s=0.02, step_s=0.03), step_s=0.03).run(tuner, start())
    assert advice == [start(1, 2)]  # one worker keeps up: no more trials
    assert tuner.done
    assert tuner.best.stall_fraction < 0.05
    assert "stall under 5%" in tuner.status


def test_a_loop_that_does_not_wait_keeps_the_users_setting():
    tuner = Autotune(start(2, 2), max_workers=4, pin_memory=False)
    advice = SimLoop(lambda settings: 0.01).run(tuner, start(2, 2))
    assert advice == []
    assert tuner.done
    assert tuner.best.settings == start(2, 2)


def test_fewer_workers_that_tie_are_followed_down_to_no_workers():
    # each batch from a worker costs the main process 30 ms (large tensors out of shared
    # memory): workers only slow the loop, whatever their number
    def cost(settings):
        return 0.015 if settings["num_workers"] == 0 else 0.035
    tuner = Autotune(start(2, 2), max_workers=2, pin_memory=False)
    advice = SimLoop(cost, step_s=0.005).run(tuner, start(2, 2))
    assert [a["num_workers"] for a in advice] == [1, 0]  # 1 ties 2: workers are not the limit
    assert tuner.best.settings == start(0)
    assert tuner.done


@pytest.mark.parametrize(("max_workers", "first"), [(1, 8), (3, 0), (2, 2)])
def test_never_more_workers_than_max_workers(max_workers, first):
    # the start itself may have more (the user's): it is not advised
    tuner = Autotune(start(first, 2), max_workers=max_workers, pin_memory=False)
    advice = SimLoop(cpu_bound(load_s=0.2, cores=16)).run(tuner, start(first, 2))
    assert advice
    assert all(a["num_workers"] <= max_workers for a in advice if a != start(first, 2))
    assert advice[0]["num_workers"] == min(max_workers, 1 if first else 8)  # a rung, or a jump


@pytest.mark.parametrize("cuda", [False, True])
def test_pin_memory_is_tried_only_with_cuda(cuda):
    def cost(settings):  # pinned batches copy faster: the loop runs 20% faster
        return cpu_bound()(settings) * (0.8 if settings["pin_memory"] else 1.0)
    tuner = Autotune(start(), max_workers=4, pin_memory=cuda)
    advice = SimLoop(cost).run(tuner, start())
    assert any(a["pin_memory"] for a in advice) == cuda
    assert tuner.best.settings["pin_memory"] == cuda


def test_the_users_persistent_workers_are_kept():
    first = start(1, 2, persistent_workers=True)
    tuner = Autotune(first, max_workers=4, pin_memory=False)
    advice = SimLoop(cpu_bound()).run(tuner, first)
    assert advice
    assert all(a["persistent_workers"] for a in advice if a["num_workers"])


@pytest.mark.parametrize("seed", range(5))
def test_noise_never_makes_it_oscillate(seed):
    # every setting equally fast, the loop waiting 80% of its time, each wait +-50%
    tuner = Autotune(start(), max_workers=4, pin_memory=True)
    loop = SimLoop(lambda settings: 0.05, noise=0.5, seed=seed)
    advice = loop.run(tuner, start(), batches=5000)
    assert tuner.done
    assert len({tuple(a.values()) for a in advice}) == len(advice) - (
        advice[-1] in advice[:-1])  # each setting tried once, then back to the best at most
    assert len(advice) <= tuner.max_trials
    assert loop.run(tuner, advice[-1], batches=500) == []  # settled: no more advice


def test_with_noise_it_still_finds_the_clearly_fastest_setting():
    for seed in range(5):
        tuner = Autotune(start(), max_workers=4, pin_memory=False)
        SimLoop(cpu_bound(), noise=0.2, seed=seed).run(tuner, start())
        assert tuner.best.settings["num_workers"] == 4


class CpuItems(Dataset):
    """Each item costs real CPU (a Python loop of ~0.3 ms), as decoding and augmenting do."""

    def __init__(self, n: int = 400) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        acc = 0
        for k in range(3000):
            acc += (k * i) % 7
        return torch.tensor([i, acc])


def test_a_real_live_loader_moves_off_zero_workers_with_the_same_batches_and_nothing_left():
    make = lambda: DataLoader(CpuItems(), batch_size=8, shuffle=True,  # noqa: E731
                              generator=torch.Generator().manual_seed(3))
    live = bw.live_loader(make(), autotune=True)
    oracle = make()
    epochs = 0
    while not live.report.switches and epochs < 40:  # the first trial takes ~0.3 s
        want = [batch[:, 0].tolist() for batch in oracle]
        got = []
        for batch in live:
            got.append(batch[:, 0].tolist())
            torch.ones(64, 64).sum()  # the step: next to loading, almost nothing
        assert got == want
        epochs += 1
    switch = live.report.switches[0]
    assert (switch.by, switch.old["num_workers"]) == ("autotune", 0)
    assert 1 <= switch.new["num_workers"] <= usable_cpus()
    assert live.autotune_status.startswith(("exploring", "settled"))
    want = [batch[:, 0].tolist() for batch in oracle]  # one more epoch, with workers
    assert [batch[:, 0].tolist() for batch in live] == want
    live.close()
    assert multiprocessing.active_children() == []
    live.set(num_workers=0)  # by hand: autotune is off
    assert not live.autotune
    assert live.autotune_status == ""


def epochs_while_autotune(live, most: int = 40) -> list[list[list[int]]]:
    epochs = []
    while live.autotune and len(epochs) < most:
        epochs.append([batch[:, 0].tolist() for batch in live])
    return epochs


def test_workers_that_could_not_unpickle_the_dataset_stop_autotune_not_the_loop():
    class LocalItems(CpuItems):  # like a class defined in a notebook: spawn cannot send it
        pass

    live = bw.live_loader(LocalItems(), batch_size=8, autotune=True,
                          multiprocessing_context="spawn")
    want = [list(range(i, min(i + 8, 400))) for i in range(0, 400, 8)]
    with pytest.warns(bw.BatchwidgetsWarning, match="autotune stopped: dataset should be "
                                                    "picklable"):
        epochs = epochs_while_autotune(live)  # the first trial takes ~0.3 s, then is refused
    assert all(got == want for got in epochs)
    assert not live.autotune
    assert live.num_workers == 0
    assert live.report.switches == ()
    assert any("autotune stopped" in text for text in live.report.warnings)
