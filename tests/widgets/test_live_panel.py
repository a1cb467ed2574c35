"""LoaderPanel(live) driven as a user would, while a real training loop iterates the live loader:
a control's ``.value`` set between batches (as the comm poller dispatches a click) or from another
thread switches the loop at its next batch, the order stays the plain DataLoader's, the readout
shows the loop's own numbers, bad settings are one line with the control put back, and close()
leaves no thread. PyTorch's DataLoader is the oracle of the order."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchwidgets as bw
from batchwidgets.results import LiveLoaderReport
from batchwidgets.widgets import WIDGET_VIEW, _controls

WAIT_S = 60
REFRESHER = "batchwidgets-live-panel"


def data(n: int = 48) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.arange(n) % 3)


def shuffled(seed: int = 0, **settings) -> DataLoader:
    return DataLoader(data(), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(seed), **settings)


def order(loader, epochs: int = 1) -> list[list[int]]:
    return [batch[0].reshape(-1).int().tolist() for _ in range(epochs) for batch in loader]


def refreshers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == REFRESHER]


@pytest.fixture
def panels():
    """Panels (and their live loaders) made by a test, closed afterwards even when it fails."""
    made: list[bw.LoaderPanel] = []

    def make(live, **kwargs) -> bw.LoaderPanel:
        made.append(bw.LoaderPanel(live, **kwargs))
        return made[-1]
    yield make
    for panel in made:
        panel.close()
        if isinstance(panel.loader, bw.LiveLoader):
            panel.loader.close()
    assert refreshers() == []
    assert multiprocessing.active_children() == []


def train(live, on_batch=lambda i: None) -> list[list[int]]:
    """A real training loop over ``live``: a tiny model, one SGD step a batch."""
    torch.manual_seed(0)
    model = nn.Linear(1, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for i, (x, y) in enumerate(live):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(x.reshape(-1).int().tolist())
        on_batch(i)
    return seen


def test_the_panel_of_a_live_loader_is_bound_to_it_and_starts_at_its_settings(panels):
    live = bw.live_loader(shuffled(num_workers=1, prefetch_factor=4, persistent_workers=True))
    panel = panels(live)
    assert isinstance(panel, bw.LoaderPanel)
    assert panel.loader is live
    assert (panel.num_workers.value, panel.pin_memory.value, panel.prefetch_factor.value,
            panel.persistent_workers.value, panel.batch_size.value) == (1, False, 4, True, 4)
    assert panel.batch_size.disabled
    assert not panel.prefetch_factor.disabled
    assert isinstance(panel.autotune, _controls.Checkbox)
    assert panel.autotune.value is False
    assert isinstance(panel.report, LiveLoaderReport)
    assert panel.report == live.report
    assert panel.report.n_batches == 0
    assert "no batch drawn yet" in panel.readout.value
    assert len(refreshers()) == 1
    assert type(panel) is bw.LoaderPanel  # one class in both modes (issue 37)
    plain = panels(data(), start=False)  # a Dataset still gets the measuring panel
    assert type(plain) is bw.LoaderPanel
    assert isinstance(plain.autotune, _controls.Button)


def test_a_control_set_between_batches_switches_the_loop_at_the_next_batch_in_order(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live, refresh_s=0.001)  # a refresher racing the clicks, the switches
    changes = {2: ("num_workers", 2), 5: ("prefetch_factor", 4), 7: ("num_workers", 0)}

    def click(i: int) -> None:  # what the poller does with a click, between two batches
        if i in changes:
            name, value = changes[i]
            getattr(panel, name).value = value

    assert train(live, click) == order(shuffled())
    switches = live.report.switches
    assert [(s.batch, s.new["num_workers"], s.new["prefetch_factor"], s.by)
            for s in switches] == [(3, 2, 2, "set"), (6, 2, 4, "set"), (8, 0, None, "set")]
    assert [s.settings["num_workers"] for s in live.report.segments] == [0, 2, 2, 0]
    assert (panel.num_workers.value, panel.prefetch_factor.value) == (0, None)
    assert panel.prefetch_factor.disabled
    # the next epoch, with the settings in force, is still the plain loader's second epoch
    panel.num_workers.value = 1
    assert train(live) == order(shuffled(), epochs=2)[len(live):]
    assert live.num_workers == 1
    assert panel.report == live.report


def test_a_control_set_from_another_thread_mid_loop_lands_at_the_next_batch(panels):
    live = bw.live_loader(shuffled(seed=3))
    panel = panels(live)

    def from_elsewhere(i: int) -> None:
        if i == 3:
            other = threading.Thread(target=setattr, args=(panel.num_workers, "value", 1))
            other.start()
            other.join(WAIT_S)

    assert train(live, from_elsewhere) == order(shuffled(seed=3))
    (switch,) = live.report.switches
    assert (switch.batch, switch.old["num_workers"], switch.new["num_workers"]) == (4, 0, 1)
    assert switch.cost_s > 0


def test_the_readout_follows_the_loop_from_the_refresher_while_it_runs(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live, refresh_s=0.01)
    updated = threading.Event()
    threads: set[str] = set()

    def seen(change: dict) -> None:
        threads.add(threading.current_thread().name)
        if "waiting, 5 batches" in change["new"]:
            updated.set()
    panel.readout.observe(seen, names="value")

    def step(i: int) -> None:
        if i == 1:
            panel.num_workers.value = 1
        if i == 4:  # the loop has drawn 5 batches and runs on: the refresher shows them
            assert updated.wait(WAIT_S)

    train(live, step)
    assert REFRESHER in threads
    report = panel.refresh()
    current = report.current
    assert report == live.report
    assert f">{current.samples_per_s:,.0f}</span> samples/s" in panel.readout.value
    assert f">{current.stall_fraction:.0%}</span> of its time waiting" in panel.readout.value
    assert f">{report.samples_per_s:,.0f}</span>" in panel.readout.value
    assert "num_workers=1, pin_memory=False, prefetch_factor=2" in panel.readout.value
    assert "no workers -&gt; 1 worker, prefetch 2 (set; the next batch waited" \
        in panel.readout.value
    assert panel.status.value == report.summary()
    assert bytes(panel.chart.value).startswith(b"\x89PNG")
    bundle = panel._repr_mimebundle_()
    assert WIDGET_VIEW in bundle
    assert bundle["text/plain"] == report.summary()  # the static copy: the loop's report
    assert "the loop&#x27;s own numbers, per setting" in bundle["text/html"]


def test_a_switch_waiting_for_the_next_batch_is_shown_as_such(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live)
    epoch = iter(live)
    next(epoch)
    panel.num_workers.value = 2
    panel.refresh()
    assert 'from the next batch: <span class="batchwidgets-loader-requested">num_workers=2' \
        in panel.readout.value
    assert live.num_workers == 0  # in force: still none, until the next batch
    panel.num_workers.value = 1  # changed again before the next batch: only the latest counts
    panel.refresh()
    assert '<span class="batchwidgets-loader-requested">num_workers=1' in panel.readout.value
    next(epoch)
    panel.refresh()
    assert "from the next batch" not in panel.readout.value
    assert live.num_workers == 1
    assert [s.new["num_workers"] for s in live.report.switches] == [1]
    epoch.close()


class LocalDataset(TensorDataset):  # made unpicklable below, like a class in a notebook
    pass


def test_a_bad_setting_is_one_line_in_the_panel_and_the_control_goes_back(panels):
    dataset = LocalDataset(torch.arange(8.0))
    dataset.transform = lambda x: x  # no worker started by spawn can receive it
    live = bw.live_loader(dataset, batch_size=2, multiprocessing_context="spawn")
    panel = panels(live)
    epoch = iter(live)
    first = next(epoch)
    panel.num_workers.value = 2
    assert isinstance(panel.error, TypeError)
    assert panel.status.value.startswith("TypeError: dataset should be picklable for DataLoader "
                                         "workers started by 'spawn'")
    assert "\n" not in panel.status.value
    assert panel.num_workers.value == 0
    assert panel.prefetch_factor.disabled
    assert live.num_workers == 0
    assert [first[0].tolist(), *(b[0].tolist() for b in epoch)] == [[0, 1], [2, 3], [4, 5],
                                                                   [6, 7]]
    assert live.report.switches == ()
    panel.pin_memory.value = True  # a good change clears the error
    assert panel.error is None
    assert live.pin_memory is True


def test_the_controls_follow_settings_asked_for_by_code(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live)
    live.set(num_workers=1, prefetch_factor=3)  # 3: not offered by the dropdown until now
    panel.refresh()
    assert (panel.num_workers.value, panel.prefetch_factor.value) == (1, 3)
    assert 3 in [value for _, value in panel.prefetch_factor.options]
    assert train(live) == order(shuffled())
    assert [(s.batch, s.new["prefetch_factor"]) for s in live.report.switches] == [(0, 3)]
    live.set(num_workers=0)
    panel.refresh()
    assert (panel.num_workers.value, panel.prefetch_factor.value) == (0, None)
    assert panel.prefetch_factor.disabled


def test_the_autotune_checkbox_turns_it_on_and_a_control_by_hand_turns_it_off(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live)
    panel.autotune.value = True
    assert live.autotune is True
    assert panel.error is None
    train(live)
    panel.refresh()
    assert panel.autotune.value is live.autotune
    assert {s.by for s in live.report.switches} <= {"autotune"}  # never set back by the panel
    assert {k: getattr(panel, k).value for k in live.requested} == live.requested
    panel.num_workers.value = 1 if live.requested["num_workers"] != 1 else 0
    assert live.autotune is False
    assert panel.autotune.value is False


def test_close_stops_the_refresher_and_leaves_the_loader_to_its_owner():
    live = bw.live_loader(shuffled(), num_workers=1, persistent_workers=True)
    panel = bw.LoaderPanel(live, refresh_s=0.01)
    assert len(refreshers()) == 1
    epoch = iter(live)
    next(epoch)
    panel.close()
    assert refreshers() == []
    assert len(list(epoch)) == len(live) - 1  # the loop goes on
    live.close()
    assert multiprocessing.active_children() == []


def test_bad_panel_arguments_are_one_line():
    live = bw.live_loader(data())
    with pytest.raises(ValueError, match=r"refresh_s should be a positive number") as error:
        bw.LoaderPanel(live, refresh_s=0)
    assert "\n" not in str(error.value)
    for name, value in (("device", "cpu"), ("batch_size", 8)):
        with pytest.raises(ValueError, match=f"{name} should be None for a live loader") as error:
            bw.LoaderPanel(live, **{name: value})
        assert f"{name}={value!r}" in str(error.value)
    assert refreshers() == []


def test_the_panel_polls_the_kernel_between_the_loops_batches_until_it_is_closed(panels):
    live = bw.live_loader(shuffled())
    panel = panels(live)
    assert live._on_batch == (panel._between_batches,)  # the engine's hook, not its import
    panel.close()
    assert live._on_batch == ()
    assert train(live) == order(shuffled())


def test_where_the_kernel_cannot_be_polled_one_warning_points_at_the_training_loop(
        panels, monkeypatch):
    import types

    import IPython

    from batchwidgets import BatchwidgetsWarning

    measuring = panels(data(), duration_s=0.02, max_workers=1)  # its warnings are its own
    measuring.wait()
    pytest.importorskip("ipykernel")  # imported: with a shell that has a kernel, polling starts
    kernel = types.SimpleNamespace(shell_stream=None)  # a kernel whose internals are unknown
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=kernel))
    live = bw.live_loader(shuffled())
    panels(live)
    with pytest.warns(BatchwidgetsWarning, match="apply when it ends") as caught:
        train(live)
    assert [warning.filename for warning in caught] == [__file__]  # the loop's line, once
