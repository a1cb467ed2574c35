"""The live loader in a real kernel (issue 24): a LoaderPanel's num_workers dropdown changed by a
panel message sent while the training cell runs (as a click in the browser is) switches the loop
at its next batch, mid-epoch, with the plain DataLoader's order kept; on both ipykernel lines,
and with ipywidgets 7.7 beside ipykernel 6 as on Colab."""

from __future__ import annotations

import ast

import pytest
from test_kernel_poll import outputs, read_until, start_kernel

SETUP = """
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
import batchwidgets as bw

data = TensorDataset(torch.arange(600))
live = bw.live_loader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
panel = bw.LoaderPanel(live, max_workers=2)
import ipykernel, ipywidgets
print(panel.model_id, ipykernel.__version__[0], ipywidgets.__version__[0],
      panel.num_workers.options)
"""
TRAINING = """
seen, workers = [], []
for i, (x,) in enumerate(live):  # 150 batches, about 20 ms each
    seen.append(x.tolist())
    workers.append(live.num_workers)
    if i == 3:
        print("start", flush=True)
    time.sleep(0.02)
plain = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
switches = live.report.switches
print("order", seen == [x.tolist() for (x,) in plain])
print("switches", [(s.epoch, s.batch, s.new["num_workers"]) for s in switches])
print("workers", workers.count(0), workers.count(2), len(seen), flush=True)
panel.close()
live.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("line", ["7", "6", "6+widgets7"])
def test_a_click_while_the_training_cell_runs_switches_the_loop_at_its_next_batch(line):
    pytest.importorskip("jupyter_client")
    manager, client = start_kernel(line)
    try:
        model_id, kernel, widgets, options = outputs(client, SETUP).strip().split(" ", 3)
        assert (kernel, widgets) == {"7": ("7", "8"), "6": ("6", "8"),
                                     "6+widgets7": ("6", "7")}[line]
        assert options == "(0, 1, 2)"
        training = client.execute(TRAINING)
        iopub: list[dict] = []
        read_until(client, iopub, "start")
        # What the panel's front end (static/panel.js) sends when "2" is chosen in the dropdown:
        # a custom message with the option's position.
        client.shell_channel.send(client.session.msg("comm_msg", content={
            "comm_id": model_id, "data": {"method": "custom", "content": {
                "event": "set", "name": "num_workers", "value": 2}}}))
        read_until(client, iopub, "workers")
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream"
                       and m["parent_header"].get("msg_id") == training)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert "order True" in text, text
    switches = ast.literal_eval(text.split("switches ", 1)[1].splitlines()[0])
    assert len(switches) == 1, text
    epoch, batch, workers = switches[0]
    assert (epoch, workers) == (0, 2)
    assert 4 <= batch < 150, text  # mid-loop, not when the cell ended
    n_zero, n_two, n_batches = map(int, text.split("workers ", 1)[1].split()[:3])
    assert (n_zero, n_two, n_batches) == (batch, 150 - batch, 150)


# -- widget messages over kernel subshells (issue 37) --------------------------------------------

SUBSHELL_SETUP = """
import threading
import time
import ipywidgets
import torch
from torch.utils.data import TensorDataset
import batchwidgets as bw

live = bw.live_loader(TensorDataset(torch.arange(600)), batch_size=4)
# A refresher that stays quiet: ipykernel 7.4 sends a comm's messages to the subshell the comm
# last published under, whatever their header says, and the refresher publishes under the cell.
panel = bw.LoaderPanel(live, max_workers=2, refresh_s=3600)
slider = ipywidgets.IntSlider(value=0)  # any other widget: its messages reach the main shell
handled_on = []
panel.num_workers.observe(
    lambda change: handled_on.append((change["new"], threading.current_thread().name)), "value")
print(panel.model_id, slider.model_id)
"""
SUBSHELL_TRAINING = """
seen = []
for epoch in range(2):
    for i, (x,) in enumerate(live):  # 150 batches, about 20 ms each
        seen.append((epoch, i, live.num_workers, slider.value))
        if (epoch, i) == (0, 3):
            print("start", flush=True)
        if live.num_workers == 2 and [s[2] for s in seen].count(2) == 1:
            print("switched", flush=True)
        time.sleep(0.02)
print("seen", seen, flush=True)
print("handled on", handled_on, flush=True)
panel.close()
live.close()
"""


def create_subshell(client) -> str:
    """What JupyterLab 4.4+ does before it sends comm messages over a subshell."""
    client.control_channel.send(client.session.msg("create_subshell_request", content={}))
    reply = client.control_channel.get_msg(timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply["content"]["subshell_id"]


def panel_set(client, model_id: str, name: str, value, subshell_id: str | None) -> None:
    message = client.session.msg("comm_msg", content={"comm_id": model_id, "data": {
        "method": "custom", "content": {"event": "set", "name": name, "value": value}}})
    message["header"]["subshell_id"] = subshell_id  # JupyterLab sends null without subshells
    client.shell_channel.send(message)


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["over a subshell", "to the main shell"])
def test_clicks_over_a_subshell_need_no_poll_and_clicks_to_the_main_shell_are_polled(front_end):
    pytest.importorskip("jupyter_client")
    manager, client = start_kernel("7")
    try:
        subshell = create_subshell(client) if front_end == "over a subshell" else None
        panel_id, slider_id = outputs(client, SUBSHELL_SETUP).split()
        # A first click while the kernel is idle (the panel then publishes under it)
        panel_set(client, panel_id, "num_workers", 1, subshell)
        outputs(client, "while not handled_on: time.sleep(0.01)")
        training, iopub = client.execute(SUBSHELL_TRAINING), []
        read_until(client, iopub, "start")
        panel_set(client, panel_id, "num_workers", 2, subshell)
        read_until(client, iopub, "switched")
        # Then a message to another widget, which only a poll can dispatch before the cell ends
        client.shell_channel.send(client.session.msg("comm_msg", content={
            "comm_id": slider_id, "data": {"method": "update", "state": {"value": 7},
                                           "buffer_paths": []}}))
        read_until(client, iopub, "handled on")
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream"
                       and m["parent_header"].get("msg_id") == training)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    seen = ast.literal_eval(text.split("seen ", 1)[1].splitlines()[0])
    handled_on = ast.literal_eval(text.split("handled on ", 1)[1].splitlines()[0])
    switched = next((epoch, i) for epoch, i, workers, _ in seen if workers == 2)
    assert switched[0] == 0, text
    assert 4 <= switched[1] < 150, text  # mid-epoch, at the next batch after the click
    assert handled_on[-1][0] == 2
    slider_at = next((epoch, i) for epoch, i, _, value in seen if value == 7)
    if front_end == "over a subshell":
        # The click ran on the subshell's thread while the cell ran: no poll needed, and none
        # made for the rest of that epoch; the next epoch polls again, from its first batch.
        assert handled_on[-1][1].startswith("subshell"), handled_on
        assert slider_at == (1, 0), (slider_at, switched)
    else:
        assert handled_on[-1][1] == "MainThread"  # dispatched by the poll between batches
        assert slider_at[0] == 0, (slider_at, switched)  # polled in the same epoch
        assert slider_at[1] > switched[1], (slider_at, switched)
