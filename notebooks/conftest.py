"""nbval runs every notebook here (see ``addopts`` in pyproject.toml). Cells tagged ``gpu`` need a
CUDA device: they get the ``gpu`` marker and are skipped without one. The kernels keep
find_batch's remembered answers in a folder of each notebook's own, never the user's cache nor
another notebook's. After each cell, every report the notebook holds is checked for one story
(issue 41: each number against its field, each rule against its factor; tests/_story.py), in
the notebook's own kernel: a cell whose reports disagree with themselves fails."""

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # the kernels nbval starts inherit this environment: they import this checkout's
    # batchwidgets (not another one the environment has installed), as tests/'s processes do
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])
    folder = tempfile.mkdtemp(prefix="batchwidgets-cache-")
    os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
    config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    _kernels_freeze_what_cells_made(config)


# the kernels' startup file: after each cell, what the notebook holds is frozen out of the
# garbage collector's walks (see below)
FREEZE_AFTER_EACH_CELL = """\
import gc
get_ipython().events.register("post_run_cell", lambda result: gc.freeze())
"""


def _kernels_freeze_what_cells_made(config):
    """find_batch collects garbage after each out-of-memory error (its traceback holds the
    failed step's tensors in cycles), and a full collection walks every object the kernel
    holds: torch's and transformers' alone take about 0.5 s a walk. The tutorials' kernels start
    with a profile whose startup file freezes, after each cell, what is alive (``gc.freeze``),
    so a collection walks what the running cell made. Nothing a tutorial prints changes."""
    ipython_dir = Path(tempfile.mkdtemp(prefix="batchwidgets-ipython-"))
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-freeze-after-each-cell.py").write_text(FREEZE_AFTER_EACH_CELL)
    os.environ["IPYTHONDIR"] = str(ipython_dir)
    config.add_cleanup(functools.partial(shutil.rmtree, ipython_dir, ignore_errors=True))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before nbval starts a notebook's kernel (at its first cell): a new, empty folder, so no
    # notebook gives back an answer another one measured
    notebook = item.parent
    if getattr(notebook, "kernel", False) is None:  # nbval's IPyNbFile, its kernel not started
        folder = tempfile.mkdtemp(prefix="batchwidgets-cache-")
        os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
        item.config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))


def pytest_collection_modifyitems(items):
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the cell is tagged gpu and there is no CUDA device")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's notebook cells
        if cell is not None and "gpu" in cell.metadata.get("tags", []):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(no_gpu)


TESTS = str(Path(__file__).resolve().parents[1] / "tests")
MARK = "batchwidgets-story:"
CHECK = f"""
import sys as _bw_sys
if {TESTS!r} not in _bw_sys.path:
    _bw_sys.path.append({TESTS!r})
import json as _bw_json, _story as _bw_story
print({MARK!r} + _bw_json.dumps(_bw_story.told_in(globals())))
del _bw_sys, _bw_json, _bw_story
"""


def _told(kernel) -> dict:
    """What the reports in the kernel's namespace get wrong (tests/_story.py's told_in), read back
    from the kernel's output; every message of the request is consumed, so nbval's next cell
    reads only its own."""
    msg_id = kernel.execute_cell_input(CHECK, allow_stdin=False)
    kernel.await_reply(msg_id, timeout=300)
    out, error = "", None
    while True:
        msg = kernel.get_message(stream="iopub", timeout=300)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out += content["text"]
        elif kind == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and content["execution_state"] == "idle":
            break
    if error is not None:
        return {"the story check itself": [error]}
    line = next(line for line in out.splitlines() if line.startswith(MARK))
    return json.loads(line[len(MARK):])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    kernel = getattr(item.parent, "kernel", None)
    if getattr(item, "cell", None) is not None and kernel is not None and kernel.is_alive():
        told = _told(kernel)
        if told:
            pytest.fail("the notebook's reports disagree with themselves (tests/_story.py):\n"
                        + "\n".join(f"{name}: {problem}" for name, found in told.items()
                                     for problem in found), pytrace=False)
    return result
