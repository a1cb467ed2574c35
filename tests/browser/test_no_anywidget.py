"""A front end without anywidget's extension (JupyterLab with it disabled, as where anywidget is
installed in the kernel's environment but not the server's): the panel's cell is never blank.
JupyterLab's widget manager shows a line in its place, "Click to show javascript error", which
opens to why: the model class 'AnyModel' from module 'anywidget' could not be loaded."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LabServer, _free_port, _jupyter_dirs, serve
from test_jupyterlab import (
    RENDER_TIMEOUT_S,
    menu,
    open_notebook,
    screenshot,
    wait_for_cells,
    wait_until,
    write_notebook,
)

pytestmark = pytest.mark.browser

PANEL = """import batchwidgets as bw
from batchwidgets.results import Attempt, BatchSizeReport
bw.ProbePanel(BatchSizeReport(max_batch_size=8, first_oom_batch_size=9, device="cpu",
                              attempts=(Attempt(8, True, 2**20, 0.01),
                                        Attempt(9, False, None, None)), budget_bytes=2**21))"""


@pytest.fixture(scope="module")
def lab_without_anywidget(browser_available: None,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    base = tmp_path_factory.mktemp("no-anywidget")
    root_dir = base / "notebooks"
    root_dir.mkdir()
    env = {**os.environ, **_jupyter_dirs(base)}
    labconfig = Path(env["JUPYTER_CONFIG_DIR"]) / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"anywidget": True}}))
    port, token = _free_port(), secrets.token_hex(24)
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
               "--LabApp.extension_manager=readonly"]
    yield from serve(command, env, root_dir, port, token)


def test_without_anywidgets_extension_the_cell_says_why(browser_context: Any,
                                                        lab_without_anywidget: LabServer,
                                                        screenshot_dir: Path) -> None:
    page = browser_context.new_page()
    try:
        notebook = write_notebook(lab_without_anywidget, "no_anywidget.ipynb", PANEL)
        open_notebook(page, lab_without_anywidget, f"lab/tree/{notebook}", reset="")
        menu(page, "Run", "runmenu:run-all")
        wait_for_cells(page, lab_without_anywidget, notebook)
        output = page.locator(".jp-Notebook .jp-OutputArea-output").first
        text = wait_until(lambda: output.inner_text().strip(), RENDER_TIMEOUT_S,
                          "the cell's output")
        assert "error" in text.lower(), text  # a line in place of the panel, not a blank cell
        output.get_by_text("Click to show javascript error").first.click()
        text = output.inner_text()
        assert "Failed to load model class 'AnyModel' from module 'anywidget'" in text, text
        screenshot(page, output, screenshot_dir, "lab-without-anywidget.png")
    finally:
        page.close()
        lab_without_anywidget.shutdown_kernels()
