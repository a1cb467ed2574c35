"""The README stays a newcomer's path (at most 250 lines; the reference lives in docs/), and every
relative link in README.md and docs/*.md points at a file that exists, and at a heading that
exists where the link names one (``page.md#anchor``, GitHub's anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
