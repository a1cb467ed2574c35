"""Faults a careless or impatient user causes, counted: bursts of Ctrl-C during find_batch (in
this process and in a real Jupyter kernel), and what 50 probes and 100 loader toggles leave open
(widgets, threads, /dev/shm entries). Writes benchmarks/results/faults_cpu.md.

Usage:
    python benchmarks/faults.py --trials 100         # about 8 minutes on 2 busy cores
    python benchmarks/faults.py --trials 10 --kernel-trials 2 --probes 10 --toggles 20
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
from _machine import commit, device_name

ROOT = Path(__file__).resolve().parent.parent
# the storm is the one tests/engine/test_reliability.py runs
sys.path.insert(0, str(ROOT / "tests"))

from test_reliability import accumulate_storm, kernel_storm, run_storm  # noqa: E402


def _shm_entries() -> int:
    return len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0


def leaks(probes: int, toggles: int) -> dict:
    """Widgets, threads and /dev/shm entries left after ``probes`` %find_batch panels (a shell
    with a front end) and ``toggles`` LoaderPanel control changes with worker processes."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython
    from ipywidgets.widgets import widget

    import batchwidgets as bw

    start_ipython()
    shell = get_ipython()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    shell.push({"model": model, "data": torch.randn(16),
                "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    shell.run_line_magic("load_ext", "batchwidgets")
    shell.kernel = object()  # panels are made where a front end shows widgets
    before = (len(widget._instances), threading.active_count(), _shm_entries())
    for _ in range(probes):
        shell.run_line_magic("find_batch", "model data --optimizer opt --budget 64KiB "
                                           "--max-batch-size 64 --steps-per-trial 1")
    after_probes = (len(widget._instances), threading.active_count(), _shm_entries())
    dataset = torch.utils.data.TensorDataset(torch.randn(512, 32))
    panel = bw.LoaderPanel(dataset, batch_size=32, duration_s=0.05, max_workers=2)
    for i in range(toggles):
        panel.num_workers.value = (0, 1, 2)[i % 3]
        panel.pin_memory.value = False
        if i % 10 == 9:
            panel.wait()
    panel.wait()
    panel.close()
    time.sleep(1.0)
    after_toggles = (len(widget._instances), threading.active_count(), _shm_entries())
    del shell.kernel
    shell.run_line_magic("unload_ext", "batchwidgets")
    return {"probes": probes, "toggles": toggles, "before": before,
            "after_probes": after_probes, "after_toggles": after_toggles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="in-process storms")
    parser.add_argument("--kernel-trials", type=int, default=4, help="storms in a real kernel")
    parser.add_argument("--accumulate-trials", type=int, default=500,
                        help="accumulate blocks hit by Ctrl-C")
    parser.add_argument("--probes", type=int, default=50)
    parser.add_argument("--toggles", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/faults_cpu.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    storm = run_storm(trials=args.trials, width=256, depth=2)
    kernel = kernel_storm(args.kernel_trials)
    blocks = accumulate_storm(args.accumulate_trials)
    leak = leaks(args.probes, args.toggles)
    lines = [
        "# Faults: interrupt storms and leaks (CPU)", "",
        f"commit {commit()}, {device_name(torch.device('cpu'))}, torch {torch.__version__}, "
        f"{time.perf_counter() - started:.0f} s in all", "",
        "Bursts of 1-5 Ctrl-C at random moments of a find_batch (Adam, BatchNorm, Dropout), "
        "each followed by a bit-exact comparison of weights, grads, buffers, optimizer state "
        "and param_groups, modes and RNGs (`python benchmarks/faults.py`).", "",
        "| where | trials | failures | interrupts lost | probe alone |", "|---|---|---|---|---|",
        f"| in-process (`_thread.interrupt_main`) | {storm['trials']} | {storm['failures']} | "
        f"{len(storm['lost'])} | {storm['probe_s']:.1f} s |",
        f"| real kernel (`KernelManager.interrupt_kernel`) | {kernel['trials']} | "
        f"{kernel['failures']} | | {kernel['probe_s']:.1f} s |", "",
        'Interrupts lost: raised where Python prints "Exception ignored" (a `__del__`, a '
        "weak-reference callback). A storm that aborts the process ends the script.", "",
        f"Kernel trials (presses, probe cell status, state identical): {kernel['details']}", "",
        "Bursts of 1-5 Ctrl-C around short `accumulate` blocks (AdamW, StepLR, clipping; "
        "each from a little before it starts to a little after it ends); a failure is anything "
        "left patched afterwards (`optimizer.step`, the scheduler, `Tensor.backward`, "
        "`clip_grad_norm_`, hooks, grad mode, the SIGINT handler).", "",
        "| blocks | failures | block alone |", "|---|---|---|",
        f"| {blocks['trials']} | {blocks['failures']} | {blocks['block_s'] * 1000:.0f} ms |", "",
        "| after | widgets open | threads | /dev/shm entries |", "|---|---|---|---|",
        *(f"| {name} | {w} | {t} | {s} |" for name, (w, t, s) in (
            ("start", leak["before"]), (f"{leak['probes']} %find_batch panels",
                                        leak["after_probes"]),
            (f"{leak['toggles']} LoaderPanel toggles, closed", leak["after_toggles"]))),
        "", "Only the last 3 %find_batch panels stay live (BatchMagics.LIVE_PANELS); before, "
        "each call left about 31 widgets open.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
