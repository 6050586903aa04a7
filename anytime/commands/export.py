"""``anytime export``: deployable artifacts of a run's steps (torch.export programs or ONNX graphs), a manifest,
and a parity table against the eager model."""

from __future__ import annotations

import argparse
from typing import Any

from anytime.commands.options import (
    add_calibration_images,
    add_float_layers,
    add_json,
    add_out,
    add_overwrite,
    non_negative_int,
)
from anytime.commands.output import print_json, progress_printer

SUMMARY = "deployable artifacts of a run's steps (torch.export .pt2 or ONNX), a manifest and the parity table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime export``."""
    parser.add_argument("run", metavar="RUN", help="a finished run: float, or converted by 'anytime quantize'")
    parser.add_argument(
        "--format",
        required=True,
        choices=["pt2", "onnx"],
        help="pt2: torch.export programs (fp32, int8 PT2E, bf16, fp16); onnx: ONNX graphs for ONNX Runtime or "
        "TensorRT (fp32, int8 QDQ by ONNX Runtime's quantize_static; needs anytime[deploy])",
    )
    parser.add_argument(
        "--precision", choices=["fp32", "int8", "bf16", "fp16"], help="default: the run's own (fp32 for a float run)"
    )
    add_out(parser, "the export folder (new or empty)", required=True)
    add_calibration_images(parser, "int8 from a float run: training images that calibrate it (default 512)")
    add_float_layers(parser, "int8 from a float run (a quantized run keeps its own)", "artifact")
    parser.add_argument(
        "--parity-images",
        type=non_negative_int,
        default=1000,
        metavar="N",
        help="test images the parity table compares on (default 1000; 0: no table)",
    )
    add_overwrite(parser, "replace an earlier export in --out")
    add_json(parser, "print the manifest and the parity table as JSON")


def run(args: argparse.Namespace) -> int:
    """Export, then print the manifest's artifacts and the parity table."""
    from anytime.precision.tuning import Int8Settings
    from anytime.tasks.export import ParitySettings, export_run

    int8 = Int8Settings(calibration_images=args.calibration_images, float_layers=args.float_layers,
                        min_agreement=args.min_agreement, max_float_layers=args.max_float_layers,
                        agreement_images=args.agreement_images, min_size_ratio=args.min_size_ratio)  # fmt: skip
    parity = ParitySettings(images=args.parity_images)
    report = export_run(args.run, args.format, parity, int8, out=args.out, precision=args.precision,
                        overwrite=args.overwrite, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    manifest = report.manifest
    print(
        f"export {report.out}: {args.run} as {manifest.format} at {manifest.precision}, {len(manifest.parts)} "
        f"artifacts, {manifest.bytes / 1e6:.2f} MB" + (f" ({manifest.quantizer})" if manifest.quantizer else "")
    )
    if report.tuning is not None:
        tuning = report.tuning
        print(f"agreement with the float run on {tuning.images} validation images: lowest step "
              f"{100 * min(tuning.agreement):.2f}% (target {100 * tuning.target:.2f}%"
              f"{'' if tuning.met else ': not met'})")  # fmt: skip
        if tuning.max_float_weights is not None:
            print(f"weights kept in float: {tuning.float_weights:,} of the {tuning.max_float_weights:,} "
                  "--min-size-ratio allows")  # fmt: skip
    if manifest.float_layers:
        print(f"kept in float: {', '.join(manifest.float_layers)}")
    for part in manifest.parts:
        print(
            f"  {part.file:<16} {part.role:<8} step {part.step}  in {'x'.join(map(str, part.input_shape)):<10} "
            f"out {'x'.join(map(str, part.output_shape)):<10} {part.bytes / 1e6:8.3f} MB"
        )
    if report.parity:
        _print_parity(report)
    print(f"next: anytime profile {report.out}")
    return 0


def _print_parity(report: Any) -> None:
    parity = report.parity
    print(f"{'step':<5} {'dtype':<6} {'input':<10} {'max err':>9} {'top-1 agree':>12} {'eager ms':>9} "
          f"{'artifact ms':>12} {'eager img/s':>12} {'artifact img/s':>15}")  # fmt: skip
    for r in parity:
        print(f"{r.step:<5} {r.dtype:<6} {r.input_shape:<10} {r.max_abs_err:9.2e} {100 * r.top1_agreement:11.2f}% "
              f"{r.eager_p50_ms:9.3f} {r.artifact_p50_ms:12.3f} {r.eager_images_per_s:12.0f} "
              f"{r.artifact_images_per_s:15.0f}")  # fmt: skip
    print(f"parity on {parity[0].images} test images; batch-1 p50 and batch-32 throughput, eager fp32 vs the artifact")
    print(f"table {report.out / 'parity.csv'}")
