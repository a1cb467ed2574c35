"""The panels: anywidget front ends over the engine, one module each.

- ``probe.py``   ProbePanel   ``find_batch`` live: progress, memory and throughput plots, headroom
- ``noise.py``   NoisePanel   per-batch losses and the gradient noise scale while training runs
- ``loader.py``  LoaderPanel  DataLoader options as live toggles, throughput, auto-tune; given a
  live loader, its controls switch the running loop at its next batch and its readout is that
  loop's own numbers, refreshed while the cell runs
- ``_controls.py`` one anywidget per panel (``static/panel.js``, ``static/panel.css``) and its
  controls: Python facades with ipywidgets' names over one synced trait
- ``_panel.py``  what every panel shares: live display with a static copy refreshed in place,
  the plot's PNG at one resolution
- ``_runner.py`` the background worker: the latest request wins, the one in flight is stopped

One ES module, no ipywidgets children: the same panel in JupyterLab, Notebook 7, Classic
Notebook 6, VS Code, Colab and marimo, with ipywidgets 7.7 or 8 in the kernel.
"""

import importlib

from ._panel import WIDGET_VIEW
from .probe import ProbePanel

_LAZY = {"NoisePanel": ".noise", "LoaderPanel": ".loader"}
__all__ = ["WIDGET_VIEW", "LoaderPanel", "NoisePanel", "ProbePanel"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'batchwidgets.widgets' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
