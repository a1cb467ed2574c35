"""Where the tests find the checkout: ``ROOT``, the repository, and ``TESTS``, this folder, which
holds the helper modules (``_tiny_lm.py``, ``_emulated_device.py``, ...) that the processes a
test starts import (``PYTHONPATH``)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
