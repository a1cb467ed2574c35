"""The built wheel, not only the editable checkout: it carries the panels' front end (the ES
module and stylesheet anywidget sends to the browser) beside the Python code."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_every_panel_asset(tmp_path):
    pytest.importorskip("setuptools")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("batchwidgets-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = ROOT / "batchwidgets" / "widgets" / "static"
    assets = sorted(p.name for p in static.iterdir())
    assert assets == ["panel.css", "panel.js"]
    for asset in assets:
        assert f"batchwidgets/widgets/static/{asset}" in names
    assert "batchwidgets/widgets/_controls.py" in names
