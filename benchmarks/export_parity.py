"""Benchmark: exported artifacts against eager PyTorch on the CIFAR-10 test images, per step.

Each run (``--runs``, default the trained ``runs/cifar10-resnet20`` and the multi-exit
``runs/cifar10-resnet32-exits``, those present) is exported four ways with ``anytime export``: .pt2 fp32,
.pt2 int8 (PT2E, X86InductorQuantizer, run through oneDNN), ONNX fp32 and ONNX int8 (ONNX Runtime's
quantize_static, QDQ), int8 calibrated on 512 training images. Every step of every artifact is compared with the
eager fp32 model on the whole test split: top-1 agreement and the largest logit difference, then latency at
batch 1 and throughput at batch 32, interleaved with eager. Also the artifacts' bytes on disk, int8 against fp32.

Targets (issue 11): every fp32 artifact agrees with eager on >= 99.9% of the test images (top-1), every int8
artifact on >= 99%; the int8 artifact >= 3.5x smaller than the fp32 one. Ratio: the smallest agreement over its
target (>= 1 passes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import REPO, parser, report, run

from anytime.export import export_run

# Hyper-parameters
RUNS = ("runs/cifar10-resnet20", "runs/cifar10-resnet32-exits")  # trained runs, relative to the repository
EXPORTS = (("pt2", "fp32"), ("pt2", "int8"), ("onnx", "fp32"), ("onnx", "int8"))
CALIBRATION_IMAGES = 512  # training images for int8
PARITY_IMAGES = 10_000  # the whole CIFAR-10 test split
LATENCY_IMAGES = 100  # batch-1 timings per step (p50)
TARGETS = {"fp32": 0.999, "int8": 0.99, "size": 3.5}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", help="comma-separated trained runs (default: those of RUNS present)")
    args = p.parse_args()
    runs = [Path(r) for r in args.runs.split(",")] if args.runs else [REPO / r for r in RUNS if (REPO / r).is_dir()]
    if not runs:
        print(f"no trained run found ({', '.join(RUNS)}); train a card first or pass --runs")
        return 2
    images = 500 if args.quick else PARITY_IMAGES
    rows, sizes, worst = [], [], float("inf")
    with tempfile.TemporaryDirectory() as scratch:
        for run_dir in runs:
            size_of = {}
            for fmt, precision in EXPORTS:
                out = Path(scratch) / f"{run_dir.name}-{fmt}-{precision}"
                print(f"exporting {run_dir} as {fmt} {precision}...", flush=True)
                result = export_run(run_dir, fmt, out=out, precision=precision, calibration_images=CALIBRATION_IMAGES,
                                    parity_images=images, latency_images=20 if args.quick else LATENCY_IMAGES)  # fmt: skip
                size_of[(fmt, precision)] = result.manifest.bytes
                for r in result.parity:
                    worst = min(worst, r.top1_agreement / TARGETS[precision])
                    rows.append({"run": run_dir.name, "format": fmt, **r.to_dict()})
                    print(f"  step {r.step}: agree {100 * r.top1_agreement:6.2f}%  max err {r.max_abs_err:.2e}  "
                          f"batch 1 {r.eager_p50_ms:.3f} -> {r.artifact_p50_ms:.3f} ms  batch 32 "
                          f"{r.eager_images_per_s:.0f} -> {r.artifact_images_per_s:.0f} img/s")  # fmt: skip
            for fmt in ("pt2", "onnx"):
                ratio = size_of[(fmt, "fp32")] / size_of[(fmt, "int8")]
                sizes.append({"run": run_dir.name, "format": fmt, "fp32_bytes": size_of[(fmt, "fp32")],
                              "int8_bytes": size_of[(fmt, "int8")], "ratio": ratio, "pass": ratio >= TARGETS["size"]})  # fmt: skip
                print(f"{run_dir.name} {fmt}: fp32 {size_of[(fmt, 'fp32')]:,} B, int8 {size_of[(fmt, 'int8')]:,} B: {ratio:.2f}x smaller")
    figures = {"rows": rows, "sizes": sizes, "images": images, "targets": TARGETS}
    return report("export_parity", args, figures, worst, ">= 1 (agreement / target)", worst >= 1)


if __name__ == "__main__":
    run(main)
