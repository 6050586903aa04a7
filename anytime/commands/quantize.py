"""``anytime quantize``: a run's steps at another precision (int8 by PT2E with optional QAT, int8-dynamic, bf16,
fp16), written as a run of its own that the rest of the pipeline takes."""

from __future__ import annotations

import argparse

from anytime.commands.options import (
    add_calibration_images,
    add_device,
    add_float_layers,
    add_json,
    add_out,
    add_overwrite,
    finite_float,
    non_negative_int,
)
from anytime.commands.output import print_json, progress_printer

SUMMARY = "a run's steps at another precision (int8, int8-dynamic, bf16, fp16), as a run the pipeline takes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime quantize``."""
    parser.add_argument("run", metavar="RUN", help="a finished float run (exits, slices, a ladder or a plain model)")
    parser.add_argument(
        "--precision",
        required=True,
        choices=["int8", "int8-dynamic", "bf16", "fp16"],
        help="int8: PT2E static, X86InductorQuantizer, each stage and exit head a graph of its own; "
        "int8-dynamic: Linear layers (torchao); bf16/fp16: casts (fp16 on CUDA)",
    )
    add_calibration_images(
        parser, "int8: training images that calibrate the activations (default 512; never validation or test)"
    )
    parser.add_argument(
        "--qat-epochs",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="int8: then N epochs of quantization-aware training (PT2E QAT) on the training split; "
        "the summary shows every step after PTQ and after QAT",
    )
    parser.add_argument(
        "--qat-lr",
        type=finite_float,
        default=1e-3,
        metavar="LR",
        help="QAT's initial learning rate (SGD, cosine; default 0.001)",
    )
    add_float_layers(parser, "int8", "artifact (.pt2, as `anytime export` writes it)")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="keep the converted graphs eager (reference arithmetic: same values, not int8 speed)",
    )
    add_device(parser)
    add_out(parser, "the new run (default RUN-PRECISION beside RUN)")
    add_overwrite(parser, "replace an earlier run in --out")
    add_json(parser, "print the new run's summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Quantize, then print the new run's steps beside the float run's."""
    from anytime.precision.tuning import Int8Settings
    from anytime.tasks.quantize import QuantizeSettings, quantize_run

    settings = QuantizeSettings(compile=not args.no_compile, qat_epochs=args.qat_epochs, qat_lr=args.qat_lr)
    int8 = Int8Settings(calibration_images=args.calibration_images, float_layers=args.float_layers,
                        min_agreement=args.min_agreement, max_float_layers=args.max_float_layers,
                        agreement_images=args.agreement_images, min_size_ratio=args.min_size_ratio)  # fmt: skip
    summary = quantize_run(args.run, args.precision, settings, int8, device=args.device, out=args.out,
                           overwrite=args.overwrite, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(summary.to_dict())
    record = summary.record["precision"]
    print(f"run        {summary.run_dir}: {args.run} at {record['precision']} ({record['backend']}, "
          f"{'compiled' if record['compile'] else 'eager'})")  # fmt: skip
    if record["calibration_images"]:
        print(f"calibrated on {record['calibration_images']} training images")
    tuning = record.get("agreement_tuning")
    if tuning:
        lowest = 100 * min(tuning["agreement"])
        print(f"agreement with the float run on {tuning['images']} validation images: lowest step {lowest:.2f}% "
              f"(target {100 * tuning['target']:.2f}%{'' if tuning['met'] else ': not met'})")  # fmt: skip
        if tuning.get("max_float_weights") is not None:
            print(f"weights kept in float: {tuning['float_weights']:,} of the {tuning['max_float_weights']:,} "
                  "--min-size-ratio allows")  # fmt: skip
    if record.get("float_layers"):
        print(f"kept in float: {', '.join(record['float_layers'])}")
    qat = bool(record.get("qat_epochs"))
    if qat:
        print(f"fine-tuned by {record['qat_epochs']} epochs of quantization-aware training (lr {record['qat_lr']})")
    print(
        f"{'step':<16} {'GFLOPs':>8} {'val':>7} {'(float)':>8} {'test':>7} {'(float)':>8}"
        + (f" {'PTQ val':>8} {'PTQ test':>9}" if qat else "")
    )
    rows = summary.record.get("exits") or [{"name": "model", **summary.record["final"]}]
    for row, flops in zip(rows, summary.record["step_flops"], strict=False):
        ptq = f" {100 * row['ptq_val_acc']:7.2f}% {100 * row['ptq_test_acc']:8.2f}%" if qat else ""
        print(f"{row['name']:<16} {flops / 1e9:8.4f} {100 * row['val_acc']:6.2f}% {100 * row['parent_val_acc']:7.2f}% "
              f"{100 * row['test_acc']:6.2f}% {100 * row['parent_test_acc']:7.2f}%{ptq}")  # fmt: skip
    print(f"next: anytime collect {summary.run_dir} --split val; anytime profile {summary.run_dir}")
    return 0
