"""The panels in a real browser, checked as a person would: JupyterLab 4 runs a notebook that
shows every kind of panel and report the tutorials show (nbval runs the tutorials themselves),
every panel renders (none fails, none stays loading), the probe panel shows its chart and
recommendation, and each report its table and picture; Notebook 7 opens a tutorial and runs its
first panel. Then the live parts: the noise panel's chart changes while a training loop runs in
its cell (and the loop prints nothing), and choosing another ``num_workers`` in the loader panel
measures it and changes the readout. Screenshots of each panel go to the folder printed at the
end of the run.

``python -m pytest -m browser`` runs only these; the fixtures are in conftest.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import nbformat
import pytest
from conftest import WIDGETS7_KERNEL

pytestmark = pytest.mark.browser

T = TypeVar("T")
LOAD_TIMEOUT_S = 120  # page load, kernel start
RUN_TIMEOUT_S = 420  # all cells of one notebook: 20-90 s, more on a busy 2-core machine
RENDER_TIMEOUT_S = 60  # widgets and images, once the kernel is done
POLL_S = 0.5
CODE_PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"
STATIC_REPORT = ".jp-OutputArea-output:has(img[alt='batchwidgets plot'])"  # results._repr_html_
RECOMMENDED = re.compile(r"recommended_batch_size\s*(\d+)")

PANELS = {"probe": ".batchwidgets-probe", "noise": ".batchwidgets-noise",
          "loader": ".batchwidgets-loader"}
# One notebook of the test's own shows, on tiny models, every kind of panel and static (HTML +
# PNG) report the tutorials show, made the way they make them: nbval runs every tutorial in a
# kernel already, so the browser needs only what each kind of output looks like in JupyterLab
# (running the tutorials 01, 03 and 04 whole here took 6 minutes of a 2-core machine).
PANELS_NOTEBOOK = (
    """import functools
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import batchwidgets as bw
from batchwidgets.datasets import SlowDataset

%load_ext batchwidgets
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters())
loss_fn = nn.functional.cross_entropy


def make_batch(n):
    return torch.randn(n, 64), torch.randint(0, 10, (n,))""",
    # 01: %find_batch's panel, a ProbePanel that probes (the Probe button), and -q's report
    "%find_batch model make_batch --optimizer optimizer --loss-fn loss_fn --budget 8MiB",
    """panel = bw.ProbePanel(probe=functools.partial(
    bw.find_batch, model, make_batch, loss_fn=loss_fn, optimizer=optimizer, budget="8MiB",
    device="cpu"))
panel.start()  # what the Probe button does
panel.wait()
panel""",
    "%find_batch model --input-shape 64 --num-classes 10 --optimizer optimizer --budget 8MiB -q",
    # 03: measure_noise's report, the NoisePanel beside it while a loop trains, the panel and
    # report of %%accumulate --noise, and a NoisePanel of that tracker
    """torch.manual_seed(0)
X = torch.randn(1024, 16)
data = TensorDataset(X, (X @ torch.randn(16, 4) + torch.randn(1024, 4)).argmax(1))
small = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
noise = bw.measure_noise(small, data, loss_fn, batch_sizes=(8, 32, 128), max_examples=1024)
noise""",
    """sgd = torch.optim.SGD(small.parameters(), lr=0.1)
loader = DataLoader(data, batch_size=32, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(0))
tracker = bw.NoiseTracker(ema=0.95, loader=loader, overhead_target=None)
noise_panel = bw.NoisePanel(tracker, report=noise)
display(noise_panel)
with bw.accumulate(sgd, steps=4, model=small, noise=tracker):
    for epoch in range(3):
        for x, y in loader:
            loss_fn(small(x), y).backward()
            sgd.step()
            sgd.zero_grad()
noise_panel.refresh()""",
    "noise_tracker = bw.NoiseTracker(overhead_target=None)",
    """%%accumulate 4 --optimizer sgd --model small --noise noise_tracker
