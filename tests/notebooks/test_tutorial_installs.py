"""Every tutorial installs what it imports. Each notebook's code cells are read as IPython runs
them (magics included; the Python bodies of ``%%accumulate`` and ``%%find_batch`` too), its
imports are mapped to distributions, the distributions some names need only when they run are
added (transformers' ``Trainer`` and ``TrainingArguments`` need accelerate: "Using the `Trainer`
with `PyTorch` requires `accelerate>=1.1.0`"), and each must be installed by the notebook's install
cell (on Colab, or wherever it is opened) and by Binder's environment (binder/requirements.txt,
then binder/postBuild's install of this checkout)."""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from _paths import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# the import name -> the distribution pip installs it from, for what the tutorials import
DISTRIBUTIONS = {
    "accelerate": "accelerate", "batchwidgets": "batchwidgets", "IPython": "ipython",
    "ipywidgets": "ipywidgets", "lightning": "lightning", "matplotlib": "matplotlib",
    "numpy": "numpy", "sklearn": "scikit-learn", "torch": "torch",
    "transformers": "transformers",
}
# (module, name) -> the distribution that name needs when it runs, though nothing imports it
RUN_TIME_NEEDS = {
    ("transformers", "Trainer"): "accelerate",
    ("transformers", "TrainingArguments"): "accelerate",
}
# cell magics whose body is Python that runs in the notebook's namespace
PYTHON_CELL_MAGICS = {"accumulate", "find_batch", "capture", "time", "timeit"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cells(notebook: Path) -> list[str]:
    """The notebook's code cells as the Python IPython runs (``%pip`` -> run_line_magic...)."""
    transform = TransformerManager().transform_cell
    return [transform("".join(cell["source"]))
            for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]


def magic_calls(tree: ast.AST, kind: str):
    """``(magic name, its line or body)`` for each get_ipython().run_<kind>_magic(...) call."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == f"run_{kind}_magic"
                and all(isinstance(arg, ast.Constant) for arg in node.args)):
            yield node.args[0].value, node.args[-1].value


def uses(source: str, aliases: dict[str, str]) -> set[tuple[str, str | None]]:
    """``(top-level module, name or None)`` for each import and each ``module.name`` it reads;
    ``aliases`` (a name -> the top-level module it is bound to) carries over from cell to cell."""
    tree = ast.parse(source)
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                found.add((top, None))
                aliases[(alias.asname or alias.name).split(".")[0]] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            found |= {(top, None), *((top, alias.name) for alias in node.names)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            found.add((aliases[node.value.id], node.attr))
    for magic, body in magic_calls(tree, "cell"):
        if magic in PYTHON_CELL_MAGICS:
            found |= uses(body, aliases)
    return found


def needs(notebook: Path) -> set[str]:
    """The distributions the notebook needs installed, beyond the standard library."""
    aliases: dict[str, str] = {}
    used = set().union(*(uses(code, aliases) for code in cells(notebook)))
    modules = {module for module, _ in used} - set(sys.stdlib_module_names)
    unknown = modules - set(DISTRIBUTIONS)
    assert not unknown, (f"{notebook.name} imports {sorted(unknown)}: add each to DISTRIBUTIONS "
                         f"in {Path(__file__).name}, with the distribution pip installs it from")
    return ({DISTRIBUTIONS[module] for module in modules}
            | {need for use, need in RUN_TIME_NEEDS.items() if use in used})


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s<>=!~\[@;]", requirement.strip(), maxsplit=1)[0])


@cache
def batchwidgets_dependencies() -> frozenset[str]:
    """What installing batchwidgets brings: pyproject.toml's dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    return frozenset(requirement_name(line.split("#")[0].strip().strip(",").strip('"'))
                     for line in block.splitlines() if line.split("#")[0].strip())


def with_dependencies(installed: set[str]) -> set[str]:
    return installed | (batchwidgets_dependencies() if "batchwidgets" in installed else set())


def pip_installs(line: str) -> set[str]:
    """The distributions one ``pip install ...`` line names (options and their values left out)."""
    words = shlex.split(line)
    assert words[:1] == ["install"], line
    named, skip = set(), False
    for word in words[1:]:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in {"-r", "-c", "-e", "-i", "--index-url", "--extra-index-url",
                            "--target", "-t", "--find-links", "-f", "--requirement"}
        else:
            named.add(requirement_name(word))
    return named


def install_cell(notebook: Path) -> str:
    with_pip = [code for code in cells(notebook)
                if any(magic == "pip" for magic, _ in magic_calls(ast.parse(code), "line"))]
    assert len(with_pip) == 1, f"{notebook.name} should have one install cell (with %pip)"
    return with_pip[0]


def installed_by_cell(notebook: Path) -> set[str]:
    lines = [line for magic, line in magic_calls(ast.parse(install_cell(notebook)), "line")
             if magic == "pip"]
    return with_dependencies(set().union(*map(pip_installs, lines)))


def installed_by_binder() -> set[str]:
    """binder/requirements.txt, then the checkout postBuild installs (pip install -e .)."""
    text = (ROOT / "binder" / "requirements.txt").read_text()
    named = {requirement_name(line.split("#")[0]) for line in text.splitlines()
             if line.split("#")[0].strip() and not line.lstrip().startswith("-")}
    if re.search(r"pip install\b.*\s\.\s*$", (ROOT / "binder" / "postBuild").read_text(),
                 re.MULTILINE):
        named.add("batchwidgets")
    return with_dependencies(named)


def test_the_tutorials_are_found_and_tutorial_05_needs_accelerate_for_its_trainer():
    assert len(NOTEBOOKS) >= 8
    huggingface = next(notebook for notebook in NOTEBOOKS if "huggingface" in notebook.name)
    assert {"transformers", "accelerate", "torch", "batchwidgets"} <= needs(huggingface)
    assert "scikit-learn" in needs(next(nb for nb in NOTEBOOKS if "noise" in nb.name))
    assert {"batchwidgets", "torch", "matplotlib"} <= installed_by_binder()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda notebook: notebook.stem)
def test_the_install_cell_installs_what_the_tutorial_imports(notebook: Path):
    missing = needs(notebook) - installed_by_cell(notebook)
    assert not missing, (f"{notebook.name} needs {sorted(missing)}, which its install cell does "
                         f"not install:\n{install_cell(notebook)}")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda notebook: notebook.stem)
def test_binder_installs_what_the_tutorial_imports(notebook: Path):
    missing = needs(notebook) - installed_by_binder()
    assert not missing, (f"{notebook.name} needs {sorted(missing)}, which binder/requirements.txt "
                         "(with postBuild's install of batchwidgets) does not install")
