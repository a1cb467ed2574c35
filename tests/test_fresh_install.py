"""A newcomer's install, as CI can make it: the built wheel (not this checkout) in a fresh virtual
environment built from binder/requirements.txt, then the README's first command's demo, and a
panel whose front end (ES module, stylesheet) comes from the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from _paths import ROOT

PANEL = """
import batchwidgets as bw
from batchwidgets.results import Attempt, BatchSizeReport
report = BatchSizeReport(max_batch_size=8, first_oom_batch_size=9, device="cpu",
                         attempts=(Attempt(8, True, 2**20, 0.01), Attempt(9, False, None, None)),
                         budget_bytes=2**21)
panel = bw.ProbePanel(report)
assert "export default" in panel._esm and ".batchwidgets-panel" in panel._css
assert bw.__file__.startswith({prefix!r}), bw.__file__  # the installed copy, not the checkout
print("panel", panel.answer.value)
"""


def run(*command: str, cwd: Path, timeout: float = 600) -> str:
    # the fresh environment's matplotlib keeps its font cache to itself: the user's cache
    # (~/.cache/matplotlib) is shared by every matplotlib of a version, and one written from an
    # environment that is then deleted leaves the others without its fonts (STIX, for mathtext)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                               "PYTHONPATH": "", "MPLCONFIGDIR": str(cwd / "matplotlib")})
    said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{' '.join(command)}\n{said}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_beside_binders_requirements_and_runs_the_demo_and_a_panel(tmp_path):
    pytest.importorskip("setuptools")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "--wheel-dir", str(tmp_path / "dist"), str(ROOT), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("batchwidgets-*.whl")
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = str(env / "bin" / "python")
    # this pip installs into the fresh environment (--python: no pip of its own to bootstrap),
    # and --no-compile leaves the bytecode to the imports that need it: byte-compiling every
    # file of torch, transformers and JupyterLab was half of the install's CPU time
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile"]
    try:
        run(*pip, "--retries", "1", "--timeout", "15",
            "-r", str(ROOT / "binder" / "requirements.txt"), cwd=tmp_path)
    except AssertionError as error:  # no package index reachable: say so, do not fail
        pytest.skip(f"binder/requirements.txt could not be installed here: {str(error)[-200:]}")
    run(*pip, str(wheel), cwd=tmp_path)
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=tmp_path).strip()
    demo = run(python, "-m", "batchwidgets", "demo", cwd=tmp_path)
    assert "max_batch_size" in demo
    assert (tmp_path / "batchwidgets-demo.png").stat().st_size > 1000
    shown = run(python, "-c", PANEL.format(prefix=site), cwd=tmp_path)
    assert "largest batch <b" in shown
