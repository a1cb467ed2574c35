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


# The notebook side of the package and Jupyter itself (issue 37): the engine imports none of it,
# at the top of a module or inside a function, and runs a live loader's epoch without it.
JUPYTER = ("IPython", "ipykernel", "ipywidgets", "anywidget", "comm", "jupyter_client",
           "batchwidgets._kernel_poll", "batchwidgets.widgets", "batchwidgets._notebook",
           "batchwidgets.magics")


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """Every module ``path`` imports, function-level imports included, as absolute names
    (``from ... import _kernel_poll`` in engine/loader/x.py -> batchwidgets._kernel_poll)."""
    module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" \
        else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            source = ".".join(filter(None, [base, node.module]))
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def jupyter_imports(package_dir: Path = PACKAGE) -> list[str]:
    """Each import of JUPYTER under engine/, in a sentence (``from x import y``: x, or x.y
    when x itself is allowed)."""
    def banned(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in JUPYTER)
    found = []
    for path in sorted((package_dir / "engine").rglob("*.py")):
        names = {name for name in imported_modules(path, package_dir) if banned(name)}
        found += [f"{path.relative_to(package_dir).as_posix()} imports {name}"
                  for name in sorted(names) if name.rsplit(".", 1)[0] not in names]
    return found


def test_no_engine_module_imports_jupyter_or_the_notebook_layer():
    assert jupyter_imports() == []


def test_the_jupyter_rule_sees_relative_and_function_level_imports(tmp_path):
    """What the live loader imported before issue 37, and the same inside a function."""
    loader = tmp_path / "batchwidgets" / "engine" / "loader"
    loader.mkdir(parents=True)
    (loader / "_live.py").write_text("from ..._kernel_poll import WidgetPoll\n"
                                     "def f():\n    from ... import widgets\n"
                                     "    import ipykernel.comm\n")
    assert jupyter_imports(tmp_path / "batchwidgets") == [
        "engine/loader/_live.py imports batchwidgets._kernel_poll",
        "engine/loader/_live.py imports batchwidgets.widgets",
        "engine/loader/_live.py imports ipykernel.comm"]


def test_the_engine_imports_and_runs_a_live_epoch_with_jupyter_unimportable():
    outcome = loaded_after(f"""
import importlib, importlib.abc, pkgutil
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {JUPYTER!r}):
            raise ImportError(f"{{name}} is blocked: the engine may not import it")
sys.meta_path.insert(0, Blocked())
import batchwidgets.engine as engine
for info in pkgutil.walk_packages(engine.__path__, "batchwidgets.engine."):
    importlib.import_module(info.name)
import torch
import batchwidgets as bw
live = bw.live_loader(torch.utils.data.TensorDataset(torch.arange(12)), batch_size=4)
batches = [batch[0].tolist() for batch in live]
live.set(num_workers=1)
batches += [batch[0].tolist() for batch in live]
live.close()
extra = {{"batches": len(batches), "jupyter": sorted(m for m in sys.modules if any(
    m == b or m.startswith(b + ".") for b in {JUPYTER!r}))}}
""")
    assert outcome["extra"] == {"batches": 6, "jupyter": []}
    assert "torch" in outcome["loaded"]


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


# Issues 14 and 37: a module over it says why, in one line among its first five (a cohesive
# class: "One object, one module: ...", STYLE G10; never split into mixins to meet the count),
# or in a NOTE [ ... long module ... ].
MAX_LINES = 400
SAYS_WHY_AT_THE_TOP = "One object, one module: "


def test_no_module_is_over_the_line_ceiling_unless_it_says_why():
    sizes = {path.relative_to(PACKAGE).as_posix(): path.read_text().count("\n")
             for path in PACKAGE.rglob("*.py")}

    def says_why(name: str) -> bool:
        text = (PACKAGE / name).read_text()
        return "long module ]" in text or any(
            SAYS_WHY_AT_THE_TOP in line for line in text.splitlines()[:5])
    over = {name: lines for name, lines in sizes.items()
            if lines > MAX_LINES and not says_why(name)}
    assert over == {}
    assert len(sizes) > 40  # the whole package was read


