"""``python -m batchwidgets plan`` (and ``batchwidgets plan``): the largest batch a model trains on
a GPU you would rent, from a shell. The model comes from a Hugging Face config or a factory,
built on the meta device (``_plan_model.py``); the answer is ``find_batch(..., target=...)``'s,
the same engine and the same report, printed answer first, then the table a user rents by.

Each flag is declared once, in ``FLAGS`` (its default, check and help line); the ones that are
find_batch's own options take their help and check from ``FindBatchRequest``'s fields. A
mistake is one line on stderr naming the flag and the fix, exit code 2; progress goes to
stderr, the answer to stdout.

Usage:
    python -m batchwidgets plan --config LlamaConfig hidden_size=4096 num_hidden_layers=32 \\
        --gpu 8xA100-80GB --seq-len 2048 --parallel compare --amp bf16
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PROG = "batchwidgets plan"
DEFAULT_SEQ_LEN = 512  # a --config model's tokens per sample when --seq-len is not given


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (naming the nearest flag when one is misspelt) and
    exit code 2, as every mistake of the command line is."""

    def error(self, message: str) -> None:  # argparse's own: exits
        unknown = [w for w in message.split() if w.startswith("--")]
        if message.startswith("unrecognized arguments") and unknown:
            known = sorted(f for f in self._all_flags() if f.startswith("--"))
            close = difflib.get_close_matches(unknown[0], known, n=1)
            message += f"; did you mean {close[0]}?" if close else f"; flags: {', '.join(known)}"
        self.exit(2, f"{self.prog}: {message} (see --help)\n")

    def _all_flags(self) -> list[str]:
        flags = list(self._option_string_actions)
        for action in self._actions:
            for sub in getattr(action, "choices", None) or {}:
                parser = action.choices[sub] if isinstance(action.choices, dict) else None
                if isinstance(parser, argparse.ArgumentParser):
                    flags += list(parser._option_string_actions)
        return flags


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        several = [part.strip() for part in text.split(",")]
        hint = (f"; give several separated by spaces: {' '.join(several)}"
                if len(several) > 1 and all(part.isdigit() for part in several) else "")
        raise argparse.ArgumentTypeError(f"should be a positive integer, but got {text!r}{hint}")
    return int(text)


def _shape(text: str) -> tuple[int, ...]:
    parts = text.replace("x", ",").strip("()").split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"should be one example's shape such as 3,224,224, "
                                         f"but got {text!r}")
    return tuple(int(part) for part in parts)


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None
    typed.__name__ = getattr(parse, "__name__", "value")
    return typed


@dataclass(frozen=True)
class Flag:
    """One flag of ``plan``: its name (``--name`` with '_' written '-'), default, check (an
    argparse type or choices) and help line; ``keyword``: the find_batch keyword it gives."""

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    metavar: str | None = None
    switch: bool = False
    keyword: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        text = (self.help + ("" if self.default in (None, False) else
                             f" (default: {self.default})")).replace("%", "%%")
        if self.switch:
            parser.add_argument(self.flag, dest=self.name, action="store_true", help=text)
            return
        parser.add_argument(self.flag, dest=self.name, default=self.default, type=self.type,
                            choices=self.choices, nargs=self.nargs, metavar=self.metavar,
                            help=text)


def _find_batch_flag(keyword: str, name: str | None = None, **changes: Any) -> Flag:
    """A flag that is find_batch's own option: its help, parse and choices from its field of
    FindBatchRequest."""
    from .engine import declared
    from .engine.probe import FindBatchRequest  # the engine's declaration (torch loads here)

    option = declared(FindBatchRequest, keyword)
    if option.flag == "negated":
        return Flag("no_" + keyword, option.help, switch=True, keyword=keyword, **changes)
    fields = {"help": _in_flags(option.help), "default": option.default,
              "choices": option.choices, "metavar": option.metavar,
              "type": None if option.choices else _typed(option.parse), "keyword": keyword}
    return Flag(name or keyword, **{**fields, **changes})


