"""``anytime calibrate``: fit a multi-exit run's thresholds on validation, for an accuracy drop or a FLOPs budget,
and write them to RUN/calibration.json for ``evaluate``, ``schedule`` and ``serve``."""

from __future__ import annotations

import argparse
from pathlib import Path

from anytime.commands.options import CRITERIA, add_json, add_out, add_profile, finite_float
from anytime.commands.output import print_json, print_policy_figures
from anytime.errors import AnytimeError

SUMMARY = "fit exit thresholds on validation for an accuracy drop or a FLOPs budget (RUN/calibration.json)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime calibrate``."""
    parser.add_argument("run", metavar="RUN")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--max-drop",
        type=finite_float,
        metavar="POINTS",
        help="cheapest thresholds within POINTS accuracy points of the last exit (validation)",
    )
    target.add_argument(
        "--budget-flops",
        type=finite_float,
        metavar="FRACTION",
        help="most accurate thresholds whose mean FLOPs are at most FRACTION of the backbone's",
    )
    parser.add_argument("--criterion", choices=list(CRITERIA), default="entropy")
    parser.add_argument(
        "--rule",
        choices=["search", "msdnet"],
        help="with --budget-flops: direct search (default) or MSDNet's shares proportional to q^k",
    )
    parser.add_argument("--temperature", action="store_true", help="fit a temperature per exit first")
    parser.add_argument(
        "--combine-exits",
        action="store_true",
        help="every exit answers with a weighted ensemble of itself and the earlier exits "
        "(Zero Time Waste), weights fit on validation; the heads it weighs always run",
    )
    parser.add_argument(
        "--select-exits",
        action="store_true",
        help="with --max-drop: also choose which exits to keep, every subset costed in the time the "
        "run's profile measured at batch 1 (dropped exits' heads never run)",
    )
    add_profile(parser, "with --select-exits: default the run's only profile")
    add_out(parser, "default RUN/calibration.json", metavar="FILE")
    add_json(parser, "print the whole report as JSON")


def run(args: argparse.Namespace) -> int:
    """Calibrate and print the policy with its figures on validation and test."""
    from anytime.scheduler.query import CALIBRATION
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run

    if args.rule is not None and args.max_drop is not None:
        raise AnytimeError("--rule chooses how to meet --budget-flops; it does not apply to --max-drop")
    report = calibrate_run(
        args.run,
        CalibrationSettings(
            max_drop=args.max_drop,
            budget=args.budget_flops,
            criterion=args.criterion,
            rule=args.rule or "search",
            temperature=args.temperature,
            select=args.select_exits,
            combine=args.combine_exits,
        ),
        out=args.out,
        profile=args.profile,
    )
    if args.json:
        return print_json(report.to_dict())
    if report.selection is not None:
        chosen = report.selection
        print(f"exit subsets, costed in the time measured by {chosen.profile} (backbone {chosen.backbone_ms:.3f} ms at "
              "batch 1):")  # fmt: skip
        for subset in sorted(chosen.subsets, key=lambda t: t.mean_ms):
            print(f"  exits {list(subset.exits) or 'none'}: validation {100 * subset.accuracy:.2f}% at "
                  f"{subset.mean_ms:.3f} ms ({chosen.backbone_ms / subset.mean_ms:.2f}x)")  # fmt: skip
        test = f"; on test {chosen.test_speedup:.2f}x" if chosen.test_speedup is not None else ""
        print(f"kept exits {list(chosen.exits)} (the last always answers){test}")
    policy = report.policy
    print(f"{report.calibration.rule} {report.calibration.target} with {policy.criterion}: thresholds "
          f"{[None if t is None else round(t, 4) for t in policy.thresholds]}"
          + (f", temperatures {[round(t, 3) for t in policy.temperatures]}" if policy.temperatures else "")
          + (f", combining exits with weights {[[round(w, 3) for w in row] for row in policy.combine]}"
             if policy.combine else ""))  # fmt: skip
    print_policy_figures("validation", report.validation)
    print_policy_figures("test", report.test)
    oracle_test = report.oracle["test"] or report.oracle["validation"]
    assert oracle_test is not None
    print(f"oracle      {100 * oracle_test['accuracy']:.2f}% at {oracle_test['flops_ratio']:.3f}x FLOPs "
          f"({'test' if report.oracle['test'] else 'validation'})")  # fmt: skip
    if report.alternative is not None:
        alt = report.alternative
        print(f"({alt.rule} would give validation {100 * alt.validation.accuracy:.2f}% at "
              f"{alt.validation.flops_ratio:.3f}x FLOPs)")  # fmt: skip
    print(f"saved to {args.out or Path(args.run) / CALIBRATION}")
    return 0
