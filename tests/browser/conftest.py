"""Browser tests: a JupyterLab server on 127.0.0.1 and a headless Chromium driven by Playwright.

The server runs on a copy of ``notebooks/`` with this environment's ``python3`` kernel and its
own Jupyter config, data and runtime folders, so nothing of the user's setup leaks in. Without
Chromium (``apt-get install -y chromium``) or Playwright (``pip install -e ".[test]"``) the
tests are skipped with the reason, in one line. ``BATCHWIDGETS_CHROMIUM`` points to another
Chromium; ``BATCHWIDGETS_SCREENSHOTS`` keeps the screenshots in that folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _paths import ROOT


def _chromium() -> Path:
    """$BATCHWIDGETS_CHROMIUM, else Debian's /usr/bin/chromium (.ci/run installs it), else the
    chromium on PATH."""
    chosen = os.environ.get("BATCHWIDGETS_CHROMIUM")
    if chosen:
        return Path(chosen)
    debian, on_path = Path("/usr/bin/chromium"), shutil.which("chromium")
    return debian if debian.exists() or on_path is None else Path(on_path)


CHROMIUM = _chromium()
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
VIEWPORT = {"width": 1280, "height": 1000}
SERVER_START_S = 120  # a cold JupyterLab start on a busy 2-core machine takes 5-30 s
SERVER_STOP_S = 30
# Lab settings for a quiet, predictable page: no news or update toasts over the screenshots, and
# every cell kept in the page (Lab 4 otherwise drops or defers cells scrolled out of view)
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
WIDGETS7_KERNEL = "python3-widgets7"  # this environment's Python with ipywidgets 7.7 first
SKIPPED = pytest.StashKey[str]()
SCREENSHOTS = pytest.StashKey[Path]()


def _missing(server: str = "jupyterlab", name: str = "JupyterLab") -> str | None:
    """Why the browser tests on ``server`` (a package: jupyterlab, marimo) cannot run here, or
    None."""
    if importlib.util.find_spec("playwright") is None:
        return 'Playwright is not installed (pip install -e ".[test]")'
    if importlib.util.find_spec(server) is None:
        return f'{name} is not installed (pip install -e ".[test]")'
    if not os.access(CHROMIUM, os.X_OK):
        return (f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set "
                f"BATCHWIDGETS_CHROMIUM)")
    return None


@pytest.fixture(scope="session")
def browser_available(request: pytest.FixtureRequest) -> None:
    """Skips every browser test, with the reason, where Chromium or Playwright is missing."""
    reason = _missing()
    if reason is not None:
        request.config.stash[SKIPPED] = reason
        pytest.skip(f"browser tests: {reason}")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line at the end of the run: why the browser tests were skipped, or the screenshots."""
    if SKIPPED in config.stash:
        terminalreporter.write_line(f"browser tests skipped: {config.stash[SKIPPED]}")
    if SCREENSHOTS in config.stash:
        terminalreporter.write_line(f"browser screenshots: {config.stash[SCREENSHOTS]}")


