"""``anytime cut``: cut residual links or skip blocks of a trained ResNet and measure what each cut costs in
accuracy and saves in latency (tables, plots); or ``--ladder``: a run whose steps drop blocks one after another."""

from __future__ import annotations

import argparse
import sys

from anytime.commands.options import (
    add_device,
    add_json,
    add_out,
    add_overwrite,
    add_split,
    non_negative_int,
    positive_int,
)
from anytime.commands.output import print_json, progress_printer
from anytime.errors import AnytimeError

SUMMARY = "cut residual links or skip blocks of a trained ResNet: accuracy and latency (CSV, plots), or a ladder run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime cut``."""
    parser.add_argument(
        "run", metavar="RUN", help="a finished run of a plain ResNet (resnet20, resnet18, tv:resnet50...)"
    )
    parser.add_argument(
        "--kind",
        choices=["shortcut", "branch", "both"],
        help="shortcut: cut the link (the block keeps its branch); branch: skip the branch (the block "
        "keeps its shortcut); default both",
    )
    parser.add_argument(
        "--recalibrate-bn",
        action="store_true",
        help="also measure each cut after recomputing the batch-norm statistics on training images",
    )
    parser.add_argument(
        "--finetune-epochs",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also measure each cut after N epochs of fine-tuning it (slow: one fine-tune per cut)",
    )
    add_split(parser, ("val", "test"), help="where the study scores each cut (default test)")
    parser.add_argument(
        "--images", type=positive_int, metavar="N", help="evaluate on N images of the split, drawn at random (seeded)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, metavar="N", help="batch-1 timings per configuration (default 30)"
    )
    add_device(parser)
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="instead of the study, write --out: a run whose steps are the cumulative block-drop ladder",
    )
    add_out(parser, "the ladder run (with --ladder), or the study's folder (default RUN/cut)")
    add_overwrite(parser, "replace an earlier study (or ladder run) in --out")
    add_json(parser, "print the study's files (or the ladder run's summary) as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the study and print its files, or write the ladder run and print its steps."""
    from anytime.tasks.cut import CutSettings, cut_study

    if args.ladder:
        return _ladder(args)
    kinds = ("shortcut", "branch") if args.kind in (None, "both") else (args.kind,)
    settings = CutSettings(kinds=kinds, recalibrate_bn=args.recalibrate_bn, finetune_epochs=args.finetune_epochs,
                           split=args.split or "test", images=args.images,
                           latency_repeats=args.repeats or 30)  # fmt: skip
    study = cut_study(args.run, settings, device=args.device, out=args.out, overwrite=args.overwrite,
                      progress=progress_printer(args), bar=sys.stderr.isatty())  # fmt: skip
    if args.json:
        return print_json(study)
    print(f"table  {study.csv}")
    print(f"report {study.json}")
    for path in study.plots:
        print(f"plot   {path}")
    return 0


def _ladder(args: argparse.Namespace) -> int:
    from anytime.tasks.cut import make_ladder_run

    if args.out is None:
        raise AnytimeError("--ladder writes a new run: give it a folder with --out LADDER_RUN")
    if args.recalibrate_bn or args.finetune_epochs:
        raise AnytimeError(
            "the ladder shares one set of weights and statistics across its steps; "
            "--recalibrate-bn and --finetune-epochs apply to the study (train with --stochastic-depth instead)"
        )
    study_only = [flag for flag, value in (("--kind", args.kind), ("--split", args.split), ("--images", args.images),
                                           ("--repeats", args.repeats)) if value is not None]  # fmt: skip
    if study_only:
        raise AnytimeError(
            f"{', '.join(study_only)} set the study; the ladder run skips branches from the top and "
            "is scored on validation and test in full (collect and profile it next)"
        )
    summary = make_ladder_run(args.run, args.out, device=args.device, overwrite=args.overwrite)
    if args.json:
        return print_json(summary.to_dict())
    print(f"ladder run {args.out}: {len(summary.steps)} steps from {args.run}")
    for e in summary.steps:
        print(f"step {e.index:<3} {e.name:<14} {100 * e.flops / (summary.backbone_flops or 1):5.1f}% FLOPs  "
              f"val {100 * e.val_acc:.2f}%  test {100 * e.test_acc:.2f}%")  # fmt: skip
    print(f"next: anytime collect {args.out} --split val; anytime profile {args.out}")
    return 0
