"""``anytime sweep``: sweep the exit thresholds of a collected run: accuracy, FLOPs, exit shares and the Pareto
front of each criterion."""

from __future__ import annotations

import argparse

from anytime.commands.options import CRITERIA, add_json, add_split, int_at_least
from anytime.commands.output import print_json

SUMMARY = "sweep exit thresholds over the cached outputs: accuracy, FLOPs, exit shares, Pareto front"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime sweep``."""
    parser.add_argument("run", metavar="RUN")
    parser.add_argument(
        "--criterion",
        action="append",
        choices=list(CRITERIA),
        help="exit criterion (repeat for several; default all four)",
    )
    parser.add_argument(
        "--settings",
        type=int_at_least(2),
        default=1000,
        metavar="S",
        help="threshold settings to sweep (default 1000)",
    )
    add_split(parser, ("val", "test", "dev"), default="val")
    add_json(parser, "print the Pareto fronts as JSON")


def run(args: argparse.Namespace) -> int:
    """Sweep, write the tables, and print each criterion's front and a few of its points."""
    import numpy as np

    from anytime.tasks.sweep import sweep_run

    criteria = args.criterion or list(CRITERIA)
    report = sweep_run(args.run, criteria, settings=args.settings, split=args.split)
    if args.json:
        return print_json({name: r.rows(r.pareto()) for name, r in report.results.items()})
    o = report.oracle
    print(f"{args.settings} settings per criterion on {args.run} ({args.split}); "
          f"last exit alone: {100 * report.steps[-1][f'{args.split}_acc']:.2f}%")  # fmt: skip
    print(f"oracle (first correct exit): {100 * o['accuracy']:.2f}% at {o['flops_ratio']:.3f}x FLOPs "
          f"({o['flops_speedup']:.2f}x fewer)")  # fmt: skip
    for name, result in report.results.items():
        front = result.pareto()
        print(f"{name}: {len(front)} Pareto points, area under the curve {100 * result.area():.2f}% (mean best "
              "accuracy over FLOPs budgets); e.g.")  # fmt: skip
        last = report.steps[-1][f"{args.split}_acc"]
        for drop in (0.0, 0.01, 0.02, 0.05):
            ok = [i for i in front if result.accuracy[i] >= last - drop]
            if ok:
                i = min(ok, key=lambda j: result.mean_flops[j])
                thresholds = np.round(result.thresholds[i], 4).tolist()
                print(f"  within {100 * drop:.0f} points: {100 * result.accuracy[i]:.2f}% at "
                      f"{result.flops_ratio[i]:.3f}x FLOPs, thresholds {thresholds}")  # fmt: skip
    print(f"all settings in {report.csv}, fronts in {report.json}")
    return 0
