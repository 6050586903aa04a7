"""``anytime split-run``: the device's half of split computing: answer images, sending activations to an
``anytime serve --role server`` over a shaped link, and measure end-to-end time, deadline misses and accuracy."""

from __future__ import annotations

import argparse

from anytime.commands.options import (
    add_emulate_slowdown,
    add_out,
    add_split,
    add_split_plan,
    add_threads,
    finite_float,
    non_negative_int,
    positive_int,
)
from anytime.commands.output import print_json
from anytime.errors import AnytimeError

SUMMARY = (
    "the device's half of split computing: answer images, sending activations to a --role server over "
    "a shaped link, and measure end-to-end time, misses and accuracy"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime split-run``: the plan's, then the session's."""
    parser.add_argument("run", metavar="RUN")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="an `anytime serve RUN --role server`")
    add_split_plan(parser)
    add_split(
        parser,
        ("val", "test"),
        default="test",
        help="images answered, in the split's order (default test)",
        dest="data_split",
    )
    parser.add_argument("--requests", type=positive_int, default=200, metavar="N", help="images answered (default 200)")
    parser.add_argument(
        "--shape-bandwidth",
        metavar="MBPS[:N],...",
        help="pace the link at these Mbit/s, each for N requests (e.g. 100:100,1:100); default: "
        "--bandwidth-mbps for every request",
    )
    parser.add_argument(
        "--shape-delay-ms", type=finite_float, metavar="MS", help="round trip added on the link (default: --rtt-ms)"
    )
    add_emulate_slowdown(
        parser,
        "the device is a board F times slower than this machine; its profile must be measured "
        "with the same factor (anytime profile --emulate-slowdown F)",
    )
    parser.add_argument(
        "--fixed", action="store_true", help="keep the first plan: do not follow the bandwidth the device measures"
    )
    parser.add_argument(
        "--timeout-ms",
        type=finite_float,
        default=2000.0,
        metavar="MS",
        help="a server that has not answered by then is given up on: the device answers itself (default 2000)",
    )
    add_threads(parser, "torch CPU threads of the device (default 1)", default=1)
    parser.add_argument(
        "--link-samples",
        type=non_negative_int,
        default=100,
        metavar="N",
        help="exchanges with the server that measure the link (bandwidth, and the overhead per "
        "exchange at the quantile) before the first plan (default 100; 0: plan with "
        "--bandwidth-mbps, --rtt-ms and --overhead-ms as given)",
    )
    add_out(parser, "also write every answer and the summary as JSON here", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    """Run the session against the server and print what it measured."""
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link, PlanSettings
    from anytime.split.session import SessionSettings, parse_bandwidth_schedule, run_split_session

    schedule = parse_bandwidth_schedule(args.shape_bandwidth, args.bandwidth_mbps, args.requests)
    host, _, port = args.server.rpartition(":")
    if not host or not port.isdigit():
        raise AnytimeError(f"--server {args.server!r} is not HOST:PORT (e.g. 127.0.0.1:9000)")
    delay_ms = args.rtt_ms if args.shape_delay_ms is None else args.shape_delay_ms
    link = Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms)  # refused before the settings below are checked
    plan = PlanSettings(quantile=args.quantile, codecs=parse_codecs(args.codecs), criterion=args.criterion,
                        partitions=args.partitions)  # fmt: skip
    session = SessionSettings(
        host, int(port), args.deadline_ms, split=args.data_split, requests=args.requests, schedule=tuple(schedule),
        delay_ms=delay_ms, slowdown=args.emulate_slowdown, adapt=not args.fixed, timeout_ms=args.timeout_ms,
        threads=args.threads, link_samples=args.link_samples,
    )  # fmt: skip
    result = run_split_session(args.run, session, plan, device_profile=args.device_profile,
                               server_profile=args.server_profile, link=link, out=args.out)  # fmt: skip
    summary = result.summary()
    if args.json:
        return print_json(summary)
    for line in result.notes():
        print(line)
    print(f"{summary['requests']} requests: accuracy {100 * summary['accuracy']:.2f}%, p50 {summary['p50_ms']:.3f} ms, "
          f"p99 {summary['p99_ms']:.3f} ms (planned p{100 * args.quantile:g} {summary['planned_ms']:.3f} ms), "
          f"misses {100 * summary['miss_rate']:.2f}% of {args.deadline_ms:g} ms; answered on the device "
          f"{100 * summary['device_share']:.1f}%, by the server {100 * summary['server_share']:.1f}%, "
          f"fallback {100 * summary['fallback_share']:.1f}%")  # fmt: skip
    return 0
