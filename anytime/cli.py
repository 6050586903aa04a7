"""``anytime <command>``: the only module that parses arguments and prints."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from anytime.commands.options import (
    DEVICE_HELP,
    FIGURE_SIZE_HELP,
    THREADS_HELP,
    add_split_plan,
    finite_float,
    int_at_least,
    non_negative_int,
    positive_int,
    threads,
)
from anytime.commands.output import print_json, print_policy_figures, progress_printer
from anytime.errors import AnytimeError, PeerStopped
from anytime.utils.figure_sizes import FIGURE_SIZES

COMMANDS: dict[str, str] = {
    "models": "list the model zoo and torchvision classifiers, with parameter counts",
    "train": "train a model (or a model card), plain or with early exits; record time, memory and accuracy",
    "exits": "show the exits attach_exits puts on a model, with cumulative FLOPs and parameters",
    "collect": "run a trained multi-exit model once over a split and cache every exit's logits",
    "sweep": "sweep exit thresholds over the cached outputs: accuracy, FLOPs, exit shares, Pareto front",
    "calibrate": "fit exit thresholds on validation for an accuracy drop or a FLOPs budget (RUN/calibration.json)",
    "evaluate": "real early exit on a split: accuracy, exit shares, latency per sample vs the plain backbone",
    "plot": "plot a multi-exit run: accuracy vs cost, vs threshold, exit histogram, per-exit accuracy, deadlines",
    "cam": "class activation maps of every step (CAM for global-pooled heads, Grad-CAM otherwise) for the same images: "
    "a figure side by side and the arrays",
    "ponder": "maps of the residual units a SACT run spends at every position of an image, at each halting threshold",
    "profile": "measure every step's latency (p50/p90/p99), FLOPs and memory on this device, or compare two profiles",
    "schedule": "the most accurate step or early-exit policy that meets a deadline on a profiled device (JSON)",
    "cut": "cut residual links or skip blocks of a trained ResNet: accuracy and latency (CSV, plots), or a ladder run",
    "quantize": "a run's steps at another precision (int8, int8-dynamic, bf16, fp16), as a run the pipeline takes",
    "export": "deployable artifacts of a run's steps (torch.export .pt2 or ONNX), a manifest and the parity table",
    "ensemble": "an ensemble of trained runs (any architecture, any precision) fused after each member, as a run",
    "ensemble-baseline": "torchensemble's fusion, voting, bagging, gradient boosting or snapshot ensemble, as a run",
    "ticket": "lottery tickets by iterative magnitude pruning of a dense run, rewound to its epoch K (late "
    "resetting): one ordinary run per round",
    "seeds": "several seeds of one recipe: every step's validation and test accuracy as mean, spread and range",
    "jobs": "a sweep of training runs (a grid or a list in TOML) on local joblib workers or SLURM job arrays "
    "(submitit): resumable, one run folder per job, results table and plot",
    "report": "one self-contained HTML page of a run (RUN/report.html): recipe, curves, steps, calibration, latency",
    "serve": "serve a run over HTTP: POST /predict answers within each request's deadline (queue time counted); "
    "--role server finishes split-computing requests over TCP",
    "split": "split computing: the partition point, codec and exit thresholds that answer most accurately within a "
    "deadline over a link, from the device's and the server's profiles (JSON)",
    "split-run": "the device's half of split computing: answer images, sending activations to a --role server over "
    "a shaped link, and measure end-to-end time, misses and accuracy",
    "experiment": "run a study from experiments/ (batch-time, memory, time-accuracy, residual-cutting, precision, "
    "ensemble-baselines, ensembles, lottery)",
    "demo": "the whole multi-exit pipeline on the embedded digits, and where training time goes (no files needed)",
    "prepare-data": "pack an image folder into shards of resized uint8 images (resumable, parallel) that training "
    "reads batch by batch (--data shards)",
}


def _experiments_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "experiments"


def _experiment_names() -> list[str]:
    folder = _experiments_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem.replace("_", "-") for p in folder.glob("*.py") if not p.name.startswith("_"))


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, like every other error, pointing at the command's help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help: appended where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default {action.default})"


def _module(verb: str) -> Any:
    return importlib.import_module("anytime.commands." + verb.replace("-", "_"))


def _add_command(sub: Any, verb: str) -> None:
    module = _module(verb)
    module.add_arguments(sub.add_parser(verb, description=module.SUMMARY))


def _moved(verb: str) -> Callable[[argparse.Namespace], int]:
    return lambda args: _module(verb).run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (exposed for tests and documentation)."""
    parser = _Parser(
        prog="anytime",
        description="Anytime inference research in PyTorch: train, measure and schedule models on a device.",
        formatter_class=_Formatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<18} {text}" for name, text in COMMANDS.items())
        + "\n\nrun 'anytime COMMAND --help' for a command's options",
    )
    from anytime import __version__

    parser.add_argument("--version", action="version", version=f"anytime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands below")

    _add_command(sub, "models")

    _add_command(sub, "train")

    _add_command(sub, "exits")

    _add_command(sub, "collect")

    _add_command(sub, "sweep")

    _add_command(sub, "calibrate")

    _add_command(sub, "evaluate")

    _add_command(sub, "plot")

    _add_command(sub, "cam")

    _add_command(sub, "ponder")

    _add_command(sub, "profile")

    _add_command(sub, "schedule")

    _add_command(sub, "cut")

    _add_command(sub, "quantize")

    _add_command(sub, "export")

    _add_command(sub, "ensemble")

    _add_command(sub, "ensemble-baseline")

    _add_command(sub, "jobs")

    _add_command(sub, "ticket")

    _add_command(sub, "seeds")

    report = sub.add_parser("report", description=COMMANDS["report"])
    report.add_argument("run", metavar="RUN")
    report.add_argument("--out", metavar="FILE", help="default RUN/report.html (replaced)")
    report.add_argument("--json", action="store_true", help="print the page's path and missing sections as JSON")

    serve = sub.add_parser("serve", description=COMMANDS["serve"])
    serve.add_argument("run", metavar="RUN", help="a finished, profiled run (anytime profile RUN)")
    serve.add_argument(
        "--profile",
        metavar="FILE",
        help="default: the run's only profile-*.json (a text run: every length bucket it has)",
    )
    serve.add_argument(
        "--calibration", metavar="FILE", help="early-exit thresholds (default RUN/calibration.json when there is one)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int_at_least(0), default=8000, help="default 8000")
    serve.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="B",
        help="requests answered together when several are queued (default: the largest profiled batch size, up to 8)",
    )
    serve.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="server processes, each with its own model and queue (default 1)",
    )
    serve.add_argument(
        "--threads",
        type=threads,
        metavar="N|auto",
        help="torch CPU threads per process (default: the profile's; with --workers, cores / workers; "
        + THREADS_HELP
        + ")",
    )
    serve.add_argument("--device", default="auto", help=DEVICE_HELP)
    serve.add_argument(
        "--quantile",
        type=finite_float,
        default=0.99,
        metavar="Q",
        help="the latency quantile a step must fit at before it starts (default 0.99)",
    )
    serve.add_argument(
        "--max-body-kb",
        type=positive_int,
        default=1024,
        metavar="KB",
        help="larger request bodies are refused with 413 (default 1024)",
    )
    serve.add_argument(
        "--role",
        choices=["http", "server"],
        default="http",
        help="http: POST /predict (default); server: split computing's server, finishing the "
        "activations an `anytime split-run` device sends over TCP",
    )

    split = sub.add_parser("split", description=COMMANDS["split"])
    split.add_argument("run", metavar="RUN", help="a run with exits (or an ensemble), validation outputs collected")
    add_split_plan(split)
    split.add_argument("--frontier", action="store_true", help="print every frontier option too")

    split_run = sub.add_parser("split-run", description=COMMANDS["split-run"])
    split_run.add_argument("run", metavar="RUN")
    split_run.add_argument("--server", required=True, metavar="HOST:PORT", help="an `anytime serve RUN --role server`")
    add_split_plan(split_run)
    split_run.add_argument(
        "--split",
        dest="data_split",
        choices=["val", "test"],
        default="test",
        help="images answered, in the split's order (default test)",
    )
    split_run.add_argument(
        "--requests", type=positive_int, default=200, metavar="N", help="images answered (default 200)"
    )
    split_run.add_argument(
        "--shape-bandwidth",
        metavar="MBPS[:N],...",
        help="pace the link at these Mbit/s, each for N requests (e.g. 100:100,1:100); default: "
        "--bandwidth-mbps for every request",
    )
    split_run.add_argument(
        "--shape-delay-ms", type=finite_float, metavar="MS", help="round trip added on the link (default: --rtt-ms)"
    )
    split_run.add_argument(
        "--emulate-slowdown",
        type=finite_float,
        default=1.0,
        metavar="F",
        help="the device is a board F times slower than this machine; its profile must be measured "
        "with the same factor (anytime profile --emulate-slowdown F)",
    )
    split_run.add_argument(
        "--fixed", action="store_true", help="keep the first plan: do not follow the bandwidth the device measures"
    )
    split_run.add_argument(
        "--timeout-ms",
        type=finite_float,
        default=2000.0,
        metavar="MS",
        help="a server that has not answered by then is given up on: the device answers itself (default 2000)",
    )
    split_run.add_argument(
        "--threads", type=threads, default=1, metavar="N|auto", help="torch CPU threads of the device (default 1)"
    )
    split_run.add_argument(
        "--link-samples",
        type=non_negative_int,
        default=100,
        metavar="N",
        help="exchanges with the server that measure the link (bandwidth, and the overhead per "
        "exchange at the quantile) before the first plan (default 100; 0: plan with "
        "--bandwidth-mbps, --rtt-ms and --overhead-ms as given)",
    )
    split_run.add_argument("--out", metavar="FILE", help="also write every answer and the summary as JSON here")

    experiment = sub.add_parser("experiment", description=COMMANDS["experiment"])
    experiment.add_argument("name", metavar="NAME", help="one of: " + ", ".join(_experiment_names()))
    experiment.add_argument("--quick", action="store_true", help="a few minutes on a laptop-class CPU")
    experiment.add_argument("--out", metavar="DIR", help="results folder (default results/NAME)")
    experiment.add_argument("--overwrite", action="store_true", help="replace the study's earlier results in --out")
    experiment.add_argument(
        "--drop-caches",
        action="store_true",
        help="studies that read from disk (batch-time, memory, time-accuracy): drop the OS page "
        "cache first (root; it affects the whole machine)",
    )
    experiment.add_argument("--device", help="studies that time a device (precision): cpu (default) or cuda[:N]")
    experiment.add_argument("--figure-size", default="screen", choices=list(FIGURE_SIZES),
                            help=FIGURE_SIZE_HELP + " (default screen)")  # fmt: skip
    experiment.add_argument(
        "--json", action="store_true", help="print the study's results.json (its progress goes to stderr)"
    )

    demo = sub.add_parser("demo", description=COMMANDS["demo"])
    demo.add_argument("--out", metavar="DIR", help="results folder (default runs/demo)")
    demo.add_argument("--overwrite", action="store_true", help="replace an earlier demo's results in --out")
    demo.add_argument("--json", action="store_true", help="print the demo's demo.json (what the summary shows)")

    prepare = sub.add_parser("prepare-data", description=COMMANDS["prepare-data"])
    prepare.add_argument("src", metavar="SRC", help="an image folder holding train/<class>/* and test/<class>/*")
    prepare.add_argument(
        "--image-size",
        type=positive_int,
        required=True,
        metavar="S",
        help="every image is resized to SxS (PIL bilinear)",
    )
    prepare.add_argument(
        "--out",
        required=True,
        metavar="SHARDS",
        help="the shard folder (new, empty, or an unfinished one of the same arguments to resume)",
    )
    prepare.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="processes decoding shards in parallel (default: the cores, at most 8)",
    )
    prepare.add_argument(
        "--shard-size", type=positive_int, metavar="N", help="images per shard (default: as many as fill 64 MiB)"
    )
    prepare.add_argument(
        "--verify", action="store_true", help="also check the finished shards' checksums and rewrite those that differ"
    )
    prepare.add_argument("--json", action="store_true", help="print the manifest as JSON")
    for command in sub.choices.values():
        command.formatter_class = _Formatter
        for action in command._actions:  # argparse offers no public list; an option without help shows no default
            if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                action.help = f"default {action.default}"
    return parser


