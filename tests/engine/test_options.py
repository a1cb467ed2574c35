"""Options declared once (NOTE [ Options declared once ] in engine/_options.py): each public
function's keywords are the fields of its request dataclass, in order, with the request's
defaults; the magic's flags, the panel's controls and the cache key are read from the fields;
and no default is written a second time in the code that serves the function."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import construct_parser

import batchwidgets as bw
from batchwidgets import magics
from batchwidgets.engine import FLAGS, PYTHON, Option, declared, options_of
from batchwidgets.engine.accumulate import ACCUMULATE, AccumulateRequest
from batchwidgets.engine.noise import CRITICAL_BATCH, CriticalBatchRequest
from batchwidgets.engine.probe import OPTIONS, FindBatchRequest, check_arguments

PACKAGE = Path(bw.__file__).parent

# function, its request dataclass, the magic, its positionals, the magic's flags that are not
# keywords
DECLARED = [
    (bw.find_batch, FindBatchRequest, magics.BatchMagics.find_batch, ("model", "make_batch"),
     {"--input-shape", "--num-classes", "--quiet", "--var"}),
    (bw.accumulate, AccumulateRequest, magics.BatchMagics.accumulate, ("optimizer",),
     {"--optimizer", "--scaler", "--scheduler", "--model", "--probe", "--noise"}),
    (bw.critical_batch, CriticalBatchRequest, magics.BatchMagics.critical_batch,
     ("model", "data", "optimizer"), {"--optimizer", "--probe", "--noise"}),
]
DEFAULTS = {FindBatchRequest: OPTIONS, AccumulateRequest: ACCUMULATE,
            CriticalBatchRequest: CRITICAL_BATCH}
IDS = [function.__name__ for function, *_ in DECLARED]
# The code that serves each function: where a default written again would drift from it.
FACES = {
    "find_batch": ["engine/probe", "magics.py", "_notebook.py", "widgets/probe.py"],
    "accumulate": ["engine/accumulate", "magics.py", "_notebook.py"],
    "critical_batch": ["engine/noise/_critical.py", "magics.py", "_notebook.py"],
}


def flag_actions(magic) -> dict[str, object]:
    """The magic's argparse actions by their long flag (a positional by its name)."""
    parser = construct_parser(magic)
    actions = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        long = [s for s in action.option_strings if s.startswith("--")]
        actions[long[0] if long else action.dest] = action
    return actions


@pytest.mark.parametrize(("function", "request_type", "magic", "positionals", "own"), DECLARED,
                         ids=IDS)
def test_every_keyword_is_a_field_in_order_with_the_requests_default(
        function, request_type, magic, positionals, own):
    parameters = inspect.signature(function).parameters
    keywords = [name for name in parameters if name not in positionals]
    fields = dataclasses.fields(request_type)
    assert [field.name for field in fields] == keywords
    defaults = DEFAULTS[request_type]
    assert defaults == request_type()
    for field in fields:
        default = parameters[field.name].default
        assert default == field.default == getattr(defaults, field.name), field.name
        assert type(default) is type(field.default), field.name
        assert {"help", "check", "flag", "keyed"} <= set(field.metadata), field.name


def test_the_request_is_frozen_and_a_misspelt_option_is_an_error_where_it_is_written():
    request = FindBatchRequest(headroom=0.8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.headroom = 0.7
    with pytest.raises(TypeError, match="headrom"):
        FindBatchRequest(headrom=0.8)
    assert (request.headroom, request.multiple_of) == (0.8, OPTIONS.multiple_of)


def test_the_reports_defaults_are_the_requests():
    """NOTE [ The report's defaults ] in engine/probe/_options.py: one literal each."""
    report = bw.BatchSizeReport(0, None, (), "cpu", None)
    assert (report.headroom, report.multiple_of) == (OPTIONS.headroom, OPTIONS.multiple_of)
    parameters = inspect.signature(bw.find_batch).parameters
    assert parameters["headroom"].default == report.headroom


def test_the_engine_reads_options_from_the_request_not_from_a_dict():
    """No ``locals()``, no ``options["step"]``: a stage reads ``request.step``, which a type
    checker and a reader can follow."""
    names = {field.name for field in dataclasses.fields(FindBatchRequest)}
    found = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE).as_posix()}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "locals":
                found.append(f"{where} locals()")
            elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                  and node.slice.value in names
                  and getattr(node.value, "id", "") in ("options", "given")):
                found.append(f"{where} {ast.unparse(node)}")
    assert found == []


