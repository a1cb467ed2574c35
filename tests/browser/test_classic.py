"""Classic Notebook (6.5, with the widgets nbextension of ipywidgets 8) in headless Chromium: the
LoaderPanel of a live loader renders, and choosing 2 workers in it while the training cell runs
switches that loop mid-loop, the order kept. The server comes from a virtual environment of its
own (``.classic``: Notebook 6 and Notebook 7 cannot share one), as ``.ci/run`` makes it; the
kernel is this environment's. Skipped, with the command to make it, where it is missing."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest
from conftest import ROOT, LabServer, _free_port, _jupyter_dirs
from test_jupyterlab import RUNNING_LOOP, wait_until

pytestmark = pytest.mark.browser

CLASSIC = ROOT / ".classic"  # a venv with Notebook 6.5 and widgetsnbextension 4 (.ci/run)
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def classic_server(browser_available: None,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    jupyter = CLASSIC / "bin" / "jupyter-notebook"
    if not jupyter.exists():
        pytest.skip(f"no Classic Notebook in {CLASSIC}: python3 -m venv .classic && "
                    f".classic/bin/pip install 'notebook==6.5.*' 'widgetsnbextension==4.*'")
    base = tmp_path_factory.mktemp("classic")
    root_dir = base / "notebooks"
    root_dir.mkdir()
    port, token = _free_port(), secrets.token_hex(24)
    env = {**os.environ, **_jupyter_dirs(base)}
    command = [str(jupyter), "--no-browser", "--NotebookApp.ip=127.0.0.1",
               f"--NotebookApp.port={port}", "--NotebookApp.port_retries=0",
               f"--NotebookApp.token={token}", f"--NotebookApp.notebook_dir={root_dir}"]
    if os.name == "posix" and os.geteuid() == 0:  # CI containers run as root
        command.append("--allow-root")
    log = base / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=root_dir, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = LabServer(process, port, token, root_dir, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_a_click_in_classic_notebook_while_the_cell_runs_switches_its_loader(
        browser_context: Any, classic_server: LabServer) -> None:
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(cell) for cell in RUNNING_LOOP])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                       "language": "python"}
    nbformat.write(notebook, classic_server.root_dir / "running_loop.ipynb")
    page = browser_context.new_page()
    try:
        page.goto(classic_server.url("notebooks/running_loop.ipynb"), timeout=120_000)
        page.wait_for_function(
            "() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel"
            " && Jupyter.notebook.kernel.is_connected()", timeout=120_000)
        page.evaluate("() => Jupyter.notebook.execute_all_cells()")
        loop = page.locator(".cell.code_cell").nth(1)
        wait_until(lambda: "[*]" in loop.locator(".input_prompt").inner_text(), RUN_TIMEOUT_S,
                   "the training loop to start")
        panel = page.locator(".batchwidgets-loader")
        panel.locator(".batchwidgets-loader-num-workers select").select_option(label="2")
        assert "[*]" in loop.locator(".input_prompt").inner_text(), "the loop ended first"
        wait_until(lambda: re.search(r"\[\d+\]", loop.locator(".input_prompt").inner_text()),
                   RUN_TIMEOUT_S, "the training loop to end")
        text = loop.locator(".output_area").inner_text()
    finally:
        page.close()
        classic_server.shutdown_kernels()
    assert "order True" in text, text
    switches = re.findall(r"\((\d+), (\d+), (\d+)\)", text)
    assert len(switches) == 1, text
    epoch, batch, workers = map(int, switches[0])
    assert (epoch, workers) == (0, 2), text
    assert 0 < batch < 600, text  # mid-loop, not when the cell ended
