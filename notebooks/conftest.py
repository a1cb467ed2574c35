"""nbval runs every notebook here (see ``addopts`` in pyproject.toml). Cells tagged ``gpu`` need a
CUDA device: they get the ``gpu`` marker and are skipped without one. The kernels keep
find_batch's remembered answers in a folder of each notebook's own, never the user's cache nor
another notebook's."""

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # the kernels nbval starts inherit this environment: they import this checkout's
    # batchwidgets (not another one the environment has installed), as tests/'s processes do
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])
    folder = tempfile.mkdtemp(prefix="batchwidgets-cache-")
    os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
    config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before nbval starts a notebook's kernel (at its first cell): a new, empty folder, so no
    # notebook gives back an answer another one measured
    notebook = item.parent
    if getattr(notebook, "kernel", False) is None:  # nbval's IPyNbFile, its kernel not started
        folder = tempfile.mkdtemp(prefix="batchwidgets-cache-")
        os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
        item.config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))


def pytest_collection_modifyitems(items):
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the cell is tagged gpu and there is no CUDA device")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's notebook cells
        if cell is not None and "gpu" in cell.metadata.get("tags", []):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(no_gpu)
