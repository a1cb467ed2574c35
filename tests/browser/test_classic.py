"""Classic Notebook 6.5 in headless Chromium, with ipywidgets 8 and with ipywidgets 7.7 (Colab's
line: ipykernel 6 and ipywidgets 7.7 in the kernel, widgetsnbextension 3.6 in the page): the
LoaderPanel of a live loader renders, and choosing 2 workers in it while the training cell runs
switches that loop mid-loop, the order kept. Each server comes from a virtual environment of its
own (``.classic``, ``.classic7``: Notebook 6 and Notebook 7 cannot share one), as ``.ci/run``
makes them; the kernel is this environment's Python (with ``.ipykernel6`` and ``.ipywidgets7``
first on its path for 7.7). Skipped, with the command to make it, where one is missing."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest
from conftest import ROOT, LabServer, _free_port, _jupyter_dirs, serve
from test_jupyterlab import RUNNING_LOOP, wait_until

pytestmark = pytest.mark.browser

# widgets line -> (the server's venv, its widgetsnbextension, the kernel's extra path)
LINES = {"8": (ROOT / ".classic", "4", []),
         "7.7": (ROOT / ".classic7", "3.6", [ROOT / ".ipykernel6", ROOT / ".ipywidgets7"])}
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module", params=list(LINES))
def classic_server(request: pytest.FixtureRequest, browser_available: None,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    venv, extension, kernel_path = LINES[request.param]
    jupyter = venv / "bin" / "jupyter-notebook"
    missing = [path for path in [jupyter, *kernel_path] if not path.exists()]
    if missing:
        pytest.skip(f"no {missing[0]}: .ci/run makes it (python3 -m venv {venv.name} && "
                    f"{venv.name}/bin/pip install 'notebook==6.5.*' "
                    f"'widgetsnbextension=={extension}.*')")
    base = tmp_path_factory.mktemp("classic")
    root_dir = base / "notebooks"
    root_dir.mkdir()
    port, token = _free_port(), secrets.token_hex(24)
    env = {**os.environ, **_jupyter_dirs(base)}
    if kernel_path:  # the kernel's own path first: ipykernel 6 and ipywidgets 7.7
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, kernel_path), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    command = [str(jupyter), "--no-browser", "--NotebookApp.ip=127.0.0.1",
               f"--NotebookApp.port={port}", "--NotebookApp.port_retries=0",
               f"--NotebookApp.token={token}", f"--NotebookApp.notebook_dir={root_dir}"]
    for server in serve(command, env, root_dir, port, token):
        server.widgets = request.param
        yield server


def test_a_click_in_classic_notebook_while_the_cell_runs_switches_its_loader(
        browser_context: Any, classic_server: LabServer) -> None:
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(cell) for cell in (
            *RUNNING_LOOP, "import ipywidgets\nprint('widgets', ipywidgets.__version__)")])
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
        last = page.locator(".cell.code_cell").nth(2)
        wait_until(lambda: re.search(r"\[\d+\]", last.locator(".input_prompt").inner_text()),
                   RUN_TIMEOUT_S, "the last cell to run")
        text = "\n".join(cell.locator(".output_area").inner_text() for cell in (loop, last))
    finally:
        page.close()
        classic_server.shutdown_kernels()
    assert f"widgets {classic_server.widgets}" in text, text
    assert "order True" in text, text
    switches = re.findall(r"\((\d+), (\d+), (\d+)\)", text)
    assert len(switches) == 1, text
    epoch, batch, workers = map(int, switches[0])
    assert (epoch, workers) == (0, 2), text
    assert 0 < batch < 600, text  # mid-loop, not when the cell ended
