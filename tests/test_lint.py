"""The code base stays ruff-clean (the rules are in pyproject.toml)."""

import subprocess
import sys

from _paths import ROOT


def test_ruff_finds_nothing_to_fix():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