def test_the_cache_key_holds_every_keyed_field_and_no_other():
    """The remembered answer's key reads ``keyed`` from the fields: what says how to report
    or whether to remember is left out, everything else is in."""
    unkeyed = [o.name for o in options_of(FindBatchRequest) if not o.keyed]
    assert unkeyed == ["on_step", "should_stop", "cache", "refresh"]


@pytest.mark.parametrize(("function", "request_type", "magic", "positionals", "own"), DECLARED,
                         ids=IDS)
def test_every_flag_is_a_declared_keyword_and_back_with_its_help_and_default(
        function, request_type, magic, positionals, own):
    actions = flag_actions(magic)
    flagged = {option.name if option.flag == "positional" else option.flag_name: option
               for option in options_of(request_type) if option.flag}
    arguments = {name for name in actions if name.startswith("--")} | {
        name for name in actions if name in flagged}
    assert arguments - set(flagged) == own  # the magic's own flags, nothing else
    for name, option in flagged.items():
        action = actions[name]
        assert action.help.replace("%%", "%") == option.help_line
        assert action.default in (None, False)  # the function's default stays the function's
        if option.default not in (None, False):
            assert f"(default: {option.default})" in action.help
        if option.choices:
            assert tuple(action.choices) == option.choices


def test_every_find_batch_keyword_but_the_callbacks_is_a_flag_of_find_batch():
    actions = flag_actions(magics.BatchMagics.find_batch)
    missing = [option.name for option in options_of(FindBatchRequest)
               if option.flag_name not in actions and option.name not in ("on_step",
                                                                           "should_stop")]
    assert missing == []
    assert declared(FindBatchRequest, "what_if").flag == "switch"
    assert actions["--what-if"].const is True


def test_the_panel_reads_the_headroom_and_the_targets_from_the_declaration():
    panel = bw.ProbePanel(probe=lambda on_step, headroom=0.9, target=None: None)
    assert panel.headroom.value == OPTIONS.headroom
    assert panel.headroom.tooltip == declared(FindBatchRequest, "headroom").help_line
    assert panel.target.values[1:] == list(declared(FindBatchRequest, "target").offered)
    assert "H200" in panel.target.values
    panel.close()


def test_a_check_names_the_option_as_the_caller_wrote_it():
    with pytest.raises(ValueError, match=r"^headroom should be in \(0, 1\]") as python:
        check_arguments(bw.find_batch, headroom=1.5)
    with pytest.raises(ValueError, match=r"^--headroom should be in \(0, 1\]") as flags:
        check_arguments(bw.find_batch, said=FLAGS, headroom=1.5)
    assert "but got headroom=1.5; use e.g. headroom=0.9" in str(python.value)
    assert "but got --headroom 1.5; use e.g. --headroom 0.9" in str(flags.value)
    assert FLAGS("seq_len", [128, 256]) == "--seq-len 128,256"
    assert FLAGS("target", None) == "no --target"
    assert PYTHON("seq_len", [128, 256]) == "seq_len=[128, 256]"
    with pytest.raises(TypeError, match="headrom"):
        check_arguments(bw.find_batch, headrom=0.5)


# -- no default written twice ---------------------------------------------------------------------


