"""``anytime evaluate``: real early exit on a split, with the calibrated thresholds: accuracy, exit shares and the
latency per sample against the plain backbone (or an export's segments)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from anytime.commands.options import add_calibration, add_device, add_form, add_json, add_split, non_negative_int
from anytime.commands.output import print_json

SUMMARY = "real early exit on a split: accuracy, exit shares, latency per sample vs the plain backbone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime evaluate``."""
    parser.add_argument("run", metavar="RUN")
    add_calibration(parser, "default RUN/calibration.json")
    add_split(parser, ("val", "test", "dev"), default="test")
    add_device(parser)
    parser.add_argument(
        "--latency-samples",
        type=non_negative_int,
        default=1000,
        metavar="N",
        help="samples timed one by one against the plain backbone (default 1000; 0 skips)",
    )
    add_form(parser)
    parser.add_argument(
        "--export",
        metavar="DIR",
        help="an export of RUN (anytime export): early exit as deployed, on the CPU (ONNX: the policy compiled into "
        "its graphs where it can be), timed against the export's segments run in turn; written to "
        "DIR/evaluation-SPLIT.json",
    )
    add_json(parser, "print the whole report as JSON")


def run(args: argparse.Namespace) -> int:
    """Evaluate and print accuracy, exit shares and latency."""
    from anytime.tasks.evaluation import EvaluationSettings, evaluate_run

    report = evaluate_run(
        args.run,
        EvaluationSettings(split=args.split, latency_samples=args.latency_samples, form=args.form),
        calibration=args.calibration,
        device=args.device,
        progress=sys.stderr.isatty(),
        export=args.export,
    )
    if args.json:
        return print_json(report.to_dict())
    shares = " ".join(f"{100 * s:.1f}" for s in report.exit_share)
    if args.export:
        compiled = "the policy compiled into its graphs" if report.compiled_policy else "the policy in PyTorch"
        print(f"{args.export} ({report.form.removeprefix('export: ')}), {compiled}")
    print(f"real early exit on {report.samples} {args.split} samples: accuracy {100 * report.accuracy:.2f}%, "
          f"FLOPs {report.flops_ratio:.3f}x of the backbone, exits % [{shares}]")  # fmt: skip
    if report.agreement_with_cache is not None:
        a = report.agreement_with_cache
        print(f"agreement with the cached sweep: exits {100 * a.exits:.2f}%, predictions {100 * a.predictions:.2f}%")
    if report.latency is not None:
        lat = report.latency
        e, b = lat.early_exit, lat.backbone
        print(f"latency per sample at batch 1 ({e.count} samples, {report.torch_threads} threads, "
              f"{report.device}):")  # fmt: skip
        print(f"  early exit {e.mean_ms:.3f} ms mean, p50 {e.p50_ms:.3f}, p99 {e.p99_ms:.3f}")
        backbone = "segments " if args.export else "backbone "  # an export's plain network is its segments in turn
        print(f"  {backbone}  {b.mean_ms:.3f} ms mean, p50 {b.p50_ms:.3f}, p99 {b.p99_ms:.3f}")
        paired, rounds = lat.paired, ""
        if paired is not None:
            interval = f", 95% interval {paired.low:.2f}x to {paired.high:.2f}x" if paired.rounds >= 6 else ""
            rounds = f"; paired, turn by turn: median {paired.median:.2f}x{interval} over {paired.rounds} rounds"
        print(f"  speed-up   {lat.speedup:.2f}x (mean latency){rounds}")
    print(f"saved to {Path(args.export or args.run) / f'evaluation-{args.split}.json'}")
    return 0