for epoch in range(3):
    for x, y in loader:
        loss_fn(small(x), y).backward()
        sgd.step()
        sgd.zero_grad()""",
    "bw.NoisePanel(noise_tracker)",
    # 04: a LoaderPanel that measures, tune_loader's report, a live loader's panel switched
    # mid-loop and its report
    """loader_panel = bw.LoaderPanel(SlowDataset(1024, work_ms=0.5), batch_size=32,
                               duration_s=0.5, max_workers=2)
loader_panel""",
    """loader_panel.wait()  # its first measurement
bw.tune_loader(SlowDataset(1024, work_ms=0.5), batch_size=32, duration_s=0.5, max_workers=2)""",
    """live = bw.live_loader(SlowDataset(256, work_ms=0.5), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(0))
live_panel = bw.LoaderPanel(live)
display(live_panel)
for i, batch in enumerate(live):
    if i == 2:
        live_panel.num_workers.value = 2  # what choosing 2 in the dropdown does, mid-epoch
live_panel.wait()
print("switches:", len(live.report.switches))""",
    "live.report",
)
# what it shows: 01's two probe panels and one report, 03's three noise panels and two reports
# (measure_noise's, %%accumulate's), 04's two loader panels and two reports
EXPECTED = {"probe": 2, "noise": 3, "loader": 2, "static_reports": 5}


def wait_until(check: Callable[[], T], timeout_s: float, what: str,
               seen: Callable[[], object] | None = None) -> T:
    """Poll ``check`` until it returns something truthy; fail saying what was awaited and what
    was seen last (``seen()``, or the last result of ``check``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            last = seen() if seen is not None else result
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}; last seen: {last!r}")
        time.sleep(POLL_S)


def kernel_state(page: Any, lab_server: Any, notebook: str) -> dict[str, object]:
    """The notebook's kernel as the server sees it, and its name in the page's toolbar."""
    sessions = [session for session in lab_server.api("GET", "sessions")
                if session["path"] == notebook]
    kernel = sessions[0]["kernel"] if len(sessions) == 1 else {}
    toolbar = page.locator(".jp-KernelName").first
    return {"sessions": len(sessions), "execution_state": kernel.get("execution_state"),
            "connections": kernel.get("connections", 0),
            "toolbar": toolbar.inner_text().strip() if toolbar.is_visible() else None}


def kernel_ready(page: Any, lab_server: Any, notebook: str) -> bool:
    """Its kernel is idle, the page is connected to it and shows its name."""
    state = kernel_state(page, lab_server, notebook)
    return (state["execution_state"] == "idle" and state["connections"] >= 1
            and state["toolbar"] not in (None, "", "No Kernel"))


def open_notebook(page: Any, lab_server: Any, path: str, **query: str) -> str:
    """Open the page ``path`` (``lab/tree/NAME`` or ``notebooks/NAME``) and wait until the
    notebook's kernel is idle and connected. Returns the notebook's name."""
    notebook = path.split("/", 2)[-1]
    page.goto(lab_server.url(path, **query), timeout=LOAD_TIMEOUT_S * 1000)
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=LOAD_TIMEOUT_S * 1000)
    wait_until(lambda: kernel_ready(page, lab_server, notebook), LOAD_TIMEOUT_S,
               "an idle, connected kernel", lambda: kernel_state(page, lab_server, notebook))
    return notebook


def menu(page: Any, title: str, command: str) -> None:
    """Click menu ``title`` (File, Edit, Run, ...), then its item for ``command``."""
    page.locator(".lm-MenuBar-item", has_text=title).first.click()
    page.locator(f".lm-Menu-item[data-command='{command}']").click()


def prompts(page: Any) -> list[str]:
    return [text.strip() for text in page.locator(CODE_PROMPTS).all_inner_texts()]


def notebook_text(page: Any) -> str:
    return page.locator(".jp-Notebook").first.text_content() or ""


def errors_in_outputs(page: Any) -> list[str]:
    outputs = page.locator(".jp-Notebook .jp-OutputArea-output").all_text_contents()
    return [text[-800:] for text in outputs
            if "Traceback (most recent call last)" in text or "UsageError" in text]


