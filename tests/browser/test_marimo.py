"""marimo in headless Chromium (issue 26): a ``marimo run`` app on 127.0.0.1 shows a LoaderPanel
both ways marimo offers, wrapped (``mo.ui.anywidget(panel)``) and as a cell's output itself (its
anywidget formatter), and choosing 2 workers in each reaches Python: the panel's own kernel-side
status and readout come back with a measurement of 2 workers, and its chart shows it.

marimo renders each panel in the shadow root of a ``<marimo-anywidget>``; Playwright's CSS
locators pierce it. marimo 0.23.14 or later: older ones deliver the click (the status says
"measuring ...", written on the kernel's thread) but drop every change the panel makes from its
measuring thread, as they send only from threads with marimo's context. Skipped, with the
reason in one line, without marimo, Playwright or Chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CHROMIUM,
    CHROMIUM_ARGS,
    ROOT,
    SKIPPED,
    VIEWPORT,
    Server,
    _free_port,
    _missing,
)
from test_jupyterlab import check_loader_panel, samples_per_s, screenshot, wait_until

pytestmark = pytest.mark.browser

LOAD_TIMEOUT_S = 90  # the page, then the app's cells (torch's import) in a fresh kernel
MEASURE_TIMEOUT_S = 30  # 2 workers on 64 numbers: well under a second when the CPU is free

# Two panels told apart by their num_workers choices: 0-2 wrapped, 0-3 shown directly.
NOTEBOOK = """
import marimo

app = marimo.App()


@app.cell
def _():
    import marimo as mo
    import torch
    from torch.utils.data import TensorDataset

    import batchwidgets as bw

    def make(max_workers):
        return bw.LoaderPanel(TensorDataset(torch.arange(64.0)), batch_size=8, device="cpu",
                              duration_s=0.05, max_workers=max_workers, start=False)
    return make, mo


@app.cell
def _(make, mo):
    wrapped = mo.ui.anywidget(make(2))
    wrapped
    return (wrapped,)


@app.cell
def _(make):
    panel = make(3)
    panel
    return (panel,)


if __name__ == "__main__":
    app.run()
"""
# display way -> (its panel's place on the page, the number of num_workers choices)
DISPLAYS = {"mo.ui.anywidget": (0, 3), "direct": (1, 4)}


class MarimoApp(Server):
    """A running ``marimo run`` app: its address and its log."""

    name = "marimo"

    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        super().__init__(process, log)
        self.url = url

    def answers(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
            return response.status == 200


@pytest.fixture(scope="module")
def marimo_app(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarimoApp]:
    """``marimo run`` of NOTEBOOK on a free 127.0.0.1 port, with marimo's config, state and
    cache folders of its own (nothing of the user's setup leaks in) and no update check."""
    reason = _missing("marimo", "marimo")
    if reason is not None:
        request.config.stash[SKIPPED] = reason
        pytest.skip(f"browser tests: {reason}")
    base = tmp_path_factory.mktemp("marimo")
    notebook = base / "loader_panels.py"
    notebook.write_text(NOTEBOOK.lstrip())
    home = {name: base / name.lower() for name in
            ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")}
    for folder in home.values():
        folder.mkdir()
    env = {**os.environ, **{name: str(folder) for name, folder in home.items()},
           "MARIMO_SKIP_UPDATE_CHECK": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get(
               "PYTHONPATH")])])}
    port = _free_port()
    command = [sys.executable, "-m", "marimo", "run", "--headless", "--no-token",
               "--host", "127.0.0.1", "--port", str(port), str(notebook)]
    log = base / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=base, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    app = MarimoApp(process, f"http://127.0.0.1:{port}", log)
    try:
        app.wait_ready()
        yield app
    finally:
        app.stop()


def _sync_playwright_running() -> bool:
    """Playwright's sync API runs one instance per thread: while conftest's ``browser_context``
    (JupyterLab's tests, earlier in the session) holds one, its event loop runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def marimo_page(request: pytest.FixtureRequest, marimo_app: MarimoApp,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A tab on the app, its cells run: headless Chromium of this module's own, or a tab in
    conftest's browser when the JupyterLab tests before this one still hold Playwright (then
    their server is up already: nothing more starts)."""
    def print_error(message: Any) -> None:  # captured; shown with a failing test
        if message.type == "error":
            print(f"browser console: {message.text}")

    with contextlib.ExitStack() as stack:
        if _sync_playwright_running():
            context = request.getfixturevalue("browser_context")
        else:
            from playwright.sync_api import sync_playwright

            playwright = stack.enter_context(sync_playwright())
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
                args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT)
            stack.callback(context.close)
        tab = context.new_page()
        stack.callback(tab.close)
        tab.on("console", print_error)
        tab.goto(marimo_app.url, timeout=LOAD_TIMEOUT_S * 1000)
        panels = tab.locator(".batchwidgets-loader")
        wait_until(lambda: panels.count() == len(DISPLAYS), LOAD_TIMEOUT_S,
                   f"{len(DISPLAYS)} loader panels in the app",
                   lambda: (panels.count(), tab.locator("body").inner_text()[-2000:],
                            marimo_app.log_tail(2000)))
        yield tab


@pytest.mark.parametrize("display", list(DISPLAYS))
def test_choosing_2_workers_in_a_marimo_panel_reaches_python(
        marimo_page: Any, screenshot_dir: Path, display: str) -> None:
    place, n_choices = DISPLAYS[display]
    panel = marimo_page.locator(".batchwidgets-loader").nth(place)
    select = panel.locator(".batchwidgets-loader-num-workers select")
    status = panel.locator(".batchwidgets-loader-status")
    assert select.locator("option").count() == n_choices, "not this display's panel"
    assert status.inner_text() == "ready", "the panel measured before it was asked to"
    assert samples_per_s(panel) == "-"

    select.select_option(label="2")
    # Only the kernel writes the status: "measuring num_workers=2, ..." while it measures,
    # then "2 workers, prefetch 2: N samples/s; best so far: ...", sent back from its thread.
    wait_until(lambda: status.inner_text().startswith("2 workers"), MEASURE_TIMEOUT_S,
               "the kernel to measure 2 workers",
               lambda: (status.inner_text(), f"marimo {version('marimo')}"))
    check_loader_panel(panel)  # every control, a number of samples/s and the chart
    assert select.input_value() == "2"
    name = display.removeprefix("mo.ui.")
    screenshot(marimo_page, panel, screenshot_dir, f"marimo-loader-panel-{name}.png")
