"""nbval runs every notebook here (see ``addopts`` in pyproject.toml). Cells tagged ``gpu`` need a
CUDA device: they get the ``gpu`` marker and are skipped without one."""

import pytest
import torch


def pytest_collection_modifyitems(items):
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the cell is tagged gpu and there is no CUDA device")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's notebook cells
        if cell is not None and "gpu" in cell.metadata.get("tags", []):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(no_gpu)
