"""``WidgetPoll`` (issue 24): a widget update sent while a cell runs lands in the middle of that
cell's loop, on both ipykernel lines (7.x installed, 6.29 from ``.ipykernel6``, as ``.ci/run``
installs it), while every other message keeps its order and waits for the cell, and the cell's
output stays the cell's. Outside a kernel it does nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from _paths import ROOT

from batchwidgets._kernel_poll import WidgetPoll
from batchwidgets._warnings import BatchwidgetsWarning

IPYKERNEL6 = ROOT / ".ipykernel6"  # pip install --target .ipykernel6 --no-deps "ipykernel==6.29.*"
IPYWIDGETS7 = ROOT / ".ipywidgets7"  # with ipykernel 6: Colab's lines ("6+widgets7")

SETUP = """
import time
import ipywidgets
from batchwidgets._kernel_poll import WidgetPoll
slider = ipywidgets.IntSlider(value=0)
print(slider.model_id)
"""
# Polls until the update has landed and 5 more steps have run (at most about 20 s): the update is
# sent once the client sees "start", after 3 steps, so it lands in the middle of the loop, or never.
TRAINING = """
import threading
poll = WidgetPoll(min_interval_s=0.0)
seen, dispatched, from_a_thread = [], 0, []  # a thread polls too: it must touch nothing
helper = threading.Thread(target=lambda: from_a_thread.extend(
    (time.sleep(0.005), poll.poll())[1] for _ in range(100)))
helper.start()
for step in range(1000):
    dispatched += poll.poll()
    seen.append(slider.value)
    if step == 2:
        print("start", flush=True)
    if seen.count(7) > 5:
        break
    time.sleep(0.02)