def defaults_written_again(source: str, options: tuple[Option, ...],
                           function: str) -> list[str]:
    """Where ``source`` writes one of the declared defaults again: a parameter of the same name
    with a literal default (but in the function's own signature, which the tests above hold
    equal to the declaration), a magic's ``@argument`` with ``default=`` or "(default: ...)" in
    its help, ``args.name or <literal>``, a control ``(value=<literal>, description="name")``."""
    declared = {o.name: o.default for o in options if o.default is not None}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != function:
            arguments = node.args
            positional = [*arguments.posonlyargs, *arguments.args]
            pairs = [*zip(positional[len(positional) - len(arguments.defaults):],
                          arguments.defaults),
                     *zip(arguments.kwonlyargs, arguments.kw_defaults)]
            found += [f"{node.name}({arg.arg}={default.value!r})" for arg, default in pairs
                      if arg.arg in declared and isinstance(default, ast.Constant)
                      and default.value is not None]
        elif isinstance(node, ast.Call):
            keywords = {k.arg: k.value for k in node.keywords
                        if isinstance(k.value, ast.Constant)}
            first = node.args[0].value if node.args and isinstance(node.args[0],
                                                                   ast.Constant) else ""
            name = str(first).lstrip("-").replace("-", "_")
            if getattr(node.func, "id", "") == "argument" and name in declared:
                if "default" in keywords:
                    found.append(f"{first}: default={keywords['default'].value!r}")
                if f"(default: {declared[name]})" in str(getattr(keywords.get("help"), "value",
                                                                  "")):
                    found.append(f"{first}: (default: {declared[name]}) in its help")
            described = getattr(keywords.get("description"), "value", None)
            if described in declared and "value" in keywords:
                found.append(f"{described}: value={keywords['value'].value!r}")
        elif (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
              and isinstance(node.values[0], ast.Attribute)
              and node.values[0].attr in declared
              and isinstance(node.values[-1], ast.Constant)):
            found.append(f"{node.values[0].attr} or {node.values[-1].value!r}")
    return found


def test_the_scan_finds_a_default_written_again():
    source = """
def resolve(model, *, headroom: float = 0.9, start=None): ...
@argument("--multiple-of", type=int, default=1, help="try only multiples of N")
@argument("--steps-per-trial", help="training steps at each batch size (default: 2)")
def magic(self, args): return args.remainder or "apply"
slider = FloatSlider(value=0.9, min=0.5, description="headroom")
"""
    options = (*options_of(FindBatchRequest), *options_of(AccumulateRequest))
    assert sorted(defaults_written_again(source, options, "find_batch")) == [
        "--multiple-of: default=1", "--steps-per-trial: (default: 2) in its help",
        "headroom: value=0.9", "remainder or 'apply'", "resolve(headroom=0.9)"]


@pytest.mark.parametrize(("function", "request_type"), [
    ("find_batch", FindBatchRequest), ("accumulate", AccumulateRequest),
    ("critical_batch", CriticalBatchRequest)])
def test_no_default_is_written_twice(function, request_type):
    options = options_of(request_type)
    paths = [path for face in FACES[function] for path in (
        sorted((PACKAGE / face).glob("*.py")) if (PACKAGE / face).is_dir() else [PACKAGE / face])]
    paths = [path for path in paths if path.name != "_options.py"]  # the declaration itself
    assert len(paths) >= 3
    found = {str(path.relative_to(PACKAGE)): hits for path in paths
             if (hits := defaults_written_again(path.read_text(), options, function))}
    assert found == {}


# -- the magic's words ---------------------------------------------------------------------------


def test_a_magic_error_is_the_functions_check_in_flags(ip_with_model):
    ip = ip_with_model
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("find_batch", "model make_batch --max-batch-size 4 --multiple-of 8")
    assert str(error.value) == ("--max-batch-size should be an int >= --multiple-of (8), but "
                                "got --max-batch-size 4; raise it or lower --multiple-of.")
    with pytest.raises(UsageError) as error:
        ip.run_line_magic("find_batch", "model make_batch --trace fake")
    assert str(error.value).startswith("--trace fake plans for a GPU that is not here: pass "
                                       "--target (e.g. --target A100-80GB)")


def test_step_names_a_function_in_the_notebook(ip_with_model):
    import torch

    def steps(batch_size: int) -> None:
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
    ip_with_model.push({"steps": steps})
    report = ip_with_model.run_line_magic("find_batch", "model --step steps --device cpu -q")
    assert (report.max_batch_size, report.first_oom_batch_size) == (40, 41)
    with pytest.raises(UsageError, match="--step: name 'stesp' is not defined"):
        ip_with_model.run_line_magic("find_batch", "model --step stesp -q")
    ip_with_model.user_ns.pop("steps")


@pytest.fixture
def ip_with_model():
    import torch
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    start_ipython()
    shell = get_ipython()
    shell.push({"model": torch.nn.Linear(4, 2), "make_batch": lambda n: torch.zeros(n, 4)})
    shell.run_line_magic("load_ext", "batchwidgets")
    yield shell
    shell.run_line_magic("unload_ext", "batchwidgets")
    for name in ("model", "make_batch"):
        shell.user_ns.pop(name, None)
