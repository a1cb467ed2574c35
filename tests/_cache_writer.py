"""A process that writes one cache entry again and again (tests/engine/probe/test_remembered.py
starts several at once with multiprocessing): it imports the cache module alone, so it starts
fast."""

from __future__ import annotations

import os


def write_many(folder: str, key: str, writer: int, times: int) -> None:
    os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
    from batchwidgets.engine.probe import _cache

    for i in range(times):
        # large enough that a write is not one system call: a torn file would show
        _cache.write("find_batch", key, {"writer": writer, "i": i, "padding": "x" * (writer + 1)
                                         * 200_000})
