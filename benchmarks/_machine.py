"""What the benchmarks write at the top of their results: the commit measured and the device.
Imported by the scripts beside it (``python benchmarks/<name>.py`` puts this folder on the path)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def commit() -> str:
    """The checkout's commit (``+`` if tracked files differ from it): the engine changes often."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty=+"], check=True,
                              cwd=Path(__file__).parent, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's with the torch threads the timing used."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
