"""Shared test setup: the ``gpu`` marker, a fresh cache directory for every test, and a guard
failing tests that leak global torch state."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

FP32_PRECISION_OWNERS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
                         "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


SESSION_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """find_batch remembers its answers (cache=True): the session's, and every process it
    starts (workers, kernels, scripts, servers), keep them in a folder of their own, never in
    the developer's cache (``~/.cache/batchwidgets``)."""
    folder = tempfile.mkdtemp(prefix="batchwidgets-cache-")
    os.environ["BATCHWIDGETS_CACHE_DIR"] = folder
    config.stash[SESSION_CACHE] = folder
    config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    _share_the_cores()


def _share_the_cores() -> None:
    """Each worker of ``-n N`` (and what it starts: the tutorials' kernels, scripts, ranks,
    servers) gives torch its share of the cores, unless OMP_NUM_THREADS was set for the run.
    Two workers of a thread per core each spin against each other on 2 cores: tutorials 01 and
    06 with the peak-model and fake-trace tests took 443 s with torch's default and 342 s with
    a thread each. Only a worker knows the count (PYTEST_XDIST_WORKER_COUNT); the controller
    runs no test. Every worker collects tests/ before it runs anything, so the notebooks'
    kernels, started later, inherit the share."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


@pytest.fixture
def session_cache(request: pytest.FixtureRequest) -> Path:
    """The session's cache folder: what processes started by session- or module-scoped
    fixtures (Jupyter servers and their kernels) remember into."""
    return Path(request.config.stash[SESSION_CACHE])


@pytest.fixture(autouse=True)
def fresh_cache(session_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                monkeypatch: pytest.MonkeyPatch):
    """Each test starts with nothing remembered: an answer one test measured is never another
    test's (two tests' fakes may look alike and hold different thresholds). The test and what
    it starts get a new folder; the session's folder, which servers and kernels that
    session- or module-scoped fixtures started still use, is emptied."""
    for entry in session_cache.iterdir() if session_cache.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("BATCHWIDGETS_CACHE_DIR", str(folder))
    return folder


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported (torch, transformers, Lightning, Jupyter: 600,000 objects) is
    frozen out of the garbage collector's walks (``gc.freeze``): find_batch collects after each
    out-of-memory error (the error's traceback holds the failed step's tensors in cycles), and a
    full collection walked them all, about 0.5 s each time; the objects the tests make are
    collected as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _longest_first(items: list[pytest.Item]) -> None:
    """Two workers take whole files in this order (addopts: -n 2 --dist loadfile
    --no-loadscope-reorder): the files that take longest start first (the tutorials, the
    browser tests, any file with a test marked slow), and the many short ones fill in behind
    them, so neither worker is left with a long file at the end."""
    long = {item.path for item in items if item.path.suffix == ".ipynb"
            or item.get_closest_marker("slow") or item.get_closest_marker("browser")}
    items.sort(key=lambda item: item.path not in long)  # stable: each file's order kept


def _fp32_precisions() -> dict[str, str]:
    """TF32 settings, read through the API that never raises (PyTorch >= 2.9), else the old one."""
    if not hasattr(torch.backends, "fp32_precision"):
        return {"cudnn.allow_tf32": str(torch.backends.cudnn.allow_tf32),
                "cuda.matmul.allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
                "matmul_precision": torch.get_float32_matmul_precision()}
    precisions = {}
    for path in FP32_PRECISION_OWNERS:
        owner = torch.backends
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        precisions[path or "generic"] = owner.fp32_precision
    return precisions


def global_torch_state() -> dict[str, object]:
    """Process-wide settings no test may leave changed (RNG streams are checked where they matter:
    some tests seed on purpose)."""
    state: dict[str, object] = {
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "dispatch_modes": len(_get_current_dispatch_mode_stack()),  # a tracker left switched on
        "distributed": torch.distributed.is_available() and torch.distributed.is_initialized(),
        **_fp32_precisions(),
    }
    if torch.cuda.is_available():
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            state["cuda.memory_fraction"] = getter()
    return state


_CUDA_WARM = []


def _warm_up_cuda() -> None:
    """The first matrix products of a process allocate cuBLAS workspaces (64 MiB on an H100)
    and cuBLASLt's (1 MiB, for a product with a bias) that PyTorch keeps for the life of the
    process: make them before any test is measured, so that the first test to multiply
    matrices does not look like a leak."""
    if _CUDA_WARM:
        return
    torch.cuda.init()
    weights = torch.ones(8, 8, device="cuda", requires_grad=True)
    bias = torch.ones(8, device="cuda", requires_grad=True)
    torch.nn.functional.linear(weights, weights @ weights, bias).sum().backward()
    del weights, bias
    _CUDA_WARM.append(True)


def _cuda_allocated() -> int | None:
    if not torch.cuda.is_available():
        return None
    _warm_up_cuda()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.fixture(autouse=True)
def no_leaked_torch_state():
    """Fail a test that leaves global torch state changed or CUDA memory allocated."""
    before, allocated = global_torch_state(), _cuda_allocated()
    yield
    after = global_torch_state()
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
               if before.get(k) != after.get(k)}
    assert not changed, f"the test left global torch state changed (before, after): {changed}"
    if allocated is not None:
        assert _cuda_allocated() <= allocated, "the test left CUDA memory allocated"


# A library may install its own Ctrl-C handler and leave it (SIG_IGN, SIG_DFL, its own): a later
# test in the same worker that presses Ctrl-C (the live loader's, the reliability storm) then
# sees no KeyboardInterrupt. Each test gets the handler back as it found it, and a warning in the
# run's summary names the test that had changed it.
@pytest.fixture(autouse=True)
def ctrl_c_as_found(request: pytest.FixtureRequest):
    before = signal.getsignal(signal.SIGINT)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left the SIGINT handler {left!r} (put back)",
                      stacklevel=1)


@pytest.fixture
def pythons_ctrl_c():
    """Ctrl-C as Python has it by default (KeyboardInterrupt), for a test that presses it:
    ``os.kill(pid, SIGINT)`` and ``_thread.interrupt_main`` do nothing under SIG_IGN or SIG_DFL,
    which a library elsewhere in the same process may have left behind."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
