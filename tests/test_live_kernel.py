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
switches = live.report().switches
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