def flags() -> tuple[Flag, ...]:
    """Every flag of ``plan``, in the order ``--help`` lists them."""
    from ._plan_model import DTYPES, OPTIMIZERS  # torch loads once plan's flags are read

    return (
        Flag("config", "the model: a Hugging Face config.json (or its folder), or a transformers "
                       "config class, then key=value overrides: --config LlamaConfig "
                       "hidden_size=4096 num_hidden_layers=32", nargs="+",
             metavar="CONFIG"),
        Flag("factory", "the model: module:function (or path/to/file.py:function) called on "
                        "the meta device; it returns a model, (model, make_batch) or (model, "
                        "make_batch, loss_fn)", metavar="MODULE:FUNCTION"),
        Flag("input_shape", "with a --factory that returns a model alone: one example's shape, "
                            "for synthetic batches", type=_shape, metavar="SHAPE"),
        Flag("num_classes", "with --input-shape: class labels and cross-entropy",
             type=_positive, metavar="N"),
        _find_batch_flag("target", "gpu", help="the GPU to plan for: A100-80GB, H100-80GB, T4, "
                                               "..., a size such as 24GiB, H100-80GB@70GiB, or "
                                               "a count: 8xH100-80GB"),
        Flag("seq_len", f"tokens per sample, one or several (the frontier: the largest batch at "
                        f"each); a --config model's default: {DEFAULT_SEQ_LEN}",
             type=_positive, nargs="+", metavar="N", keyword="seq_len"),
        Flag("dtype", "the weights' dtype", default="float32", choices=tuple(DTYPES)),
        _find_batch_flag("amp"),
        Flag("optimizer", "adamw, adam, sgd, adafactor (transformers.Adafactor), adamw8bit or "
                          "adam8bit (bitsandbytes)", default="adamw", choices=OPTIMIZERS),
        Flag("checkpointing", "gradient checkpointing (a Hugging Face model's "
                              "gradient_checkpointing_enable)", switch=True),
        Flag("frozen_base", "train the head alone: the base model's weights frozen",
             switch=True),
        Flag("lora", "LoRA adapters of rank R on every linear layer (needs peft)",
             type=_positive, metavar="R"),
        _find_batch_flag("parallel"),
        Flag("global_batch", "the global batch to keep: the per-device batch and the "
                             "gradient accumulation steps that make it (split_batch)",
             type=_positive, metavar="N"),
        _find_batch_flag("max_batch_size"),
        _find_batch_flag("multiple_of"),
        _find_batch_flag("headroom"),
        _find_batch_flag("keep_output"),
        _find_batch_flag("cache"),
        Flag("snapshot", "write the planned step at the answer for PyTorch's memory viewer "
                         "(pytorch.org/memory_viz; python -m torch.cuda._memory_viz)",
             metavar="FILE"),
        Flag("json", "print the report's fields as JSON (max_batch_size at the top level)",
             switch=True),
    )


def add_flags(parser: argparse.ArgumentParser) -> tuple[Flag, ...]:
    declared = flags()
    for flag in declared:
        flag.add_to(parser)
    return declared


DESCRIPTION = ("Plan the largest batch a model trains on a GPU that is not here: the model is "
               "built on the meta device from a Hugging Face config or a factory, traced on "
               "fake tensors and replayed through the GPU's caching allocator "
               "(find_batch(..., target=GPU)). Nothing runs on a GPU.")


# -- the call: flags -> find_batch's arguments ---------------------------------------------------

def keywords(args: argparse.Namespace, built: Any) -> dict[str, Any]:
    """find_batch's keyword arguments from the flags (the ones given; the rest stay its
    defaults) and what was built."""
    from ._plan_model import FlagError

    given = {"optimizer": built.optimizer}
    if built.loss_fn is not None:
        given["loss_fn"] = built.loss_fn
    for flag in flags():
        value = getattr(args, flag.name, None)
        if flag.keyword is None or value is None or (flag.switch and not value):
            continue
        given[flag.keyword] = False if flag.name.startswith("no_") else (
            list(value) if flag.nargs else value)
    if built.takes_seq_len:
        given.setdefault("seq_len", [DEFAULT_SEQ_LEN])
    elif built.takes_seq_len is False and "seq_len" in given:
        raise FlagError("--seq-len goes with a model whose batches have a length: a --config "
                        "model, or a --factory whose make_batch takes (batch_size, seq_len).")
    return given