def clear_outputs(page: Any) -> None:
    """Edit > Clear Outputs of All Cells: every prompt back to ``[ ]``, no stored output left."""
    menu(page, "Edit", "editmenu:clear-all")
    wait_until(lambda: all(prompt == "[ ]:" for prompt in prompts(page)), RENDER_TIMEOUT_S,
               "the stored outputs to be cleared")


def wait_for_cells(page: Any, lab_server: Any, notebook: str) -> None:
    """Wait until no cell is queued or running (``[*]``) and the kernel is idle, then check
    that every code cell ran (a number in its prompt) and none raised."""
    def finished() -> bool:
        return "[*]:" not in prompts(page) and kernel_ready(page, lab_server, notebook)

    wait_until(lambda: "[*]:" in prompts(page) or all(p != "[ ]:" for p in prompts(page)),
               LOAD_TIMEOUT_S, "the cells to start running", lambda: prompts(page))
    wait_until(finished, RUN_TIMEOUT_S, "every cell to finish",
               lambda: (prompts(page), kernel_state(page, lab_server, notebook)))
    assert not errors_in_outputs(page), f"a cell raised: {errors_in_outputs(page)}"
    not_run = [prompt for prompt in prompts(page) if not re.fullmatch(r"\[\d+\]:", prompt)]
    assert not not_run, f"cells that did not run: {prompts(page)}"


def check_widgets_rendered(page: Any) -> None:
    """What a person would see first: no widget that failed, none still loading."""
    wait_until(lambda: "Loading widget..." not in notebook_text(page), RENDER_TIMEOUT_S,
               "every widget to finish loading")
    assert "Error displaying widget" not in notebook_text(page)


def check_image(image: Any, what: str) -> None:
    """``image`` (an ``<img>``) is on screen and its picture decoded, not a broken icon."""
    image.scroll_into_view_if_needed()
    wait_until(lambda: image.evaluate("img => img.complete && img.naturalWidth > 0"),
               RENDER_TIMEOUT_S, f"the {what} to load")
    box = image.bounding_box()
    assert box is not None, f"the {what} has no place on the page"
    assert box["width"] > 100, (what, box)
    assert box["height"] > 100, (what, box)


def check_probe_panel(panel: Any) -> int:
    """The chart, and the same recommended batch size in the summary, the status line and the
    line of code. Returns that batch size."""
    check_image(panel.locator("img.batchwidgets-probe-plot"), "probe chart")
    summary = panel.locator(".batchwidgets-probe-summary").inner_text()
    found = RECOMMENDED.search(summary)
    assert found, f"no recommended_batch_size in the panel's summary: {summary!r}"
    recommended = int(found.group(1))
    assert recommended > 0, summary
    assert f"recommended_batch_size={recommended}" in panel.locator(
        ".batchwidgets-probe-status").inner_text()
    code = panel.locator(".batchwidgets-probe-code input").input_value()
    assert code == f"DataLoader(dataset, batch_size={recommended})"
    return recommended


def check_noise_panel(panel: Any) -> None:
    """The three charts (one picture), the status line and the advice."""
    check_image(panel.locator("img.batchwidgets-noise-plot"), "noise chart")
    assert panel.locator(".batchwidgets-noise-status").inner_text().strip()
    assert "critical batch size" in panel.locator(".batchwidgets-noise-advice").inner_text()


def samples_per_s(panel: Any) -> str:
    return panel.locator(".batchwidgets-loader-samples-per-s").inner_text().strip()


def check_loader_panel(panel: Any) -> None:
    """The controls, a measured samples/s in the readout, the chart of the settings tried."""
    for control in ("num-workers", "pin-memory", "prefetch-factor", "persistent-workers",
                    "batch-size", "autotune"):
        assert panel.locator(f".batchwidgets-loader-{control}").count() == 1, control
    assert re.fullmatch(r"[\d,]+", samples_per_s(panel)), samples_per_s(panel)
    check_image(panel.locator("img.batchwidgets-loader-chart"), "loader chart")


