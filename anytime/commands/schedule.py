"""``anytime schedule``: the most accurate step or early-exit policy of a profiled run that meets a deadline on
this device (JSON), across precisions too; or ``--check``: replay requests and hold the runtime to its promises.

The query path reads profiles with numpy only: an answer costs well under a second, torch never loads."""

from __future__ import annotations

import argparse
import math

from anytime.commands.options import add_batch_size, add_json, add_profile, add_split, positive_int
from anytime.commands.output import print_json
from anytime.errors import AnytimeError
from anytime.train.records import precision_record

SUMMARY = "the most accurate step or early-exit policy that meets a deadline on a profiled device (JSON)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime schedule``: the query, then those of --check."""
    parser.add_argument("run", metavar="RUN")
    parser.add_argument(
        "--deadline-ms", type=float, metavar="D", help="the time budget of one request (required, unless --check)"
    )
    parser.add_argument(
        "--quantile", type=float, default=0.99, metavar="Q", help="the latency quantile that must fit (default 0.99)"
    )
    add_batch_size(parser, default=1, help="a profiled batch size")
    add_profile(parser, "default: the run's only profile-*.json")
    parser.add_argument(
        "--length",
        type=positive_int,
        metavar="TOKENS",
        help="text runs: the request's tokens; the profile of the shortest profiled length that "
        "holds it is used (profile each bucket with `anytime profile RUN --length T`)",
    )
    parser.add_argument(
        "--energy-mj",
        type=float,
        metavar="E",
        help="an energy budget: the mean millijoules per inference must fit too (a profile measured with --energy)",
    )
    parser.add_argument(
        "--with",
        dest="variants",
        metavar="RUN2[,RUN3]",
        help="runs of the same model at other precisions (anytime quantize) or its structured tickets "
        "(anytime ticket --unit channels), each with its own profile on this device: one "
        "frontier over (step, variant)",
    )
    _add_check(parser)


def _add_check(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime schedule --check``."""
    parser.add_argument(
        "--check",
        action="store_true",
        help="hold the runtime to its promises: replay test inputs one at a time at a set of deadlines "
        "(--deadlines), print promise and delivery side by side, exit 1 where a promise broke",
    )
    parser.add_argument(
        "--deadlines",
        metavar="D,D,...",
        help="with --check: the deadlines in ms (default 20, log-spaced from half the cheapest "
        "option's price to 1.5x the dearest)",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=300,
        metavar="N",
        help="with --check: inputs replayed at each deadline (default 300)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="with --check: mean idle gap between requests, exponential as Poisson arrivals (default 5)",
    )
    add_split(parser, ("val", "test"), default="test", help="with --check: the inputs' split")
    parser.add_argument(
        "--accuracy-tolerance",
        type=float,
        default=1.0,
        metavar="POINTS",
        help="with --check: how far below the promised accuracy delivery may fall (default 1 point)",
    )
    add_json(parser, "with --check: the check as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the scheduler's answer for the deadline as JSON (or check the run's promises)."""
    from anytime.scheduler.deadline import check_energy_budget
    from anytime.scheduler.query import schedule_answer, scheduler_for_run

    if args.check:
        return _check(args)
    if args.deadline_ms is None:
        raise AnytimeError("give --deadline-ms D (the time budget of one request), or --check")
    if not math.isfinite(args.deadline_ms):
        raise AnytimeError(f"deadline {args.deadline_ms} ms is not a finite positive number of milliseconds")
    if args.energy_mj is not None:
        check_energy_budget(args.energy_mj)
    if args.variants:
        return _variants(args)
    scheduler, path = scheduler_for_run(args.run, args.profile, length=args.length)
    answer = schedule_answer(
        scheduler, path, args.deadline_ms, args.quantile, args.batch_size, energy_mj=args.energy_mj
    )
    return print_json(answer)


def _check(args: argparse.Namespace) -> int:
    from anytime.scheduler.deadline import check_deadline
    from anytime.tasks.promises import PromiseSettings, check_promises, promise_lines

    for flag in ("deadline_ms", "variants", "energy_mj", "length", "profile"):
        if getattr(args, flag) is not None:
            raise AnytimeError(f"--check replays the run's own profile at its own deadlines; drop "
                               f"--{flag.replace('_', '-')} (give the deadlines with --deadlines)")  # fmt: skip
    if args.batch_size != 1:
        raise AnytimeError("--check replays requests one at a time; drop --batch-size")
    deadlines: tuple[float, ...] | None = None
    if args.deadlines:
        try:
            deadlines = tuple(check_deadline(float(v)) for v in args.deadlines.split(",") if v.strip())
        except ValueError:
            raise AnytimeError(
                f"--deadlines '{args.deadlines}' is not a comma-separated list of milliseconds"
            ) from None
        if not deadlines or not all(math.isfinite(d) for d in deadlines):
            raise AnytimeError(f"--deadlines '{args.deadlines}' holds no finite positive deadline")
    check = check_promises(args.run, PromiseSettings(deadlines=deadlines, count=args.requests, split=args.split,
                                                     quantile=args.quantile, gap_ms=args.gap_ms,
                                                     accuracy_tolerance=args.accuracy_tolerance / 100))  # fmt: skip
    if args.json:
        print_json(check.to_dict())
    else:
        for line in promise_lines(check):
            print(line)
        broken = len(check.broken)
        print(f"{len(check.rows) - broken} of {len(check.rows)} deadlines kept their promise"
              + (f"; {broken} broken" if broken else ""))  # fmt: skip
    return 1 if check.broken else 0


def _variants(args: argparse.Namespace) -> int:
    from anytime.scheduler.query import precision_scheduler

    runs = [args.run, *(r for r in args.variants.split(",") if r)]
    scheduler, runs_of = precision_scheduler(runs, args.profile)
    choice = scheduler.select(args.deadline_ms, args.quantile, args.batch_size, energy_mj=args.energy_mj)
    frontier = [{"option": o.name, "run": str(runs_of[scheduler.variant_of(o.name)]), "kind": o.kind,
                 "accuracy": o.accuracy, "latency_ms": latency, **({} if energy is None else {"energy_mj": energy})}
                for o, latency, energy in scheduler.frontier_points(args.quantile, args.batch_size,
                                                                    energy=args.energy_mj is not None)]  # fmt: skip
    variant = scheduler.variant_of(choice.option)
    record = precision_record(runs_of[variant])
    precision = record["precision"] if record is not None else "fp32"
    return print_json({**choice.to_dict(), "precision": precision, "variant": variant, "run": str(runs_of[variant]),
                       "frontier": frontier})  # fmt: skip