# -- the engine's rooms (issue 22) ---------------------------------------------------------------

SHARED = {"_util", "_batches", "_called", "_state", "_background", "_grads", "_unsharded",
          "_options"}
# What each room may import besides itself and the shared modules; another room only through
# its package (``from ..memory import replay``), never one of its private modules.
MAY_IMPORT = {"memory": set(), "probe": {"memory"}, "accumulate": {"noise"}, "noise": set(),
              "loader": set(), "shared": set()}


def room_of(module: str) -> str:
    """engine.<room>.x -> <room>; the shared modules -> shared; the engine package itself ->
    engine."""
    parts = module.split(".")[2:]  # after batchwidgets.engine
    if not parts:
        return "engine"
    if parts[0] in MAY_IMPORT:
        return parts[0]
    return "shared"


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
    assert top == {"__init__", *SHARED}
    assert len(SHARED) <= 8  # issue 45: what serves one room lives in it
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


# -- the front ends use the engine's public face (issue 45) -------------------------------------

FRONT_ENDS = ("magics.py", "_notebook.py", "widgets", "integrations")


def _modules(package_dir: Path, places: tuple[str, ...]) -> list[Path]:
    return sorted(path for place in places for path in (
        (package_dir / place).rglob("*.py") if (package_dir / place).is_dir()
        else [package_dir / place]) if path.exists())


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privately(paths: list[Path]) -> set[str]:
    """The private names these modules define: functions, classes, ``self._x`` attributes."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if _private(name)}


def front_end_privates(package_dir: Path = PACKAGE) -> list[str]:
    """Each import of an engine-private module or name by a front end (magics, _notebook,
    widgets, integrations), and each private member of an engine object it touches
    (``tracker._defer``: a private name the engine defines and no front end does), in a
    sentence."""
    fronts = _modules(package_dir, FRONT_ENDS)
    engine_only = (_defined_privately(sorted((package_dir / "engine").rglob("*.py")))
                   - _defined_privately(fronts))
    found = []
    for path in fronts:
        where = path.relative_to(package_dir).as_posix()
        for name in sorted(imported_modules(path, package_dir)):  # its first private part last
            *parents, last = name.split(".")
            if (name.startswith("batchwidgets.engine.") and _private(last)
                    and not any(_private(part) for part in parents)):
                found.append(f"{where} imports {name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in engine_only
                    and getattr(node.value, "id", None) not in ("self", "cls")):
                found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_front_end_imports_an_engine_private_module_or_member():
    assert front_end_privates() == []
    assert len(_modules(PACKAGE, FRONT_ENDS)) >= 10  # the front ends were read


def test_the_front_end_rule_sees_private_imports_and_members(tmp_path):
    """What the front ends did before issue 45: a room's private module, a shared private
    module, a private member of an engine object."""
    package = tmp_path / "batchwidgets"
    (package / "engine" / "noise").mkdir(parents=True)
    (package / "engine" / "noise" / "_tracker.py").write_text(
        "class NoiseTracker:\n    def _defer(self, values):\n        self._deferred = values\n")
    (package / "widgets").mkdir()
    (package / "widgets" / "probe.py").write_text(
        "from ..engine import _background, memory\n"
        "from ..engine.probe._resolve import resolve\n"
        "def f(tracker):\n    from ..engine._util import usable_device\n"
        "    tracker._defer(1)\n    return self._defer\n")
    (package / "magics.py").write_text("from .engine import called_where\n")
    assert front_end_privates(package) == [
        "widgets/probe.py imports batchwidgets.engine._background",
        "widgets/probe.py imports batchwidgets.engine._util",
        "widgets/probe.py imports batchwidgets.engine.probe._resolve",
        "widgets/probe.py:5 uses tracker._defer"]
