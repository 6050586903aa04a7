"""``anytime ponder``: maps of the residual units a SACT run spends at every position of an image, at each of its
halting thresholds."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_device, add_images, add_json, add_out, add_steps, step_list
from anytime.commands.output import print_json

SUMMARY = "maps of the residual units a SACT run spends at every position of an image, at each halting threshold"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime ponder``."""
    parser.usage = "anytime ponder RUN (--images FILE [FILE ...] | --split test [--count N]) [options]"
    parser.add_argument("run", metavar="RUN", help="a SACT run (trained with --sact)")
    add_images(parser)
    add_steps(parser, "the steps (halting thresholds) to map (default every one)")
    add_device(parser)
    add_out(parser, "default RUN/ponder (ponder.png/.svg, ponder.npz, ponder.json, replaced together)")
    add_json(parser, "print the files and each step's mean units per stage as JSON")


def run(args: argparse.Namespace) -> int:
    """Draw the maps; print each step's mean units per stage and the files written."""
    from anytime.tasks.ponder import ponder_run

    report = ponder_run(args.run, images=args.images, split=args.split, count=args.count, steps=step_list(args.steps),
                        out=args.out, device=args.device)  # fmt: skip
    if args.json:
        return print_json(report)
    for step in report.steps:
        units = ", ".join(f"{u:.2f}" for u in step.units)
        print(f"{step.name}: mean units per stage {units} ({sum(step.units):.2f} in all)")
    for path in report.paths:
        print(path)
    return 0