def _cmd_experiment(args: argparse.Namespace) -> int:
    names = _experiment_names()
    if args.name not in names:
        where = _experiments_dir()
        hint = (
            f"one of: {', '.join(names)}" if names else f"no experiments found in {where} (run from a source checkout)"
        )
        raise AnytimeError(f"unknown experiment '{args.name}'; {hint}")
    path = _experiments_dir() / f"{args.name.replace('-', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"anytime_experiment_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [flag for flag, on in (("--quick", args.quick), ("--overwrite", args.overwrite),
                                  ("--drop-caches", args.drop_caches)) if on]  # fmt: skip
    if args.out:
        argv += ["--out", args.out]
    if args.device is not None:
        if not getattr(module, "TAKES_DEVICE", False):
            raise AnytimeError(f"the {args.name} study runs on the CPU only; drop --device")
        argv += ["--device", args.device]
    entry: Callable[[list[str]], int] = module.main
    with contextlib.ExitStack() as scope:
        if args.figure_size != "screen":
            from anytime.plotting import figure_size

            scope.enter_context(figure_size(args.figure_size))
        if not args.json:
            return int(entry(argv) or 0)
        with contextlib.redirect_stdout(sys.stderr):  # the study's progress lines: stdout carries the JSON
            code = int(entry(argv) or 0)
    results = Path(args.out) if args.out else Path("results") / args.name
    if code == 0:
        print((results / "results.json").read_text())
    return code