CHECK_PANEL = {"probe": check_probe_panel, "noise": check_noise_panel,
               "loader": check_loader_panel}


def check_static_report(report: Any) -> None:
    """A report without widgets: its table (caption "batchwidgets: ...") and its plot."""
    captions = report.locator("table.batchwidgets caption").all_inner_texts()
    assert any(caption.startswith("batchwidgets: ") for caption in captions), captions
    assert report.locator("table.batchwidgets td").count() > 0
    check_image(report.locator("img[alt='batchwidgets plot']"), "report's plot")


def screenshot(page: Any, element: Any, folder: Path, name: str) -> Path:
    path = folder / name
    page.mouse.move(0, 0)  # no hover highlight on a table row
    element.scroll_into_view_if_needed()
    element.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def test_every_kind_of_panel_and_report_renders_in_jupyterlab(page: Any, lab_server: Any,
                                                              screenshot_dir: Path) -> None:
    notebook = write_notebook(lab_server, "panels.ipynb", *PANELS_NOTEBOOK)
    # ?reset: a fresh workspace, without the tabs an earlier test left open
    open_notebook(page, lab_server, f"lab/tree/{notebook}", reset="")
    menu(page, "Run", "runmenu:run-all")
    wait_for_cells(page, lab_server, notebook)
    check_widgets_rendered(page)
    assert "switches: 1" in notebook_text(page)  # the live loader switched mid-loop

    for kind, selector in PANELS.items():
        panels = page.locator(f".jp-Notebook {selector}")
        assert panels.count() == EXPECTED[kind], kind
        for index, panel in enumerate(panels.all(), start=1):
            CHECK_PANEL[kind](panel)
            screenshot(page, panel, screenshot_dir, f"lab-{kind}-panel-{index}.png")
    reports = page.locator(f".jp-Notebook {STATIC_REPORT}")
    assert reports.count() == EXPECTED["static_reports"]
    for index, report in enumerate(reports.all(), start=1):
        check_static_report(report)
        screenshot(page, report, screenshot_dir, f"lab-report-{index}.png")


def test_tutorial_opens_and_runs_a_panel_in_notebook7(page: Any, lab_server: Any,
                                                      screenshot_dir: Path) -> None:
    """Smoke test: Notebook 7 loads the tutorial, runs the cells up to ``%find_batch`` and shows
    its panel."""
    open_notebook(page, lab_server, "notebooks/01_find_batch.ipynb")
    assert page.locator(".jp-NotebookPanel .jp-Cell").count() > 10  # the whole tutorial
    clear_outputs(page)
    cell = page.locator(".jp-CodeCell", has_text="%find_batch model synthetic_images").first
    cell.locator(".jp-InputPrompt").click()  # select it (command mode)
    menu(page, "Run", "notebook:run-all-above")
    menu(page, "Run", "notebook:run-cell")
    panel = cell.locator(".batchwidgets-probe")
    panel.wait_for(timeout=RUN_TIMEOUT_S * 1000)
    wait_until(lambda: re.fullmatch(r"\[\d+\]:", cell.locator(".jp-InputPrompt").inner_text()),
               RUN_TIMEOUT_S, "the %find_batch cell to finish")
    check_widgets_rendered(page)
    assert not errors_in_outputs(page), f"a cell raised: {errors_in_outputs(page)}"
    check_probe_panel(panel)
    screenshot(page, panel, screenshot_dir, "notebook7-01_find_batch-probe-panel.png")


def write_notebook(lab_server: Any, name: str, *cells: str, kernel: str = "python3") -> str:
    """A notebook of the test's own in the server's folder; returns its name."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": kernel, "display_name": kernel,
                                       "language": "python"}
    nbformat.write(notebook, lab_server.root_dir / name)
    return name


LIVE_NOISE = (
    """import time
import torch
from torch import nn
import batchwidgets as bw

