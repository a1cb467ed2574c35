"""The built sdist and wheel, not only the editable checkout: they carry the panels' front end
(the ES module and stylesheet anywidget sends to the browser) beside the Python code."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile

import pytest
from _paths import ROOT


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


@pytest.mark.slow
def test_the_sdist_carries_the_assets_into_the_wheel_built_from_it(tmp_path):
    pytest.importorskip("setuptools")
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_sdist(sys.argv[1]))")
    name = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    sdist = tmp_path / name
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(n.endswith("batchwidgets/widgets/static/panel.js") for n in names)
    assert any(n.endswith("batchwidgets/widgets/static/panel.css") for n in names)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheel"), str(sdist)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("batchwidgets-*.whl")
    assert {"batchwidgets/widgets/static/panel.js", "batchwidgets/widgets/static/panel.css"} \
        <= set(zipfile.ZipFile(wheel).namelist())
