"""``python -m batchwidgets demo``, the first thing a new user runs: a report table and a PNG."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchwidgets", *arguments], capture_output=True,
                          text=True, timeout=300)


def test_demo_prints_the_report_as_a_table_and_writes_a_png_plot(tmp_path):
    plot = tmp_path / "probe.png"
    result = run_cli("demo", "--device", "cpu", "--budget", "16MiB", "--max-batch-size", "4",
                     "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["device", "cpu"]
    assert any(line.split()[:2] == ["max_batch_size", "4"] for line in lines)
    assert any(line.split()[:1] == ["recommended_batch_size"] for line in lines)
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "size"])
    rows = [line.split() for line in lines[header + 1:] if line.strip()][:-1]
    # BatchNorm: starts at 2, traced on fake tensors first; the real step at the edge, 4
    assert [row[:2] for row in rows] == [["2", "fake"], ["4", "fake"], ["4", "yes"]]
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert lines[-1] == f"plot written to {plot}"


def test_help_documents_the_demo_options():
    result = run_cli("demo", "--help")
    assert result.returncode == 0
    for option in ("--device", "--budget", "--amp", "--max-batch-size", "--plot"):
        assert option in result.stdout
    top = run_cli("--help")
    assert "demo" in top.stdout


def test_a_bad_option_is_a_usage_error_not_a_traceback():
    result = run_cli("demo", "--amp", "fp8")
    assert result.returncode == 2
    assert "invalid choice: 'fp8'" in result.stderr
    assert "Traceback" not in result.stderr
