"""Import boundaries (STYLE G6, G1), each checked in a fresh interpreter or in the source itself:
``import batchwidgets`` loads nothing heavy, ``batchwidgets.results`` needs no torch and never
imports the engine, the engine never loads the notebook UI, and the engine's rooms import only
what engine/__init__.py says they may."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import batchwidgets

PACKAGE = Path(batchwidgets.__file__).parent

HEAVY = ("torch", "IPython", "ipywidgets", "matplotlib")
NOTEBOOK_STACK = ("IPython", "ipywidgets", "matplotlib")


def loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return which HEAVY modules it left in sys.modules."""
    report = (f'print(json.dumps({{"loaded": [m for m in {HEAVY!r} if m in sys.modules], '
              f'"extra": globals().get("extra")}}))')
    probe = "\n".join(["import json, sys", textwrap.dedent(code), report])
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_batchwidgets_loads_no_torch_ipython_ipywidgets_or_matplotlib():
    assert loaded_after("import batchwidgets")["loaded"] == []


def test_the_report_classes_load_without_torch():
    assert loaded_after("import batchwidgets.results")["loaded"] == []


def test_every_engine_module_and_a_whole_probe_run_without_the_notebook_stack():
    outcome = loaded_after("""
import importlib, pkgutil
import batchwidgets.engine as engine
names = sorted(m.name for m in pkgutil.walk_packages(engine.__path__, "batchwidgets.engine."))
for name in names:
    importlib.import_module(name)
import batchwidgets as bw
report = bw.find_batch(lambda n: None, device="cpu", max_batch_size=4)
extra = {"modules": names, "max_batch_size": report.max_batch_size}
""")
    assert {"batchwidgets.engine.probe", "batchwidgets.engine.memory._meters",
            "batchwidgets.engine.noise._tracker", "batchwidgets.engine._state"} <= set(
        outcome["extra"]["modules"])
    assert outcome["extra"]["max_batch_size"] == 4
    assert [m for m in outcome["loaded"] if m in NOTEBOOK_STACK] == []
    assert "torch" in outcome["loaded"]  # the check did import the engine


def test_the_results_package_imports_nothing_from_the_engine():
    outcome = loaded_after("""
import importlib, pkgutil
import batchwidgets.results as results
for info in pkgutil.iter_modules(results.__path__):
    importlib.import_module("batchwidgets.results." + info.name)
extra = sorted(m for m in sys.modules if m.startswith("batchwidgets.engine"))
""")
    assert outcome["extra"] == []
    assert outcome["loaded"] == []


MAX_LINES = 400  # issue 14: a module over it says why in a NOTE [ ... long module ... ]


def test_no_module_is_over_the_line_ceiling_unless_a_note_says_why():
    from pathlib import Path

    import batchwidgets

    package = Path(batchwidgets.__file__).parent
    sizes = {path.relative_to(package).as_posix(): path.read_text().count("\n")
             for path in package.rglob("*.py")}
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES
            and "long module ]" not in (package / name).read_text()}
    assert over == {}
    assert len(sizes) > 40  # the whole package was read


# -- the engine's rooms (issue 22) ---------------------------------------------------------------

SHARED = {"_util", "_types", "_batches", "_state", "_background", "_own_steps", "_grads",
          "_unsharded", "_options"}
# What each room may import besides itself and the shared modules; another room only through
# its package (``from ..memory import replay``), never one of its private modules.
MAY_IMPORT = {"memory": set(), "probe": {"memory"}, "accumulate": {"noise"}, "noise": set(),
              "loader": set(), "shared": set()}


def room_of(module: str) -> str:
    """engine.<room>.x -> <room>; the shared modules (and engine.noise_tracker, noise's
    documented path) -> shared / noise; the engine package itself -> engine."""
    parts = module.split(".")[2:]  # after batchwidgets.engine
    if not parts:
        return "engine"
    if parts[0] in MAY_IMPORT:
        return parts[0]
    return "noise" if parts[0] == "noise_tracker" else "shared"