def _in_flags(message: str) -> str:
    """find_batch's message in the words of this command's flags."""
    return (message.replace("--target", "--gpu").replace("target=", "--gpu ")
            .replace("parallel=", "--parallel "))


def plan(args: argparse.Namespace, progress: Callable[[str], None]) -> tuple[Any, Any]:
    """(report, built): the model built as the flags say, planned by find_batch."""
    from ._plan_model import FlagError, build
    from .engine._options import FLAGS
    from .engine.probe import check_arguments, find_batch

    if args.gpu is None:
        raise FlagError("--gpu should name the GPU to plan for, e.g. --gpu A100-80GB or --gpu "
                        "8xH100-80GB.")
    built = build(config=args.config, factory=args.factory, input_shape=args.input_shape,
                  num_classes=args.num_classes, dtype=args.dtype, optimizer=args.optimizer,
                  checkpointing=args.checkpointing, frozen_base=args.frozen_base,
                  lora=args.lora)
    given = keywords(args, built)
    try:
        check_arguments(built.model, built.make_batch, said=FLAGS, **given)
    except (TypeError, ValueError) as error:
        raise FlagError(_in_flags(str(error))) from None
    progress(f"built {built.described}; planning for {args.gpu}")

    def on_step(attempt: Any) -> None:
        progress(f"traced batch size {attempt.batch_size} on fake tensors")

    report = find_batch(built.model, built.make_batch, on_step=on_step, **given)
    return report, built


# -- what it prints --------------------------------------------------------------------------

def _bytes(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [list(map(str, header)), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                             enumerate(zip(row, widths))).rstrip() for row in cells]


def one_step_larger(report: Any) -> str:
    """What the next size needs on the target, and the GPUs whose memory would hold it."""
    from .engine import memory

    size = report.max_batch_size + report.multiple_of
    need = report.predict_peak_bytes(size)
    if need is None or report.limit_bytes is None:
        return ""
    rank = " per rank" if report.parallel else ""
    gpu = (report.target or "").split("@", 1)[0]
    larger = [name for name, total in sorted(memory.GPU_TARGETS.items(), key=lambda kv: kv[1])
              if name != gpu and memory.parse_target(name)[1] >= need]
    where = (f"; a GPU of at least that much would hold it ({', '.join(larger[:3])})" if larger
             else "; no GPU in the list holds it: shard it (--parallel) or checkpoint")
    return (f"one step larger: batch size {size}{rank} needs {_bytes(need)}, "
            f"{_bytes(need - report.limit_bytes)} over the {_bytes(report.limit_bytes)} usable"
            f"{where}")


def text(report: Any, args: argparse.Namespace) -> list[str]:
    """The answer first, then the table a user rents by."""
    lines = [report.summary(), ""]
    if report.frontier:
        rank = f", per rank under {report.parallel}" if report.parallel else ""
        lines += [f"batch x sequence length on {report.target}{rank}:",
                  *_table(("seq_len", "max batch", "tokens per batch"),
                          [(n, b, n * b) for n, b in report.frontier.items()]), ""]
    if report.parallel_plans:
        at = f" at seq_len {report.seq_len}" if report.seq_len else ""
        lines += [f"strategies on {report.world_size}x{report.target}{at} (per rank):",
                  *_table(("parallel", "batch/rank", "global", "weights", "gradients",
                           "optimizer", "communication", "activations"),
                          [(p.parallel, p.max_batch_size, p.global_batch_size,
                            *map(_bytes, (p.parameters_bytes, p.gradients_bytes,
                                          p.optimizer_bytes, p.communication_bytes,
                                          p.activations_bytes)))
                           for p in report.parallel_plans]), ""]
    split = report.memory_split
    if split is not None:
        lines += [f"memory at the peak of the traced step (batch size {split.batch_size}, "
                  f"{split.where}):",
                  *_table(("part", "bytes", "share"),
                          [(name, _bytes(value), f"{share:.0%}") for (name, value), share
                           in zip(split.parts_bytes.items(), split.shares.values())]), ""]
    larger = one_step_larger(report)
    if larger:
        lines.append(larger)
    if args.global_batch and report.max_batch_size:
        lines.append(global_batch_line(report, args.global_batch))
    return lines