torch.manual_seed(0)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
tracker = bw.NoiseTracker(warmup_updates=2)
panel = bw.NoisePanel(tracker, min_interval_s=0.2)
panel""",
    """w = torch.randn(8, 1)
with bw.accumulate(optimizer, steps=4, model=model, noise=tracker):
    for step in range(4 * 150):  # about 10 s: 150 updates of 4 micro-batches
        x = torch.randn(16, 8)
        y = x @ w + 0.5 * torch.randn(16, 1)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.015)
panel.refresh()""",
)


def test_the_noise_chart_changes_while_the_training_loop_runs(page: Any, lab_server: Any,
                                                              screenshot_dir: Path) -> None:
    notebook = write_notebook(lab_server, "live_noise.ipynb", *LIVE_NOISE)
    open_notebook(page, lab_server, f"lab/tree/{notebook}", reset="")
    menu(page, "Run", "runmenu:run-all")
    chart = page.locator(".jp-Notebook img.batchwidgets-noise-plot")
    chart.wait_for(timeout=LOAD_TIMEOUT_S * 1000)
    loop_prompt = page.locator(".jp-Notebook .jp-CodeCell").nth(1).locator(".jp-InputPrompt")
    wait_until(lambda: loop_prompt.inner_text().strip() == "[*]:", LOAD_TIMEOUT_S,
               "the training loop to start", lambda: prompts(page))
    seen = set()  # the pictures the page showed while the loop ran (a new blob URL each)
    while loop_prompt.inner_text().strip() == "[*]:":
        seen.add(chart.get_attribute("src"))
        time.sleep(0.1)
    wait_for_cells(page, lab_server, notebook)
    check_widgets_rendered(page)
    assert len(seen - {None}) >= 3, f"the chart changed {len(seen) - 1} times during the loop"
    outputs = page.locator(".jp-Notebook .jp-OutputArea-output")
    assert outputs.count() == 1, "the loop printed or displayed something: no flooding allowed"
    panel = page.locator(".jp-Notebook .batchwidgets-noise")
    check_noise_panel(panel)
    assert "B_simple" in panel.locator(".batchwidgets-noise-status").inner_text()
    screenshot(page, panel, screenshot_dir, "lab-live-noise-panel.png")


LIVE_LOADER = (
    """import batchwidgets as bw
from batchwidgets.datasets import SlowDataset

panel = bw.LoaderPanel(SlowDataset(2048, work_ms=2.0), batch_size=32, duration_s=1.0,
                       max_workers=2)
panel""",
)


def test_choosing_num_workers_in_the_loader_panel_changes_the_readout(
        page: Any, lab_server: Any, screenshot_dir: Path) -> None:
    notebook = write_notebook(lab_server, "live_loader.ipynb", *LIVE_LOADER)
    open_notebook(page, lab_server, f"lab/tree/{notebook}", reset="")
    menu(page, "Run", "runmenu:run-all")
    wait_for_cells(page, lab_server, notebook)
    check_widgets_rendered(page)
    panel = page.locator(".jp-Notebook .batchwidgets-loader")
    status = panel.locator(".batchwidgets-loader-status")
    wait_until(lambda: status.inner_text().startswith("no workers:"), RUN_TIMEOUT_S,
               "the first measurement (no workers)", status.inner_text)
    before = samples_per_s(panel)
    check_loader_panel(panel)

    panel.locator(".batchwidgets-loader-num-workers select").select_option(label="2")
    wait_until(lambda: status.inner_text().startswith("2 workers"), RUN_TIMEOUT_S,
               "the panel to measure 2 workers", status.inner_text)
    after = samples_per_s(panel)
    assert after != before, (before, after)
    assert panel.locator("img.batchwidgets-loader-chart").count() == 1
    screenshot(page, panel, screenshot_dir, "lab-live-loader-panel.png")


RUNNING_LOOP = (
    """import time
import torch
from torch.utils.data import DataLoader, TensorDataset
import batchwidgets as bw