@pytest.fixture(scope="session")
def screenshot_dir(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests save screenshots of the panels: $BATCHWIDGETS_SCREENSHOTS, or a tmp dir."""
    chosen = os.environ.get("BATCHWIDGETS_SCREENSHOTS")
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    request.config.stash[SCREENSHOTS] = folder.resolve()
    return folder


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; elsewhere none). Kernels run in sessions of
    their own, so killing the server's process group would miss them."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended already
            os.kill(pid, signal.SIGKILL)


class Server:
    """A server process of a test's own (JupyterLab, marimo): its log, when it answers, and its
    end, with every process below it."""

    name = "the server"

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self.process, self.log = process, log

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n_chars:]

    def answers(self) -> bool:
        """One request to the server: True when it is up."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if self.answers():
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not answer within {SERVER_START_S} s:\n"
                           f"{self.log_tail()}")

    def ask_to_stop(self) -> None:
        self.process.terminate()

    def stop(self) -> None:
        """``ask_to_stop``, then make sure: SIGKILL after SERVER_STOP_S, and SIGKILL for any
        process of it left behind (kernels, loader workers)."""
        below = _children(self.process.pid)
        if self.process.poll() is None:
            self.ask_to_stop()
            try:
                self.process.wait(SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(SERVER_STOP_S)
        _kill(below)


class LabServer(Server):
    """A running ``jupyter lab``: ``url(path)`` adds the token; ``api`` calls its REST API."""

    name = "jupyter lab"

    def __init__(self, process: subprocess.Popen, port: int, token: str, root_dir: Path,
                 log: Path) -> None:
        super().__init__(process, log)
        self.port, self.token, self.root_dir = port, token, root_dir
        self.base_url = f"http://127.0.0.1:{port}"

    def url(self, path: str, **query: str) -> str:
        parts = [f"token={self.token}", *(f"{key}={value}" if value else key
                                          for key, value in query.items())]
        return f"{self.base_url}/{path.lstrip('/')}?{'&'.join(parts)}"

    def api(self, method: str, path: str, timeout: float = 10) -> Any:
        request = urllib.request.Request(f"{self.base_url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """End every session and its kernel, so the next notebook has the CPU to itself."""
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}", timeout=30)
        for kernel in self.api("GET", "kernels"):
            self.api("DELETE", f"kernels/{kernel['id']}", timeout=30)

    def answers(self) -> bool:
        self.api("GET", "status", timeout=5)
        return True

    def ask_to_stop(self) -> None:
        """Through its API: it ends its kernels."""
        try:
            self.api("POST", "shutdown", timeout=SERVER_STOP_S)
        except (OSError, urllib.error.URLError):
            self.process.terminate()


def _jupyter_dirs(base: Path) -> dict[str, str]:
    """Jupyter folders of the test's own, with this environment's python3 kernel first."""
    dirs = {name: base / name for name in ("config", "data", "runtime", "ipython")}
    for path in dirs.values():
        path.mkdir(parents=True)
    kernel = dirs["data"] / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python",
        "metadata": {"debugger": False}}))
    widgets7 = ROOT / ".ipywidgets7"  # ipywidgets 7.7, as Colab ships it (.ci/run installs it)
    if (widgets7 / "ipywidgets").is_dir():
        kernel = dirs["data"] / "kernels" / WIDGETS7_KERNEL
        kernel.mkdir(parents=True)
        (kernel / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (ipywidgets 7.7)", "language": "python",
            "env": {"PYTHONPATH": str(widgets7)}, "metadata": {"debugger": False}}))
    for name, settings in LAB_SETTINGS.items():
        path = dirs["config"] / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    return {"JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTER_PATH": str(dirs["data"]), "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "IPYTHONDIR": str(dirs["ipython"])}


@pytest.fixture(scope="session")
def lab_server(browser_available: None,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """``jupyter lab`` on a free 127.0.0.1 port with a random token, serving a copy of
    ``notebooks/`` (Notebook 7 pages, ``/notebooks/...``, come from the same server)."""
    base = tmp_path_factory.mktemp("jupyter")
    root_dir = base / "notebooks"
    shutil.copytree(ROOT / "notebooks", root_dir,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    port, token = _free_port(), secrets.token_hex(24)
    env = {**os.environ, **_jupyter_dirs(base)}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
               "--LabApp.extension_manager=readonly"]  # no look-ups on PyPI
    yield from serve(command, env, root_dir, port, token)


def serve(command: list[str], env: dict[str, str], root_dir: Path, port: int,
          token: str) -> Iterator[LabServer]:
    """Run a Jupyter server ``command`` (its log beside ``root_dir``) until the fixture ends."""
    if os.name == "posix" and os.geteuid() == 0:  # CI containers run as root
        command = [*command, "--allow-root"]
    log = root_dir.parent / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=root_dir, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = LabServer(process, port, token, root_dir, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser_context(lab_server: LabServer,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium with a fresh profile (a Playwright ``BrowserContext``)."""
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    try:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()
    finally:
        playwright.stop()


@pytest.fixture
def page(browser_context: Any, lab_server: LabServer) -> Iterator[Any]:
    """A fresh tab; afterwards it is closed and every kernel the test started is shut down.
    Browser console errors are printed, so a failing test shows them."""
    def print_error(message: Any) -> None:  # captured; shown with a failing test
        if message.type == "error":
            print(f"browser console: {message.text}")

    tab = browser_context.new_page()
    tab.on("console", print_error)
    try:
        yield tab
    finally:
        try:
            tab.close()
        finally:
            lab_server.shutdown_kernels()