def _cmd_demo(args: argparse.Namespace) -> int:
    from anytime.tasks.demo import DEMO_CONFIG, DEMO_REQUESTS, run_demo
    from anytime.tasks.promises import promise_lines
    from anytime.utils.outputs import check_replaceable

    out = Path(args.out) if args.out else Path("runs") / "demo"
    check_replaceable(out, "demo", overwrite=args.overwrite, create_parents=args.out is None)
    print(f"demo: training {DEMO_CONFIG.model} on the embedded digits for {DEMO_CONFIG.epochs} epochs...",
          file=sys.stderr)  # fmt: skip
    result = run_demo(out, progress=sys.stderr.isatty(), overwrite=args.overwrite, create_parents=args.out is None)
    if args.json:
        print((result.out_dir / "demo.json").read_text())
        return 0
    final = result.summary["final"]
    print(f"test accuracy {100 * final['test_acc']:.2f}% (validation {100 * final['val_acc']:.2f}%) "
          f"in {result.summary['train_time_s']:.1f} s of training")  # fmt: skip
    for e in result.summary["exits"]:
        print(f"  exit {e['index']} after {e['name']:<11} {100 * e['flops'] / result.summary['backbone_flops']:5.1f}% "
              f"of the FLOPs: test {100 * e['test_acc']:.2f}%")  # fmt: skip
    cal, ev = result.calibration, result.evaluation
    print(f"calibrated on validation for at most {cal['target']['max_drop_points']:g} point below the last exit "
          f"({cal['policy']['criterion']} thresholds {[None if t is None else round(t, 3) for t in cal['policy']['thresholds']]}):")  # fmt: skip
    print_policy_figures("  validation", cal["validation"])
    print_policy_figures("  test", cal["test"])
    lat = ev["latency"]
    print(f"real early exit on the test split: {100 * ev['accuracy']:.2f}%, {lat['speedup']:.2f}x faster per sample "
          f"at batch 1 than the plain backbone ({lat['early_exit']['mean_ms']:.2f} vs {lat['backbone']['mean_ms']:.2f} ms)")  # fmt: skip
    print(f"deadlines at batch 1: the runtime's promise and what it delivered to {DEMO_REQUESTS} test images one at a "
          "time (Poisson arrivals):")  # fmt: skip
    for line in promise_lines(result.deadlines):
        print(f"  {line}")
    print("time per training mini-batch (median):")
    for row in result.batch_time:
        print(f"  batch {int(row['batch_size']):>4}: {1000 * row['total_p50_s']:7.1f} ms "
              f"(forward {1000 * row['forward_p50_s']:.1f}, backward {1000 * row['backward_p50_s']:.1f}, "
              f"step {1000 * row['step_p50_s']:.1f}) = {row['images_per_s']:.0f} images/s")  # fmt: skip
    print(f"results and plots in {result.out_dir}/:")
    for path in result.files:
        print(f"  {path}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from anytime.tasks.report import write_report

    result = write_report(args.run, args.out)
    if args.json:
        print(json.dumps({"report": str(result.path), "missing": list(result.missing)}, indent=2))
        return 0
    print(f"report {result.path}")
    for line in result.missing:
        print(f"missing {line}")
    return 0


def _cmd_split(args: argparse.Namespace) -> int:
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link
    from anytime.split.runs import plan_run

    link = Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms)
    plan = plan_run(args.run, args.device_profile, args.server_profile, link, args.deadline_ms, quantile=args.quantile,
                    codecs=parse_codecs(args.codecs), criterion=args.criterion, partitions=args.partitions)  # fmt: skip
    doc = plan.to_dict()
    if not args.frontier and not args.json:
        doc.pop("frontier")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
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