data = TensorDataset(torch.arange(2400))
live = bw.live_loader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
panel = bw.LoaderPanel(live, max_workers=2)
panel""",
    """seen, workers = [], []
for i, (x,) in enumerate(live):  # 600 batches of about 25 ms: 15 s to click in
    seen.append(x.tolist())
    workers.append(live.num_workers)
    time.sleep(0.025)
plain = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
switches = [(s.epoch, s.batch, s.new["num_workers"]) for s in live.report.switches]
print("order", seen == [x.tolist() for (x,) in plain], "switches", switches)""",
)


@pytest.mark.parametrize("front_end", ["lab/tree", "notebooks"])
def test_a_click_while_the_training_cell_runs_switches_its_loader_mid_loop(
        page: Any, lab_server: Any, front_end: str) -> None:
    """JupyterLab and Notebook 7: choosing 2 workers in the panel while the loop's cell runs
    ([*]) switches that loop at its next batch, not when the cell ends; the order is kept."""
    notebook = write_notebook(lab_server, f"running_loop_{front_end.split('/')[0]}.ipynb",
                              *RUNNING_LOOP)
    open_notebook(page, lab_server, f"{front_end}/{notebook}", reset="")
    menu(page, "Run", "runmenu:run-all")
    loop_prompt = page.locator(".jp-Notebook .jp-CodeCell").nth(1).locator(".jp-InputPrompt")
    wait_until(lambda: loop_prompt.inner_text().strip() == "[*]:", LOAD_TIMEOUT_S,
               "the training loop to start", lambda: prompts(page))
    panel = page.locator(".jp-Notebook .batchwidgets-loader")
    panel.locator(".batchwidgets-loader-num-workers select").select_option(label="2")
    assert loop_prompt.inner_text().strip() == "[*]:", "the loop ended before the click"
    wait_for_cells(page, lab_server, notebook)
    output = page.locator(".jp-Notebook .jp-CodeCell").nth(1).locator(".jp-OutputArea-output")
    text = output.inner_text()
    assert "order True" in text, text
    switches = re.findall(r"\((\d+), (\d+), (\d+)\)", text)
    assert len(switches) == 1, text
    epoch, batch, workers = map(int, switches[0])
    assert (epoch, workers) == (0, 2), text
    assert 0 < batch < 600, text  # mid-loop


THEMED_PROBE = (
    """import torch
from torch import nn
import batchwidgets as bw

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters())
report = bw.find_batch(model, lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
                       loss_fn=nn.functional.cross_entropy, optimizer=optimizer, budget="8MiB")
bw.ProbePanel(report)""",
)
CUT_OFF = """panel => [...panel.querySelectorAll('.bw-label, .bw-html, .bw-description, button')]
    .filter(el => el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1)
    .map(el => el.className + ': ' + el.textContent.slice(0, 60))"""
BROKEN_IMAGES = """panel => [...panel.querySelectorAll('img')]
    .filter(img => img.style.display !== 'none' && !(img.complete && img.naturalWidth > 0))
    .length"""


def change_theme(page: Any, theme: str) -> None:
    """Settings > Theme > ``theme``, as a person picks it."""
    page.locator(".lm-MenuBar-item", has_text="Settings").first.click()
    page.locator(".lm-Menu-item", has_text="Theme").first.hover()
    page.locator(".lm-Menu-item[data-command='apputils:change-theme']",
                 has_text=theme).first.click()
    wait_until(lambda: page.evaluate("document.body.dataset.jpThemeName") == theme,
               RENDER_TIMEOUT_S, f"the {theme} theme")


def brightness(css_color: str) -> float:
    """0 (black) to 1 (white), from ``rgb(r, g, b)``."""
    r, g, b = (int(v) for v in re.findall(r"\d+", css_color)[:3])
    return (0.299 * r + 0.587 * g + 0.114 * b) / 255


def test_the_probe_panel_fits_1024_px_and_follows_the_light_and_dark_themes(
        page: Any, lab_server: Any, screenshot_dir: Path) -> None:
    page.set_viewport_size({"width": 1024, "height": 900})
    notebook = write_notebook(lab_server, "themed_probe.ipynb", *THEMED_PROBE)
    open_notebook(page, lab_server, f"lab/tree/{notebook}", reset="")
    menu(page, "Run", "runmenu:run-all")
    wait_for_cells(page, lab_server, notebook)
    check_widgets_rendered(page)
    panel = page.locator(".jp-Notebook .batchwidgets-probe")
    check_probe_panel(panel)
    assert "largest batch" in panel.locator(".batchwidgets-probe-answer").inner_text()
    assert panel.evaluate(CUT_OFF) == []  # no text cut off at 1024 px
    assert panel.evaluate(BROKEN_IMAGES) == 0
    colours = {}
    try:
        for theme, name in (("JupyterLab Light", "light"), ("JupyterLab Dark", "dark")):
            change_theme(page, theme)
            colours[name] = panel.evaluate("el => getComputedStyle(el).color")
            screenshot(page, panel, screenshot_dir, f"lab-probe-panel-{name}.png")
    finally:
        change_theme(page, "JupyterLab Light")  # the server's settings outlive this test
    assert brightness(colours["light"]) < 0.4 < 0.6 < brightness(colours["dark"]), colours


PANEL_TO_CLICK = (
    """import ipywidgets, torch
