"""``anytime seeds``: several seeds of one recipe: every step's validation and test accuracy as mean, spread and
range, and the training time."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_json
from anytime.commands.output import print_json
from anytime.tasks.seeds import summarise_seeds

SUMMARY = "several seeds of one recipe: every step's validation and test accuracy as mean, spread and range"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime seeds``."""
    parser.add_argument("runs", nargs="+", metavar="RUN", help="runs of one recipe trained with different --seed")
    add_json(parser, "print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Summarise the runs and print one row per step."""
    summary = summarise_seeds(args.runs)
    if args.json:
        return print_json(summary)
    print(f"{summary.model} on {summary.data}: {len(summary.runs)} seeds ({', '.join(map(str, summary.seeds))})")
    print(f"{'step':<8} {'validation: mean ± std [min, max]':<36} {'test: mean ± std [min, max]':<36}")
    for s in summary.steps:
        cells = [
            f"{100 * f.mean:.2f} ± {100 * f.std:.2f} [{100 * f.low:.2f}, {100 * f.high:.2f}]"
            for f in (s.val_acc, s.test_acc)
        ]
        print(f"{s.name:<8} {cells[0]:<36} {cells[1]:<36}")
    t = summary.train_time_s
    print(f"training time {t.mean:.1f} ± {t.std:.1f} s")
    return 0
