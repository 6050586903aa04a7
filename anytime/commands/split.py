"""``anytime split``: plan split computing: the partition point, the codec and the exit thresholds that answer most
accurately within a deadline over a link, from the device's and the server's profiles (JSON)."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_split_plan
from anytime.commands.output import print_json

SUMMARY = (
    "split computing: the partition point, codec and exit thresholds that answer most accurately within a "
    "deadline over a link, from the device's and the server's profiles (JSON)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime split``."""
    parser.add_argument("run", metavar="RUN", help="a run with exits (or an ensemble), validation outputs collected")
    add_split_plan(parser)
    parser.add_argument("--frontier", action="store_true", help="print every frontier option too")


def run(args: argparse.Namespace) -> int:
    """Plan, and print the chosen option (and the frontier, if asked)."""
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link, PlanSettings
    from anytime.split.runs import plan_run

    link = Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms)
    settings = PlanSettings(quantile=args.quantile, codecs=parse_codecs(args.codecs), criterion=args.criterion,
                            partitions=args.partitions)  # fmt: skip
    plan = plan_run(args.run, args.device_profile, args.server_profile, link, args.deadline_ms, settings)
    doc = plan.to_dict()
    if not args.frontier and not args.json:
        doc.pop("frontier")
    if args.json:
        return print_json(doc)
    o = plan.option
    verdict = "fits" if plan.fits else "does NOT fit"
    print(f"{o.name(plan.num_steps)}: accuracy {100 * o.accuracy:.2f}% (validation), p{100 * plan.quantile:g} "
          f"{o.latency_ms:.3f} ms {verdict} {plan.deadline_ms:g} ms; {100 * o.device_share:.1f}% answered on the "
          f"device, {o.bytes_per_request:.0f} bytes per request; thresholds {list(o.thresholds)}")  # fmt: skip
    if plan.note:
        print(plan.note)
    if args.frontier:
        for f in plan.frontier:
            print(f"  {f.latency_ms:9.3f} ms  {100 * f.accuracy:6.2f}%  {f.name(plan.num_steps)}")
    return 0