helper.join()
print("after the loop", poll.available, repr(poll.reason), from_a_thread == [0] * 100)
print(seen.index(7) if 7 in seen else None, len(seen), dispatched, flush=True)
time.sleep(0.3)  # no more polls: the client's last request waits in the kernel's socket
"""


def start_kernel(line: str):
    """A kernel of this environment's Python on ipykernel ``line`` ("7", "6"; "6+widgets7" adds
    ipywidgets 7.7, as Colab ships them); this checkout first on the
    path (the kernel imports this batchwidgets, not an installed one)."""
    from jupyter_client.manager import KernelManager

    if line.startswith("6") and not (IPYKERNEL6 / "ipykernel").is_dir():
        pytest.skip(f"no ipykernel 6 in {IPYKERNEL6}: pip install --target .ipykernel6 "
                    "--no-deps 'ipykernel==6.29.*' nest-asyncio")
    if line == "6+widgets7" and not (IPYWIDGETS7 / "ipywidgets").is_dir():
        pytest.skip(f"no ipywidgets 7 in {IPYWIDGETS7}: pip install --target .ipywidgets7 "
                    "--no-deps 'ipywidgets==7.7.*' ipython_genutils")
    paths = ([str(IPYKERNEL6)] if line.startswith("6") else []) + (
        [str(IPYWIDGETS7)] if line == "6+widgets7" else []) + [str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}
    manager = KernelManager(kernel_name="python3")
    manager.kernel_spec.argv[0] = sys.executable
    manager.start_kernel(env=env)
    client = manager.blocking_client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    return manager, client


def outputs(client, code: str) -> str:
    texts: list[str] = []
    reply = client.execute_interactive(
        textwrap.dedent(code), timeout=60,
        output_hook=lambda m: texts.append(m["content"].get("text", "")))
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(texts)


def run_scenario(line: str) -> dict:
    """Set up a slider, start the training cell, and once it prints "start" send a widget update,
    then an execute_request and a kernel_info_request (both held by a poll), and once the loop is
    over another execute_request (never seen by a poll); collect every IOPub message until the
    last cell is idle, and the shell replies in the order they came."""
    manager, client = start_kernel(line)
    try:
        version = outputs(client, "import ipykernel; print(ipykernel.__version__)").strip()
        model_id = outputs(client, SETUP).strip()
        training = client.execute(TRAINING)
        iopub: list[dict] = []
        read_until(client, iopub, "start")
        update = client.session.msg("comm_msg", content={"comm_id": model_id, "data": {
            "method": "update", "state": {"value": 7}, "buffer_paths": []}})
        client.shell_channel.send(update)
        after = client.execute("print('after', len(seen), slider.value)")
        info = client.kernel_info()
        read_until(client, iopub, "after the loop")
        last = client.execute("print('last')")
        while not (iopub[-1]["msg_type"] == "status"
                   and iopub[-1]["parent_header"].get("msg_id") == last
                   and iopub[-1]["content"]["execution_state"] == "idle"):
            iopub.append(client.get_iopub_msg(timeout=60))
        replies = [client.get_shell_msg(timeout=10)["parent_header"]["msg_id"]
                   for _ in range(4)]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return {"version": version, "iopub": iopub, "replies": replies, "training": training,
            "update": update["header"]["msg_id"], "after": after, "info": info, "last": last}


def read_until(client, iopub: list[dict], text: str) -> None:
    while not any(m["msg_type"] == "stream" and text in m["content"]["text"] for m in iopub):
        iopub.append(client.get_iopub_msg(timeout=60))


def text_of(iopub: list[dict], parent: str) -> str:
    return "".join(m["content"]["text"] for m in iopub
                   if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == parent)


def first(iopub: list[dict], parent: str, state: str) -> int:
    """Where the first ``state`` status of request ``parent`` is in IOPub (the test fails
    if that request had not run by the time the last one was idle)."""
    found = [i for i, m in enumerate(iopub) if m["msg_type"] == "status"
             and m["parent_header"].get("msg_id") == parent
             and m["content"]["execution_state"] == state]
    assert found, f"no {state} status for {parent} before the last request was idle"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("line", ["7", "6"])
def test_a_widget_update_lands_mid_loop_and_every_other_message_waits_for_the_cell(line):
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipywidgets")
    run = run_scenario(line)
    assert run["version"].startswith(line + ".")
    iopub, training = run["iopub"], run["training"]
    printed = text_of(iopub, training).splitlines()  # the cell's prints after the poll included
    assert printed[:2] == ["start", "after the loop True '' True"]
    assert not printed[2].startswith("None"), "the update never landed during the loop"
    changed_at, steps, dispatched = (int(n) for n in printed[2].split())
    assert 3 <= changed_at < steps - 5  # 0 before the update, 7 for the rest of the same loop
    assert dispatched == 1
    # The update ran as the kernel runs a message, status busy then idle under the update, both
    # while the training cell was still busy: ipywidgets' front end holds that widget's further
    # updates until this idle comes.
    training_idle = first(iopub, training, "idle")
    update_idle = first(iopub, run["update"], "idle")
    assert first(iopub, run["update"], "busy") < update_idle < training_idle
    # ... and then the kernel says busy again under the cell, for the rest of the cell
    assert [m["parent_header"]["msg_id"] for m in iopub[update_idle + 1:training_idle]
            if m["msg_type"] == "status"][:1] == [training]
    # The other requests waited for the training cell, in the order sent.
    assert first(iopub, run["after"], "busy") > training_idle
    assert text_of(iopub, run["after"]) == f"after {steps} 7\n"
    assert text_of(iopub, run["last"]) == "last\n"
    assert run["replies"] == [training, run["after"], run["info"], run["last"]]


def test_outside_a_kernel_poll_does_nothing_and_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poll = WidgetPoll(min_interval_s=0.0)
        assert [poll.poll() for _ in range(3)] == [0, 0, 0]
    assert poll.available is False
    assert poll.reason == "not running in an IPython kernel"


def test_the_module_imports_nothing_heavy_so_a_panel_may_poll_outside_a_kernel():
    code = ("import sys, batchwidgets._kernel_poll as k; k.WidgetPoll().poll(); print(sorted("
            "m for m in ('torch', 'IPython', 'ipykernel', 'ipywidgets', 'zmq') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def test_a_bad_interval_is_a_one_line_error_naming_it():
    with pytest.raises(ValueError, match="min_interval_s") as negative:
        WidgetPoll(min_interval_s=-1)
    with pytest.raises(TypeError, match="min_interval_s") as text:
        WidgetPoll(min_interval_s="50ms")
    assert "min_interval_s=-1" in str(negative.value)
    assert "min_interval_s='50ms'" in str(text.value)


class FakeShell:
    """What get_ipython() returns in a kernel: an object with a ``kernel``."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel


