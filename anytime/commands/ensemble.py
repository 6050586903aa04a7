"""``anytime ensemble``: an ensemble of trained runs (any architecture, any precision), fused after each member by
fusers fit on validation, written as a run whose steps are its growing prefixes."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_device, add_json, add_out, add_overwrite, int_at_least, positive_int
from anytime.commands.output import print_json, progress_printer

SUMMARY = "an ensemble of trained runs (any architecture, any precision) fused after each member, as a run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime ensemble``."""
    parser.add_argument(
        "--members",
        required=True,
        metavar="RUN,RUN,...",
        help="finished runs trained on the same data and split (a multi-exit run answers with its "
        "last exit; a quantized run at its precision)",
    )
    parser.add_argument(
        "--order",
        choices=["cost", "greedy", "given"],
        default="cost",
        help="cost: cheapest first (batch-1 latency, from the members' profiles or measured); greedy: "
        "most validation accuracy per millisecond first; given: as listed (default cost)",
    )
    parser.add_argument(
        "--fuser",
        choices=["mlp", "mean", "vote", "weighted"],
        default="mlp",
        help="the fuser the run deploys (all four are fit and reported; default mlp)",
    )
    parser.add_argument(
        "--folds",
        type=int_at_least(2),
        default=5,
        metavar="K",
        help="cross-fitting folds of the validation split (default 5)",
    )
    parser.add_argument(
        "--fit-split",
        default="val",
        metavar="SPLIT",
        help="where fusers are fit: the validation split, held out of every member (the only choice)",
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=32, metavar="N", help="the MLP fuser's hidden units (default 32)"
    )
    add_device(parser)
    add_out(parser, "the ensemble run (a new or empty folder)", required=True)
    add_overwrite(parser, "replace an earlier run in --out")
    add_json(parser, "print the ensemble's report as JSON")


def run(args: argparse.Namespace) -> int:
    """Build the ensemble run; print its members and every fuser's accuracy after each of them."""
    from anytime.families import FUSERS, FitSettings
    from anytime.tasks.ensemble import EnsembleSettings, build_ensemble

    members = [m for m in args.members.split(",") if m.strip()]
    settings = EnsembleSettings(order=args.order, fuser=args.fuser, folds=args.folds, fit_split=args.fit_split,
                                fit=FitSettings(hidden=args.hidden))  # fmt: skip
    report = build_ensemble(members, args.out, settings, device=args.device, overwrite=args.overwrite,
                            progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    print(f"run    {report.out}: {len(report.members)} members in {report.order} order, deploys the {report.fuser} "
          "fuser")  # fmt: skip
    print(f"{'#':<3} {'member':<20} {'precision':<9} {'val':>7} {'test':>7} {'ms (b1)':>8}  run")
    for k, m in enumerate(report.members):
        cost = f"{m.cost_ms:8.3f}" if m.cost_ms is not None else f"{'-':>8}"
        print(f"{k:<3} {m.name:<20} {m.precision:<9} {100 * m.val_acc:6.2f}% {100 * m.test_acc:6.2f}% {cost}  {m.run}")
    if report.cost_source != "not measured":
        print(f"costs: {report.cost_source}")
    print("fused accuracy of the first k members, test (validation cross-fitted):")
    print(f"{'fuser':<9} " + " ".join(f"{f'k={k + 1}':>16}" for k in range(len(report.members))))
    for kind in FUSERS:
        fused = zip(report.test_acc[kind], report.val_acc[kind], strict=False)
        cells = [f"{100 * t:6.2f}% ({100 * v:5.2f}%)" for t, v in fused]
        print(f"{kind + (' *' if kind == report.fuser else ''):<9} " + " ".join(f"{c:>16}" for c in cells))
    if report.stacking is not None:
        val, test = report.stacking
        print(f"scikit-learn cross-check, LogisticRegression on all members: test {100 * test:.2f}% ({100 * val:.2f}%)")
    best = report.best_member
    print(f"best single member (by validation): {best.name}, test {100 * best.test_acc:.2f}%")
    print(f"next: anytime profile {report.out}; anytime calibrate {report.out} ...; anytime schedule {report.out} "
          "--deadline-ms D")  # fmt: skip
    return 0
