"""``anytime serve``: serve a profiled run over HTTP, POST /predict answering within each request's deadline (the
time it queued counted); or ``--role server``: finish split-computing requests that devices send over TCP."""

from __future__ import annotations

import argparse
import sys

from anytime.commands.options import (
    THREADS_HELP,
    add_calibration,
    add_device,
    add_profile,
    add_threads,
    finite_float,
    int_at_least,
    positive_int,
)
from anytime.errors import AnytimeError
from anytime.serve.cooperate import DEFAULT_EVERY_MS

SUMMARY = (
    "serve a run over HTTP: POST /predict answers within each request's deadline (queue time counted); "
    "--role server finishes split-computing requests over TCP"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime serve``."""
    parser.add_argument("run", metavar="RUN", help="a finished, profiled run (anytime profile RUN)")
    add_profile(parser, "default: the run's only profile-*.json (a text run: every length bucket it has)")
    add_calibration(parser, "early-exit thresholds (default RUN/calibration.json when there is one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int_at_least(0), default=8000, help="default 8000")
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="B",
        help="requests answered together when several are queued (default: the largest profiled batch size, up to 8)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="server processes, each with its own model and queue (default 1)",
    )
    add_threads(
        parser,
        "torch CPU threads per process (default: the profile's; with --workers, cores / workers; " + THREADS_HELP + ")",
    )
    add_device(parser)
    parser.add_argument(
        "--quantile",
        type=finite_float,
        default=0.99,
        metavar="Q",
        help="the latency quantile a step must fit at before it starts (default 0.99)",
    )
    parser.add_argument(
        "--yield-ms",
        type=finite_float,
        default=DEFAULT_EVERY_MS,
        metavar="MS",
        help="the answering thread lets the HTTP loop run at the next block boundary whenever this much time has "
        "passed since it last did, so that a request arriving mid-answer is read and its clock started "
        "(default 0.5; 0: never)",
    )
    parser.add_argument(
        "--max-body-kb",
        type=positive_int,
        default=1024,
        metavar="KB",
        help="larger request bodies are refused with 413 (default 1024)",
    )
    parser.add_argument(
        "--role",
        choices=["http", "server"],
        default="http",
        help="http: POST /predict (default); server: split computing's server, finishing the "
        "activations an `anytime split-run` device sends over TCP",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until stopped (Ctrl-C): the HTTP server, or split computing's server."""
    from anytime.serve.http import ServeOptions, serve

    if args.role == "server":
        return _serve_split(args)
    options = ServeOptions(run=args.run, profile=args.profile, calibration=args.calibration, max_batch=args.max_batch,
                           max_body_kb=args.max_body_kb, quantile=args.quantile, threads=args.threads,
                           device=args.device, yield_ms=args.yield_ms)  # fmt: skip
    try:
        serve(options, host=args.host, port=args.port, workers=args.workers,
              on_ready=lambda url: print(f"serving {args.run} on {url} (POST /predict, GET /schedule, /healthz, "
                                         "/metrics; Ctrl-C stops)", file=sys.stderr, flush=True))  # fmt: skip
    except KeyboardInterrupt:
        pass
    return 0


def _serve_split(args: argparse.Namespace) -> int:
    from anytime.split.session import serve_split

    http_only = [flag for flag, value in (("--profile", args.profile), ("--calibration", args.calibration),
                                          ("--max-batch", args.max_batch), ("--workers", args.workers != 1),
                                          ("--yield-ms", args.yield_ms != DEFAULT_EVERY_MS))
                 if value]  # fmt: skip
    if http_only:
        raise AnytimeError(f"{', '.join(http_only)} apply to the HTTP server; --role server takes the device's "
                           "plan with each request (drop them)")  # fmt: skip
    serve_split(args.run, host=args.host, port=args.port, threads=args.threads, device=args.device,
                max_payload_kb=args.max_body_kb,
                on_ready=lambda address: print(f"split server for {args.run} on {address} (Ctrl-C stops)",
                                               file=sys.stderr, flush=True))  # fmt: skip
    return 0
