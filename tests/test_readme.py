"""The README stays a newcomer's path (at most 250 lines; the reference lives in docs/), and every
relative link in README.md and docs/*.md points at a file that exists, and at a heading that
exists where the link names one (``page.md#anchor``, GitHub's anchors).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _paths import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2... for
    repeats."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(prose(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", prose(page.read_text()))  # [`name`](target) keeps its target
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


def test_readme_is_at_most_250_lines():
    n_lines = len(README.read_text().splitlines())
    assert n_lines <= MAX_README_LINES, (
        f"README.md should have at most {MAX_README_LINES} lines, but got {n_lines}; move "
        f"reference material into a page of docs/ and link it.")


def test_readme_keeps_the_ci_test_command():
    """.ci/run runs the line after '# 2. ' in the README's first code block."""
    lines = README.read_text().splitlines()
    first = lines.index(next(line for line in lines if line.startswith("# 2. ")))
    assert lines[first + 1].startswith("pip install -e "), lines[first + 1]
    assert "python -m pytest" in lines[first + 1]


def first_block() -> list[str]:
    """The lines of the README's first code block, the one a newcomer copies whole."""
    return FENCE.search(README.read_text()).group(0).splitlines()[1:-1]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu machine", "gpu machine"])
def test_the_first_block_installs_the_cpu_torch_first_on_a_machine_without_a_gpu(tmp_path, gpu):
    """What the first block runs before command 1, in bash with a pip that only records what it
    was asked, and an nvidia-smi only on the GPU machine: the CPU build of torch where there is no
    GPU (a plain "torch" would pull the multi-GB CUDA build), nothing where there is one."""
    lines = first_block()
    before = lines[:next(i for i, line in enumerate(lines) if line.startswith("# 1. "))]
    asked = tmp_path / "asked"
    (tmp_path / "pip").write_text(f'#!/bin/sh\necho "$@" >> {asked}\n')
    if gpu:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n")
    for tool in tmp_path.iterdir():
        tool.chmod(0o755)
    subprocess.run([shutil.which("bash"), "-c", "\n".join(before)], check=True, timeout=60,
                   env={**os.environ, "PATH": str(tmp_path)})
    said = asked.read_text().splitlines() if asked.exists() else []
    if gpu:
        assert said == []
    else:
        assert said == ["install torch --index-url https://download.pytorch.org/whl/cpu"]


def test_command_2_says_what_it_installs_and_how_long_it_takes():
    """The test extras a newcomer would not expect (a browser driver, two notebook front ends, a
    trainer framework...) are named beside command 2, and so is its time."""
    text = README.read_text()
    top = text[:text.index("\n## ")]  # the first block and the prose under it
    (command_2,) = [line for line in first_block() if line.startswith("# 2. ")]
    assert re.search(r"\d+ minutes", command_2), command_2
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^test = \[(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL).group(1)
    names = {re.match(r'\s*"([A-Za-z0-9_.-]+)', line).group(1)
             for line in extra.splitlines() if line.strip().startswith('"')}
    tooling = {"pytest-timeout", "ruff", "numpy", "nbclient", "ipykernel"}  # small, expected
    unnamed = {name for name in names - tooling if name.lower() not in top.lower()}
    assert not unnamed, f"the README's top should name what command 2 installs: {sorted(unnamed)}"


def test_the_install_docs_name_the_torchvision_trap_and_its_fix():
    """On a CPU machine a plain `pip install torchvision` brings a CUDA build that fails beside the
    CPU torch, and transformers (which imports torchvision when present) fails with it."""
    text = README.read_text()
    install = text[text.index("\n## Install\n"):text.index("\n## Tutorials\n")]
    page = (ROOT / "docs" / "install.md").read_text()
    troubleshooting = page[page.index("\n## Troubleshooting\n"):]
    for said in (install, troubleshooting):
        flat = " ".join(said.split())
        assert "torchvision::nms does not exist" in flat
        assert "pip install torchvision --index-url https://download.pytorch.org/whl/cpu" in flat


def test_there_are_docs_pages_and_the_readme_links_them():
    pages = {page.name for page in PAGES[1:]}
    assert "README.md" in pages  # the index
    linked = {target.split("#")[0] for target in relative_links(README)}
    assert {f"docs/{name}" for name in pages} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_at_something_that_exists(page: Path):
    links = relative_links(page)
    assert links or page == README, f"{page.name} should link somewhere"
    missing = []
    for target in links:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            missing.append(f"{target} (no {resolved.relative_to(ROOT)})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            missing.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"