def engine_imports(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """Every batchwidgets.engine module ``path`` imports, function-level imports included, as
    absolute names (``from .. import memory`` -> batchwidgets.engine.memory)."""
    module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" \
        else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - max(node.level - 1, 0)]
            source = (".".join([*base, node.module] if node.module else base) if node.level
                      else node.module)
            for alias in node.names:  # `from . import memory` names a module
                name = f"{source}.{alias.name}"
                found.add(name if _is_module(name, package_dir) else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("batchwidgets.engine")}


def _is_module(name: str, package_dir: Path) -> bool:
    path = package_dir.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def broken_imports(package_dir: Path = PACKAGE) -> list[str]:
    """Each import in the engine that MAY_IMPORT forbids, in a sentence."""
    broken = []
    for path in sorted((package_dir / "engine").rglob("*.py")):
        module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
        mine = room_of(module.removesuffix(".__init__"))
        if mine == "engine":
            continue  # the map: its names load on first use, each from its room
        for name in sorted(engine_imports(path, package_dir)):
            theirs = room_of(name)
            if theirs in (mine, "shared"):
                continue
            if theirs not in MAY_IMPORT[mine]:
                broken.append(f"{module} imports {name} ({mine} may not import {theirs})")
            elif name != f"batchwidgets.engine.{theirs}":
                broken.append(f"{module} imports {name}: another room's private module")
    return broken


ENGINE = PACKAGE / "engine"


def test_the_engine_is_a_room_a_capability_beside_the_shared_modules():
    rooms = {path.name for path in ENGINE.iterdir() if (path / "__init__.py").exists()}
    assert rooms == {"memory", "probe", "accumulate", "noise", "loader"}
    top = {path.stem for path in ENGINE.glob("*.py")}
    assert top == {"__init__", "noise_tracker", *SHARED}
    for room in rooms:  # each room says what it is for and what it exports
        init = (ENGINE / room / "__init__.py").read_text()
        assert "__all__" in init
        assert len(init.splitlines()) <= 45


def test_each_room_imports_only_what_it_may():
    assert broken_imports() == []


def test_the_rule_sees_the_imports_it_forbids(tmp_path):
    """What the probe imported before the rooms, and a private module of another room."""
    engine = tmp_path / "batchwidgets" / "engine"
    for room in ("probe", "accumulate", "noise", "memory"):
        (engine / room).mkdir(parents=True)
        (engine / room / "__init__.py").write_text("")
    (engine / "memory" / "_trace.py").write_text("")
    (engine / "probe" / "_trials.py").write_text(
        "from ..accumulate import accumulate\n"
        "from ..memory._trace import OpTrace\n"
        "from .. import memory\n"
        "def f():\n    from .. import noise\n")
    assert broken_imports(tmp_path / "batchwidgets") == [
        "batchwidgets.engine.probe._trials imports batchwidgets.engine.accumulate "
        "(probe may not import accumulate)",
        "batchwidgets.engine.probe._trials imports batchwidgets.engine.memory._trace: another "
        "room's private module",
        "batchwidgets.engine.probe._trials imports batchwidgets.engine.noise "
        "(probe may not import noise)"]


def test_find_batch_loads_no_module_of_noise_accumulate_or_loader():
    outcome = loaded_after("""
import torch
import batchwidgets as bw
model = torch.nn.Linear(8, 2)
report = bw.find_batch(model, torch.zeros(8), budget="64KB", max_batch_size=64)
from batchwidgets.engine.memory import parse_bytes
from batchwidgets.engine.probe import find_batch
extra = {"max": report.max_batch_size,
         "engine": sorted(m for m in sys.modules if m.startswith("batchwidgets.engine."))}
""")
    loaded = outcome["extra"]["engine"]
    assert outcome["extra"]["max"] == 64
    assert "batchwidgets.engine.probe._find_batch" in loaded
    assert [m for m in loaded if room_of(m) in ("noise", "accumulate", "loader")] == []


def test_the_results_never_import_the_engine_not_even_lazily():
    """No import of it anywhere in results/ (function-level included), and no module name of it
    for importlib: the engine attaches what a report needs (LoaderReport.make_loader)."""
    found = {}
    for path in (PACKAGE / "results").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [f"{'.' * node.level}{node.module or ''}"]
                     if isinstance(node, ast.ImportFrom)
                     else [node.value] if isinstance(node, ast.Constant)
                     and isinstance(node.value, str) else [])
            found.setdefault(path.name, []).extend(
                name for name in names if re.fullmatch(r"[\w.]*engine[\w.]*", name))
    assert {name: hits for name, hits in found.items() if hits} == {}
    assert len(found) >= 6  # every module of results/ was read
