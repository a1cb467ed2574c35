"""Import boundaries (STYLE G6), each checked in a fresh interpreter: ``import batchwidgets`` loads
nothing heavy, ``batchwidgets.results`` needs no torch, the engine never loads the notebook UI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
names = sorted(m.name for m in pkgutil.iter_modules(engine.__path__))
for name in names:
    importlib.import_module("batchwidgets.engine." + name)
import batchwidgets as bw
report = bw.find_batch(lambda n: None, device="cpu", max_batch_size=4)
extra = {"modules": names, "max_batch_size": report.max_batch_size}
""")
    assert {"probe", "_memory", "_search", "_state", "_meters", "_batches"} <= set(
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
