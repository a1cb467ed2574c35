"""critical_batch's options, each declared once (NOTE [ Options declared once ] in
engine/_options.py): ``%critical_batch``'s flags read them from here."""

from __future__ import annotations

from .._options import Option, Options, integers, number, positive_integer

CRITICAL_BATCH = Options(
    "critical_batch",
    Option("loss_fn", None, "loss_fn(output, target) (default: the output's .loss)",
           flag="name"),
    Option("target_loss", None, "the loss every branch runs to (default: 90% of the way to the "
                                "loss the base batch reaches in --base-steps steps)",
           metavar="X", parse=number),
    Option("base_batch_size", None, "the ladder's first batch (default: the DataLoader's, "
                                    "else 8)", metavar="N", parse=positive_integer),
    Option("batch_sizes", None, "the ladder, e.g. 8,16,32,64,128 (default: the base x 1, 2, "
                                "4 ... 32)", metavar="N,N,...", parse=integers),
    Option("base_steps", 64, "steps of the base batch that set the target", metavar="N",
           parse=positive_integer),
    Option("lr_scaling", None, "how each branch's learning rate follows its batch (default: "
                               "sqrt for the Adam family, linear otherwise)",
           choices=("linear", "sqrt", "none")),
    Option("scheduler", None, "an LR scheduler stepped in the branches", flag="name"),
    Option("seeds", 2, "draws of the batches; two or more give an error bar", metavar="N",
           parse=positive_integer),
    Option("max_steps", None, "steps a branch may take (default: 4 x --base-steps)",
           metavar="N", parse=positive_integer),
    Option("eval_examples", 256, "examples the loss is evaluated on", metavar="N",
           parse=positive_integer),
    Option("noise", True, "also measure B_simple at the same weights", flag=""),
    Option("fits_batch_size", None, "the largest batch that fits (or a find_batch report): "
                                    "larger ones accumulate micro-batches", flag=""),
    Option("criterion", "steps", "loss: also Merrill et al.'s largest batch within "
                                 "--loss-tolerance of the base's loss at equal examples",
           choices=("steps", "loss")),
    Option("loss_tolerance", 0.01, "with --criterion loss: relative, 0.01 is 1%", metavar="X",
           parse=number),
    Option("device", None, "where the branches run (default: the model's)"),
)
