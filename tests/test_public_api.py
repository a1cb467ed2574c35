"""The public contract of /work/shared/DESIGN.md, pinned name by name: what ``import batchwidgets``
offers, the parameters of every public function, the fields and properties of every report, the
panels' attributes, the magics, and the import paths that tutorials and users already wrote. A
rename that breaks one of them fails here first."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

import batchwidgets as bw

PUBLIC = {
    "find_batch", "NoBatchSizeFits", "BatchSizeReport", "Attempt", "plot_probe", "ProbePanel",
    "accumulate", "AccumulationReport", "plot_accumulate",
    "measure_noise", "NoiseReport", "plot_noise", "NoiseTracker", "NoiseTrackerReport",
    "plot_noise_tracker", "NoisePanel", "critical_batch", "CriticalBatchReport",
    "tune_loader", "measure_loader", "make_loader", "data_stall", "LoaderReport", "LoaderTrial",
    "DataStallReport", "plot_loader", "LoaderPanel",
    "live_loader", "LiveLoader", "LiveLoaderReport", "LoaderSegment", "LoaderSwitch",
    "plot_live_loader",
    "track_tensor_memory", "BatchwidgetsWarning",
    "forget", "fit_trainer", "split_batch", "BatchSplitReport",
}
# Internals once importable from the top level, now only from their modules (CHANGELOG.md).
REMOVED = {"SyntheticBatches", "MemoryModel", "BudgetExceededError"}


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def names(report_class) -> set[str]:
    """Fields and properties: what ``report.<name>`` reads."""
    return ({field.name for field in dataclasses.fields(report_class)}
            | {name for name, value in vars(report_class).items()
               if isinstance(value, property)})


def test_all_is_exactly_the_user_facing_set_and_every_name_resolves():
    assert set(bw.__all__) == PUBLIC  # a new public name joins PUBLIC and DESIGN.md
    for name in sorted(PUBLIC):
        assert getattr(bw, name) is not None, name
        assert name in dir(bw)
    for name in sorted(REMOVED):
        assert not hasattr(bw, name), name
    with pytest.raises(AttributeError, match="has no attribute 'fnd_batch'"):
        bw.fnd_batch


def test_plot_functions_are_the_ones_in_plots():
    plots = importlib.import_module("batchwidgets.plots")
    for name in ("plot_probe", "plot_noise", "plot_noise_tracker", "plot_accumulate",
                 "plot_loader"):
        assert getattr(bw, name) is getattr(plots, name)
        assert parameters(getattr(bw, name))[:2] == ["report", "ax"]


# -- functions: the parameters DESIGN.md shows, in its order -----------------------------------


def test_find_batch_parameters():
    assert parameters(bw.find_batch)[:10] == [
        "model", "make_batch", "loss_fn", "optimizer", "device", "budget", "amp",
        "max_batch_size", "multiple_of", "headroom"]
    signature = inspect.signature(bw.find_batch)
    assert signature.parameters["make_batch"].default is None  # find_batch(step)
    assert signature.parameters["headroom"].default == 0.9
    assert signature.parameters["multiple_of"].default == 1
    keywords = list(signature.parameters)
    assert "on_step" in keywords  # as docs/find_batch.md names it
    assert "on_progress" not in keywords  # an alias, removed (CHANGELOG.md)
    assert keywords.index("scaler") < keywords.index("scheduler")  # as accumulate's order


def test_the_vocabulary_names_each_step_and_choice_once():
    from batchwidgets.engine import _options, probe
    from batchwidgets.engine.loader import TrainStep

    assert not hasattr(probe, "Step")  # ProbeStep's alias, removed (CHANGELOG.md)
    assert TrainStep is _options.TrainStep
    assert inspect.signature(bw.accumulate).parameters["remainder"].annotation == "Remainder"
    assert _options.REMAINDERS == ("apply", "drop")
    assert set(_options.AMP_NAMES) >= {"bf16", "fp16"}
    assert _options.NOISE_METHODS == ("auto", "vmap", "loop")


def test_accumulate_parameters():
    assert parameters(bw.accumulate)[:5] == ["optimizer", "steps", "model", "scaler",
                                             "scheduler"]
    assert "noise" in parameters(bw.accumulate)


def test_measure_noise_parameters():
    assert parameters(bw.measure_noise)[:4] == ["model", "data", "loss_fn", "batch_sizes"]
    assert inspect.signature(bw.measure_noise).parameters["batch_sizes"].default == (1, 2, 4, 8)


def test_loader_functions_parameters():
    assert parameters(bw.tune_loader)[:2] == ["loader_or_dataset", "device"]
    assert {"on_progress", "should_stop", "step", "batch_size",
            "max_workers"} <= set(parameters(bw.tune_loader))
    assert "on_trial" not in parameters(bw.tune_loader)  # an alias, removed (CHANGELOG.md)
    assert {"num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "batch_size",
            "device", "should_stop"} <= set(parameters(bw.measure_loader))
    make = inspect.signature(bw.make_loader).parameters
    assert [p.kind for p in make.values()] == [inspect.Parameter.POSITIONAL_ONLY,
                                               inspect.Parameter.VAR_KEYWORD]
    assert parameters(bw.data_stall)[:2] == ["loader", "step"]


# -- reports: fields and properties -------------------------------------------------------------


@pytest.mark.parametrize(("report_class", "required"), [
    ("BatchSizeReport", {"max_batch_size", "first_oom_batch_size", "recommended_batch_size",
                         "attempts", "device", "budget_bytes", "recommendation_rule",
                         "memory_model", "headroom", "stop_reason"}),
    ("Attempt", {"batch_size", "fits", "peak_memory_bytes", "step_time_s"}),
    ("NoiseReport", {"trace_cov", "grad_norm_sq", "b_simple", "grad_variance", "replacement",
                     "batch_sizes", "advice", "loss_variance_per_batch"}),
    ("NoiseTrackerReport", {"b_simple", "b_simple_error", "grad_norm_sq", "trace_cov",
                            "measurable", "reason", "n_updates", "losses", "history", "advice",
                            "steps_over_min", "examples_over_min", "unit", "loss_mean",
                            "loss_std"}),
    ("CriticalBatchReport", {"critical_batch_size", "critical_batch_size_error", "target_loss",
                             "examples", "ladder", "b_simple", "ratio", "measurable", "reason"}),
    ("AccumulationReport", {"steps", "micro_steps", "real_steps", "effective_batch_size",
                            "losses"}),
    ("LoaderReport", {"trials", "best", "current", "samples_per_s", "stall", "device",
                      "speedup"}),
    ("LoaderTrial", {"num_workers", "pin_memory", "prefetch_factor", "persistent_workers",
                     "batch_size", "samples_per_s", "bytes_per_s", "first_batch_s",
                     "n_epoch_ends", "settings", "label"}),
    ("DataStallReport", {"stall_fraction", "step_time_s", "data_wait_s"}),
    ("LiveLoaderReport", {"samples_per_s", "stall_fraction", "segments", "switches", "settings",
                          "current", "n_batches", "n_samples", "wall_s", "wait_s"}),
    ("LoaderSegment", {"settings", "samples_per_s", "stall_fraction", "n_batches", "n_samples",
                       "wall_s", "wait_s", "step_s", "epoch", "batch", "label"}),
    ("LoaderSwitch", {"old", "new", "epoch", "batch", "cost_s", "shutdown_s", "by", "note"}),
    ("BatchSplitReport", {"global_batch_size", "world_size", "per_device_batch_size",
                          "accumulation_steps", "max_per_device", "probe", "remembered"}),
])
def test_report_names(report_class, required):
    cls = getattr(bw, report_class)
    assert dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen
    assert required <= names(cls), sorted(required - names(cls))
    if report_class.endswith("Report"):  # rows (Attempt, LoaderTrial) show inside their report
        assert callable(cls.summary)
        assert callable(cls._repr_html_)


def test_batch_size_report_keeps_with_headroom_and_loader_report_make_loader():
    assert callable(bw.BatchSizeReport.with_headroom)
    assert callable(bw.LoaderReport.make_loader)
    assert "source" not in {f.name for f in dataclasses.fields(bw.LoaderReport)}  # no data


# -- panels, magics, command line ---------------------------------------------------------------


def test_loader_panel_attributes_named_after_dataloader_options():
    panel = bw.LoaderPanel(torch.utils.data.TensorDataset(torch.zeros(8, 1)), start=False)
    try:
        for name in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers",
                     "batch_size", "autotune"):
            assert hasattr(getattr(panel, name), "value" if name != "autotune" else "on_click")
        assert panel.report is None
        assert isinstance(panel.loader, torch.utils.data.DataLoader)
        for method in ("wait", "measure", "close", "render"):
            assert callable(getattr(panel, method))
    finally:
        panel.close()


def test_probe_and_noise_panel_attributes():
    probe = bw.ProbePanel()
    assert probe.report is None
    for method in ("start", "wait", "run", "render", "on_step"):
        assert callable(getattr(probe, method))
    noise = bw.NoisePanel()
    try:
        assert isinstance(noise.tracker, bw.NoiseTracker)
        assert callable(noise.refresh)
    finally:
        noise.close()


def test_load_ext_registers_find_batch_and_accumulate():
    start_ipython()  # the shared test shell; returns it only on the first call
    ip = get_ipython()
    ip.run_line_magic("load_ext", "batchwidgets")
    try:
        magics = ip.magics_manager.magics
        assert "find_batch" in magics["line"]
        assert "accumulate" in magics["cell"]
    finally:
        ip.run_line_magic("unload_ext", "batchwidgets")


def test_the_command_line_entry_point_exists():
    main = importlib.import_module("batchwidgets.__main__")
    assert callable(main.main)


# -- the map for newcomers ---------------------------------------------------------------------


ROOMS = ("accumulate", "loader", "memory", "noise", "probe")


@pytest.mark.parametrize("package", ["batchwidgets.engine", "batchwidgets.widgets",
                                     *(f"batchwidgets.engine.{room}" for room in ROOMS)])
def test_the_package_docstring_lists_every_module_a_line_each(package):
    imported = importlib.import_module(package)
    entries = [f"``{info.name}/``" if info.ispkg else f"``{info.name}.py``"
               for info in pkgutil.iter_modules(imported.__path__)]
    listed = [entry for entry in entries if entry in imported.__doc__]
    assert listed == entries
    assert len(entries) >= 2  # the modules were found (accumulate has two: one object each)


# -- old import paths ---------------------------------------------------------------------------

OLD_PATHS = [
    ("batchwidgets.results", ["Attempt", "BatchSizeReport", "MemoryModel", "AccumulationReport",
                              "NoiseReport", "NoiseTrackerReport", "LayerNoise", "LoaderReport",
                              "LoaderTrial", "DataStallReport", "attempts_table"]),
    ("batchwidgets.widgets", ["ProbePanel", "NoisePanel", "LoaderPanel", "WIDGET_VIEW"]),
    ("batchwidgets.widgets.probe", ["ProbePanel"]),
    ("batchwidgets.widgets.noise", ["NoisePanel"]),
    ("batchwidgets.widgets.loader", ["LoaderPanel"]),
    ("batchwidgets.plots", ["plot_probe", "plot_accumulate", "plot_noise", "plot_noise_tracker",
                            "plot_loader", "plot"]),
    ("batchwidgets.engine.probe", ["find_batch", "NoBatchSizeFits"]),
    ("batchwidgets.engine.accumulate", ["accumulate"]),
    ("batchwidgets.engine.noise", ["measure_noise"]),
    ("batchwidgets.engine.loader", ["tune_loader", "measure_loader", "make_loader",
                                    "data_stall", "loader_report"]),
    ("batchwidgets.engine.memory", ["track_tensor_memory", "BudgetExceededError", "parse_bytes",
                                   "is_oom"]),
    ("batchwidgets.engine._batches", ["SyntheticBatches"]),
    ("batchwidgets._warnings", ["BatchwidgetsWarning"]),
    ("batchwidgets.magics", ["BatchMagics"]),
]


@pytest.mark.parametrize(("module", "attributes"), OLD_PATHS, ids=[m for m, _ in OLD_PATHS])
def test_old_import_paths_still_work(module, attributes):
    imported = importlib.import_module(module)
    missing = [name for name in attributes if not hasattr(imported, name)]
    assert missing == []


def test_top_level_names_are_the_objects_of_their_modules():
    from batchwidgets.engine.loader import make_loader
    from batchwidgets.engine.memory import track_tensor_memory
    from batchwidgets.results import LoaderReport
    from batchwidgets.widgets import LoaderPanel
    assert (bw.make_loader, bw.LoaderReport, bw.track_tensor_memory, bw.LoaderPanel) == (
        make_loader, LoaderReport, track_tensor_memory, LoaderPanel)


# -- this round's contract additions (DESIGN.md, "Contract additions for the current round") ----

def test_this_rounds_find_batch_options_and_report_fields():
    assert {"seq_len", "target", "should_stop", "what_if"} <= set(parameters(bw.find_batch))
    assert {"frontier", "memory_split", "what_if", "target", "peak_segments",
            "stop_reason"} <= names(bw.BatchSizeReport)
    from batchwidgets.results import MemorySplit, WhatIf
    assert {"parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
            "temporaries_bytes", "by_module"} <= names(MemorySplit)
    assert {"name", "max_batch_size", "measured"} <= names(WhatIf)
    for function in (bw.find_batch, bw.measure_noise, bw.NoiseTracker.measure):
        assert inspect.signature(function).parameters["loss_fn"].default is None


def test_the_next_rounds_plan_without_running_names():
    """DESIGN.md, "Contract additions for the next round": trace=, report.trace, Attempt.fake."""
    signature = inspect.signature(bw.find_batch)
    assert signature.parameters["trace"].default is None
    assert signature.parameters["trace"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "trace" in names(bw.BatchSizeReport)
    assert "fake" in names(bw.Attempt)
    assert bw.BatchSizeReport(0, None, (), "cpu", None).trace == "real"


def test_sizes_as_people_write_them():
    from batchwidgets.engine.memory import parse_bytes
    assert parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("1G") == 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("16GB") == 16 * 10**9


def test_the_schedule_and_steps_auto():
    assert "schedule" in names(bw.NoiseTrackerReport)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with bw.accumulate(optimizer, steps="auto", noise=bw.NoiseTracker(), model=model):
        pass


@pytest.mark.parametrize("integration", ["transformers", "lightning"])
def test_the_trainer_callbacks_have_a_tracker(integration):
    pytest.importorskip(integration)
    module = importlib.import_module(f"batchwidgets.integrations.{integration}")
    assert isinstance(module.NoiseCallback().tracker, bw.NoiseTracker)


def test_remembered_answers_and_the_global_batch_kept():
    """DESIGN.md, this round: cache=, refresh=, report.remembered, forget, fit_trainer,
    BatchSizeCallback, split_batch."""
    signature = inspect.signature(bw.find_batch)
    assert signature.parameters["cache"].default is True
    assert signature.parameters["refresh"].default is False
    assert "remembered" in names(bw.BatchSizeReport)
    assert bw.BatchSizeReport(0, None, (), "cpu", None).remembered is None
    assert parameters(bw.forget) == []
    assert parameters(bw.split_batch) == ["global_batch_size", "max_per_device", "world_size"]
    assert inspect.signature(bw.split_batch).parameters["world_size"].default == 1
    fit = inspect.signature(bw.fit_trainer).parameters
    assert list(fit) == ["trainer", "global_batch_size", "find_batch_options"]
    assert fit["global_batch_size"].default is None
    assert fit["find_batch_options"].kind is inspect.Parameter.VAR_KEYWORD
    pytest.importorskip("lightning")
    from batchwidgets.integrations.lightning import BatchSizeCallback
    callback = inspect.signature(BatchSizeCallback).parameters
    assert list(callback) == ["global_batch_size", "options"]
    assert callback["global_batch_size"].default is None