def global_batch_split(report: Any, global_batch: int) -> tuple[int, int]:
    """``--global-batch``'s (per device, accumulation steps) at the report's recommended batch,
    for the text and for ``--json`` alike; a global batch the GPUs cannot share is a FlagError."""
    from ._plan_model import FlagError
    from .engine.accumulate import split_batch

    world = report.world_size
    if global_batch % world:
        low = global_batch // world * world
        raise FlagError(f"--global-batch {global_batch} should be a multiple of the {world} GPUs "
                        f"of --gpu, so every rank takes the same share; e.g. --global-batch "
                        f"{max(low, world)} or {low + world}.")
    return split_batch(global_batch, report.recommended_batch_size, world)


def global_batch_line(report: Any, global_batch: int) -> str:
    per_device, steps = global_batch_split(report, global_batch)
    return (f"global batch {global_batch}: {per_device} per device x {steps} accumulation "
            f"steps x {report.world_size} device(s) (at most the recommended "
            f"{report.recommended_batch_size} per device)")


def as_json(report: Any, args: argparse.Namespace) -> str:
    from .results._json import as_json as fields

    data = {name: value for name, value in fields(report).items() if not name.startswith("_")
            and name != "step_snapshot"}
    data.update(recommended_batch_size=report.recommended_batch_size,
                global_batch_size=report.global_batch_size, summary=report.summary())
    if args.global_batch and report.max_batch_size:
        per_device, steps = global_batch_split(report, args.global_batch)
        data["global_batch"] = {"global_batch_size": args.global_batch,
                                "per_device": per_device, "accumulation_steps": steps}
    return json.dumps(data, indent=1, default=str)


def _model_failed(args: argparse.Namespace, error: BaseException) -> str:
    """One line for a model that raised in its step: what it was built from, what find_batch
    called and what was raised (its own line), and the flags that make the model and batch."""
    from .engine._util import first_line
    source, fix, batch = ((f"--config {args.config[0]}", "its KEY=VALUE overrides (or the file)",
                           "--seq-len") if args.config else
                          (f"--factory {args.factory}", "the factory", "--input-shape, --seq-len"))
    return (f"the model from {source} raised in its training step: "
            f"{first_line(error, with_type=False)}; fix {fix} or the batch it is given ({batch})")


def run(args: argparse.Namespace) -> int:
    """The parsed flags planned and printed; a FlagError is one line on stderr, exit code 2."""
    from ._plan_model import FlagError

    def progress(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    try:
        report, _ = plan(args, progress)
        out = as_json(report, args) if args.json else "\n".join(text(report, args))
        if args.snapshot:
            saved = report.save_snapshot(args.snapshot)
            progress(f"snapshot written to {args.snapshot}: {saved}")
    except FlagError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from .engine._called import is_said
        from .engine.probe import NoBatchSizeFits
        if is_said(error):  # the model or its batch raised in the traced step: theirs to fix
            print(f"{PROG}: {_model_failed(args, error)}", file=sys.stderr)
            return 2
        if not isinstance(error, NoBatchSizeFits):
            raise
        # the plan that found nothing is still the table (what a rank holds, each strategy)
        print(as_json(error.report, args) if args.json else "\n".join(text(error.report, args)))
        print(f"{PROG}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    print(out)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``batchwidgets plan ARGS``, as a function: the exit code (argparse's exits raise
    SystemExit with code 2)."""
    made = OneLineParser(prog=prog, description=DESCRIPTION)
    add_flags(made)
    return run(made.parse_args(argv))

