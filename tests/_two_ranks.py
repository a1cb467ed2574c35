"""Two gloo processes on the CPU running a worker script, for the tests of find_batch and
accumulate inside a job (tests/engine/probe/test_distributed.py, test_unused_parameters.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def run_two_ranks(folder: Path, worker: str, extra: Callable[[int], list[str]] = lambda rank: [],
                  timeout: float = 240) -> list[dict]:
    """Each rank's JSON: ``worker`` run as ``worker.py RANK INIT_FILE *extra(rank) OUT`` in two
    processes that meet through INIT_FILE; both must exit 0 (their output shown otherwise)."""
    script = folder / "worker.py"
    script.write_text(worker)
    outputs = [folder / f"rank{rank}.json" for rank in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, str(script), str(rank), str(folder / "init"),
                                 *extra(rank), str(outputs[rank])], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in range(2)]
    logs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], logs  # gloo aborted: -6
    return [json.loads(path.read_text()) for path in outputs]