def _cmd_split_run(args: argparse.Namespace) -> int:
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link
    from anytime.split.session import parse_bandwidth_schedule, run_split_session

    schedule = parse_bandwidth_schedule(args.shape_bandwidth, args.bandwidth_mbps, args.requests)
    host, _, port = args.server.rpartition(":")
    if not host or not port.isdigit():
        raise AnytimeError(f"--server {args.server!r} is not HOST:PORT (e.g. 127.0.0.1:9000)")
    result = run_split_session(
        args.run, host=host, port=int(port), device_profile=args.device_profile, server_profile=args.server_profile,
        link=Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms), deadline_ms=args.deadline_ms,
        quantile=args.quantile, codecs=parse_codecs(args.codecs), criterion=args.criterion, partitions=args.partitions,
        split=args.data_split, requests=args.requests, schedule=schedule, delay_ms=args.rtt_ms if args.shape_delay_ms is None else args.shape_delay_ms,
        slowdown=args.emulate_slowdown, adapt=not args.fixed, timeout_ms=args.timeout_ms, threads=args.threads,
        link_samples=args.link_samples, out=args.out,
    )  # fmt: skip
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for line in result.notes():
        print(line)
    print(f"{summary['requests']} requests: accuracy {100 * summary['accuracy']:.2f}%, p50 {summary['p50_ms']:.3f} ms, "
          f"p99 {summary['p99_ms']:.3f} ms (planned p{100 * args.quantile:g} {summary['planned_ms']:.3f} ms), "
          f"misses {100 * summary['miss_rate']:.2f}% of {args.deadline_ms:g} ms; answered on the device "
          f"{100 * summary['device_share']:.1f}%, by the server {100 * summary['server_share']:.1f}%, "
          f"fallback {100 * summary['fallback_share']:.1f}%")  # fmt: skip
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from anytime.serve.http import ServeOptions, serve

    if args.role == "server":
        from anytime.split.session import serve_split

        http_only = [flag for flag, value in (("--profile", args.profile), ("--calibration", args.calibration),
                                              ("--max-batch", args.max_batch), ("--workers", args.workers != 1))
                     if value]  # fmt: skip
        if http_only:
            raise AnytimeError(f"{', '.join(http_only)} apply to the HTTP server; --role server takes the device's "
                               "plan with each request (drop them)")  # fmt: skip

        serve_split(args.run, host=args.host, port=args.port, threads=args.threads, device=args.device,
                    max_payload_kb=args.max_body_kb,
                    on_ready=lambda address: print(f"split server for {args.run} on {address} (Ctrl-C stops)",
                                                   file=sys.stderr, flush=True))  # fmt: skip
        return 0

    options = ServeOptions(run=args.run, profile=args.profile, calibration=args.calibration, max_batch=args.max_batch,
                           max_body_kb=args.max_body_kb, quantile=args.quantile, threads=args.threads,
                           device=args.device)  # fmt: skip
    try:
        serve(options, host=args.host, port=args.port, workers=args.workers,
              on_ready=lambda url: print(f"serving {args.run} on {url} (POST /predict, GET /schedule, /healthz, "
                                         "/metrics; Ctrl-C stops)", file=sys.stderr, flush=True))  # fmt: skip
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from anytime.data.shards import prepare_shards
    from anytime.utils.resources import format_bytes

    result = prepare_shards(args.src, args.out, image_size=args.image_size, workers=args.workers,
                            shard_size=args.shard_size, verify=args.verify, on_progress=progress_printer(args))  # fmt: skip
    m = result.manifest
    if args.json:
        return print_json({**m.to_dict(), "root": str(m.root), "written": result.written, "reused": result.reused})
    shards = len(m.train.shards) + len(m.test.shards)
    size = sum(s.bytes for s in m.train.shards + m.test.shards)
    print(f"shards {m.root}: {m.train.count:,} train + {m.test.count:,} test images at {m.image_size}x{m.image_size}, "
          f"{len(m.classes)} classes, {shards} shards ({format_bytes(size)}); {result.written} written, "
          f"{result.reused} already done, {result.seconds:.1f} s")  # fmt: skip
    print(f"next: anytime train --data shards --data-root {m.root}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": _moved("models"), "train": _moved("train"), "exits": _moved("exits"), "collect": _moved("collect"), "sweep": _moved("sweep"),
    "calibrate": _moved("calibrate"), "evaluate": _moved("evaluate"), "plot": _moved("plot"), "cam": _moved("cam"), "ponder": _moved("ponder"), "profile": _moved("profile"),
    "schedule": _moved("schedule"), "cut": _moved("cut"), "quantize": _moved("quantize"), "export": _moved("export"),
    "ensemble": _moved("ensemble"), "ensemble-baseline": _moved("ensemble-baseline"),
    "seeds": _moved("seeds"),
    "jobs": _moved("jobs"),
    "ticket": _moved("ticket"),
    "report": _cmd_report,
    "serve": _cmd_serve,
    "split": _cmd_split,
    "split-run": _cmd_split_run,
    "experiment": _cmd_experiment,
    "demo": _cmd_demo,
    "prepare-data": _cmd_prepare_data,
}  # fmt: skip


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds the stack, so temporary files and staged folders are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(owner: int, signum: int, _frame: Any) -> None:
    if os.getpid() != owner:  # a forked worker (a decoding pool, a DataLoader) inherited this: end as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise _Terminated(signum)


