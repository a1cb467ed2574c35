"""The torchrun example of docs/distributed.md (find_batch inside every rank of a 2-process FSDP2
job; the README links it) runs as written: the block between its markers, under
``python -m torch.distributed.run``, gloo on the CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the example builds a GPT-2 from a config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
BEGIN = "<!-- begin: tests/test_readme_torchrun.py"
END = "<!-- end: tests/test_readme_torchrun.py -->"
ANSWER = re.compile(r"^(\d+) (\d+)$", re.MULTILINE)  # print(dist.get_rank(), max_batch_size)


def readme_example() -> str:
    """The ```python block between the markers, exactly as docs/distributed.md shows it."""
    text = PAGE.read_text()
    assert text.count(BEGIN) == 1, f"docs/distributed.md should have one line starting {BEGIN!r}"
    assert text.count(END) == 1, f"docs/distributed.md should have one line {END!r}"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    found = re.fullmatch(r"[^\n]*\n```python\n(.*)```\n", block, re.DOTALL)
    assert found, "between the page's markers there should be one ```python block, no more"
    return found.group(1)


def test_readme_example_is_the_block_between_the_markers():
    script = readme_example()
    assert "bw.find_batch(" in script
    assert "dist.init_process_group(" in script


@pytest.mark.slow
def test_readme_torchrun_example_gives_one_answer_on_both_ranks(tmp_path):
    script = readme_example()
    (tmp_path / "probe.py").write_text(script)
    # each rank's stdout in its own file (torchrun's --redirects, under --log-dir): on the one
    # pipe both ranks shared, CI once read rank 1's line alone
    logs = tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "--log-dir", str(logs), "--redirects", "1", "probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    # <log-dir>/<run id>_<random>/attempt_0/<local rank>/stdout.log (one node: the rank)
    files = sorted(logs.glob("*/attempt_0/*/stdout.log"))
    said = {int(path.parent.name): path.read_text() for path in files}
    log = "".join(f"{path.relative_to(tmp_path)}:\n{path.read_text()}\n" for path in files)
    log = (f"{log or f'no */attempt_0/*/stdout.log under {logs}'}\n"
           f"torchrun's stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}")
    assert done.returncode == 0, log
    assert sorted(said) == [0, 1], log
    lines = {rank: ANSWER.findall(text) for rank, text in said.items()}
    # each rank's file has its one line, starting with its own rank
    assert all(len(found) == 1 and int(found[0][0]) == rank
               for rank, found in lines.items()), log
    answers = {rank: int(found[0][1]) for rank, found in lines.items()}
    assert sorted(answers) == [0, 1], log
    assert answers[0] == answers[1] > 0, log
    # the example's comment says what it prints: "(4 here, per rank)"
    claimed = re.search(r"\((\d+) here, per rank\)", script)
    assert claimed, "the example's print line should say the answer it gives: '(N here, per rank)'"
    assert answers[0] == int(claimed.group(1)), log