@pytest.fixture
def shell_with(monkeypatch):
    """Make ``IPython.get_ipython()`` return a FakeShell around a given kernel object."""
    import IPython

    def install(kernel: object) -> None:
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
        monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell(kernel))

    return install


def test_a_kernel_whose_internals_are_unknown_gets_one_warning_then_quiet(shell_with):
    shell_with(types.SimpleNamespace(shell_stream=None))  # neither line's queue
    poll = WidgetPoll(min_interval_s=0.0)
    assert poll.available is False
    with pytest.warns(BatchwidgetsWarning) as caught:
        assert [poll.poll() for _ in range(3)] == [0, 0, 0]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("widget changes made while this cell runs apply when it ends: ")
    assert "cannot reach them" in message
    assert "\n" not in message


class BrokenSocket:
    """Says a message waits (zmq.POLLIN), then fails to give it."""

    EVENTS = 1

    def recv_multipart(self, *args, **kwargs):
        raise OSError("socket closed")


def test_a_failure_while_polling_turns_polling_off_with_one_warning(shell_with):
    pytest.importorskip("zmq")
    stream = types.SimpleNamespace(socket=BrokenSocket(), _recv_callback=lambda message: None)
    shell_with(types.SimpleNamespace(shell_main=None, shell_channel_thread=None,
                                     shell_stream=stream, get_parent=lambda channel: {},
                                     _parent_ident={"shell": b""}))
    poll = WidgetPoll(min_interval_s=0.0)
    assert poll.available is True
    with pytest.warns(BatchwidgetsWarning, match="polling failed") as caught:
        assert [poll.poll() for _ in range(3)] == [0, 0, 0]
    assert len(caught) == 1
    assert poll.available is False
    assert "OSError: socket closed" in poll.reason


INTERRUPTED = """
poll = WidgetPoll(min_interval_s=0.0)
for step in range(1000):
    poll.poll()
    if step == 2:
        print("start", flush=True)
    if slider.value == 7:
        slider.value = 8  # print once
        print("landed", flush=True)
    time.sleep(0.02)
"""


@pytest.mark.slow
@pytest.mark.parametrize("line", ["7", "6"])
def test_an_interrupt_while_polling_leaves_the_kernel_as_without_the_poll(line):
    # Stop pressed while requests are held by the poll: the cell ends in KeyboardInterrupt, the
    # held execute_request is aborted as the kernel aborts queued cells after an error, and the
    # next cell runs in a kernel that still answers.
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipywidgets")
    manager, client = start_kernel(line)
    try:
        model_id = outputs(client, SETUP).strip()
        training, iopub = client.execute(INTERRUPTED), []
        read_until(client, iopub, "start")
        client.shell_channel.send(client.session.msg("comm_msg", content={
            "comm_id": model_id, "data": {"method": "update", "state": {"value": 7},
                                          "buffer_paths": []}}))
        queued = client.execute("print('queued')")
        read_until(client, iopub, "landed")
        manager.interrupt_kernel()
        replies = {}
        while len(replies) < 2:
            reply = client.get_shell_msg(timeout=30)
            replies[reply["parent_header"]["msg_id"]] = reply["content"]
        after = outputs(client, "print(slider.value, step)").split()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert replies[training]["status"] == "error"
    assert replies[training]["ename"] == "KeyboardInterrupt"
    assert replies[queued]["status"] == "aborted"
    assert after[0] == "8"
    assert 3 <= int(after[1]) < 999
