"""Command line: ``python -m batchwidgets demo`` probes a built-in CNN and writes a plot;
``python -m batchwidgets plan`` plans a model for a GPU that is not here (``_plan_cli.py``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _plan_cli


def _parser() -> argparse.ArgumentParser:
    parser = _plan_cli.OneLineParser(
        prog="python -m batchwidgets",
        description="Measure how large a batch trains on this device, or plan it for a GPU "
                    "that is not here.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="probe a small CNN (3x32x32 inputs, 10 classes, Adam) on synthetic data",
        description="Probe the largest batch size of a small CNN (3x32x32 inputs, 10 classes, "
                    "Adam) on synthetic data, on the best device present (CUDA, then MPS, then "
                    "the CPU), print the report and write a plot.")
    demo.add_argument("--device", help="cuda, cuda:1, mps or cpu (default: the best present)")
    demo.add_argument("--budget", help="memory cap such as 512MB or 2GiB (default: the whole GPU; "
                                       "256MiB on the CPU, to finish in under a minute)")
    demo.add_argument("--amp", choices=["bf16", "fp16"], help="probe under autocast")
    demo.add_argument("--max-batch-size", type=int, help="largest batch size to try")
    demo.add_argument("--plot", default="batchwidgets-demo.png",
                      help="where to write the PNG plot (default: %(default)s)")
    # its flags are read from the engine's declarations (torch loads): main() hands it on
    commands.add_parser("plan", help="plan a model from a Hugging Face config or a factory for "
                                     "a GPU that is not here (plan --help: its flags)")
    return parser


def _print_report(report) -> None:
    rows = report.rows()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()
    print(f"{'batch size':>10}  {'fits':>4}  {'peak MiB':>9}  {'step s':>8}  {'samples/s':>10}")
    for a in report.attempts:
        peak = f"{a.peak_memory_bytes / 2**20:.1f}" if a.peak_memory_bytes else "-"
        step = f"{a.step_time_s:.4f}" if a.step_time_s else "-"
        speed = f"{a.samples_per_s:.0f}" if a.samples_per_s else "-"
        fits = "fake" if a.fake else "yes" if a.fits else "OOM"  # fake: traced, not run
        print(f"{a.batch_size:>10}  {fits:>4}  {peak:>9}  {step:>8}  {speed:>10}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return _plan_cli.main(argv[1:], prog="python -m batchwidgets plan")
    args = _parser().parse_args(argv)
    from .demo import run_demo  # torch loads only once a command runs
    from .plots import plot_probe

    report = run_demo(device=args.device, budget=args.budget, amp=args.amp,
                      max_batch_size=args.max_batch_size)
    _print_report(report)
    plot_probe(report).savefig(args.plot, dpi=100)
    print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