from torch.utils.data import TensorDataset
import batchwidgets as bw

print("ipywidgets", ipywidgets.__version__)
panel = bw.LoaderPanel(TensorDataset(torch.arange(256.0).reshape(64, 4)), batch_size=8,
                       device="cpu", duration_s=0.05, max_workers=2)
panel""",
)


@pytest.mark.parametrize(("front_end", "kernel", "widgets"), [
    ("lab/tree", WIDGETS7_KERNEL, "7.7"),  # Colab's ipywidgets beside JupyterLab 4's manager
    ("notebooks", "python3", "8."),  # Notebook 7
], ids=["jupyterlab4-kernel-ipywidgets7", "notebook7"])
def test_a_click_in_the_panel_reaches_the_kernel(page: Any, lab_server: Any,
                                                 screenshot_dir: Path, front_end: str,
                                                 kernel: str, widgets: str) -> None:
    """The panel renders and a choice in it reaches the kernel, which measures it and draws
    the result back. With ipywidgets 7.7 in the kernel under JupyterLab 4, the panels showed
    nothing before they were anywidget widgets ("VBoxModel not registered")."""
    specs = lab_server.api("GET", "kernelspecs")["kernelspecs"]
    if kernel not in specs:
        pytest.skip("no ipywidgets 7.7 in .ipywidgets7 (pip install --target .ipywidgets7 "
                    "--no-deps 'ipywidgets==7.7.*' ipython_genutils)")
    notebook = write_notebook(lab_server, f"click_{kernel}.ipynb", *PANEL_TO_CLICK,
                              kernel=kernel)
    fresh = {"reset": ""} if front_end.startswith("lab") else {}  # Lab: a fresh workspace
    open_notebook(page, lab_server, f"{front_end}/{notebook}", **fresh)
    menu(page, "Run", "runmenu:run-all")
    wait_for_cells(page, lab_server, notebook)
    assert f"ipywidgets {widgets}" in notebook_text(page)
    check_widgets_rendered(page)
    panel = page.locator(".jp-Notebook .batchwidgets-loader")
    wait_until(lambda: re.fullmatch(r"[\d,]+", samples_per_s(panel)), RUN_TIMEOUT_S,
               "the first measurement", lambda: samples_per_s(panel))
    panel.locator(".batchwidgets-loader-num-workers select").select_option(label="2")
    status = panel.locator(".batchwidgets-loader-status")
    wait_until(lambda: "2 workers" in status.inner_text(), RUN_TIMEOUT_S,
               "the kernel to measure 2 workers", status.inner_text)
    check_loader_panel(panel)
    screenshot(page, panel, screenshot_dir, f"click-{kernel}-{front_end.split('/')[0]}.png")
