"""``anytime plot``: the figures of a multi-exit run: accuracy against cost and threshold, the exit histogram,
each exit's accuracy, and the deadline plots where the run has a device profile."""

from __future__ import annotations

import argparse

from anytime.commands.options import FIGURE_SIZE_HELP, add_figure_size, add_json, add_profile
from anytime.commands.output import print_json

SUMMARY = "plot a multi-exit run: accuracy vs cost, vs threshold, exit histogram, per-exit accuracy, deadlines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime plot``."""
    parser.add_argument("run", metavar="RUN")
    add_profile(parser, "device profile for the deadline plots (default: the run's only one)")
    add_figure_size(parser, FIGURE_SIZE_HELP + " (default screen; a paper's size goes into RUN/plots/SIZE/)")
    add_json(parser, "print the figures drawn and the sections skipped as JSON")


def run(args: argparse.Namespace) -> int:
    """Draw the figures; print their paths and what was not drawn, and why."""
    from anytime.tasks.plots import plot_run

    report = plot_run(args.run, profile=args.profile, figure_size=args.figure_size)
    if args.json:
        return print_json(report)
    for path in report.paths:
        print(path)
    for reason in report.skipped:
        print(f"not drawn: {reason}")
    return 0