def _catch_termination() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    handler = functools.partial(_terminate, os.getpid())
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _quiet_broken_pipe() -> int:
    """The reader of our output went away (``anytime ... | head``): stop without a word, as ``cat`` does."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _other_process() -> bool:
    """Whether this is one of several data-parallel processes but not process 0."""
    return "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anytime`` command; returns the exit status (a data-parallel training process ends
    itself with it instead, see :func:`anytime.train.distributed.end_process`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    status = _run_command(args)
    distributed = sys.modules.get("anytime.train.distributed")
    if distributed is not None and distributed.joined_a_group():
        distributed.end_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status, having said why on stderr where it failed."""
    previous = _catch_termination()
    try:
        status = HANDLERS[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except AnytimeError as exc:
        if not isinstance(exc, PeerStopped):  # process 0 has said why
            where = f" (process {os.environ.get('RANK')})" if _other_process() else ""
            print(f"anytime {args.command}: error{where}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        from anytime.utils.tempnames import user_path

        where = f" ({user_path(exc.filename)})" if exc.filename else ""
        print(f"anytime {args.command}: error: {exc.strerror or exc}{where}; check the path and its permissions",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except _Terminated as exc:
        if not _other_process():
            print(f"\nstopped by signal {exc.signum}; nothing partial was kept", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
