"""``anytime report``: one self-contained HTML page of a run (RUN/report.html): its recipe, curves, steps,
calibration and latency, naming the sections it could not fill."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_json, add_out
from anytime.commands.output import print_json

SUMMARY = "one self-contained HTML page of a run (RUN/report.html): recipe, curves, steps, calibration, latency"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime report``."""
    parser.add_argument("run", metavar="RUN")
    add_out(parser, "default RUN/report.html (replaced)", metavar="FILE")
    add_json(parser, "print the page's path and missing sections as JSON")


def run(args: argparse.Namespace) -> int:
    """Write the page; print its path and what it is missing."""
    from anytime.tasks.report import write_report

    result = write_report(args.run, args.out)
    if args.json:
        return print_json({"report": str(result.path), "missing": list(result.missing)})
    print(f"report {result.path}")
    for line in result.missing:
        print(f"missing {line}")
    return 0
