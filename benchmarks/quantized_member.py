"""Benchmark: a trained CIFAR-10 ResNet at int8 (PT2E, X86InductorQuantizer, lowered to oneDNN) against eager fp32.

The run (``--run``, default ``runs/cifar10-resnet20``: the card models/cifar10-resnet20.toml, trained here if
missing) is quantized with ``anytime quantize`` (int8, calibrated on training images). Eager fp32, compiled fp32
(``torch.compile``) and int8 are timed interleaved on the same CIFAR-10-shaped inputs at batch 1 and 32, in
inference mode, after a warm-up, so that the gain from compiling is not credited to int8. Also reported: the
bytes of the weights (fp32 safetensors vs the int8 graph's weights) and the test accuracy of both (PTQ).

Targets (issue 11): int8 >= 3x faster than eager fp32 at batch 32 and >= 2x at batch 1, weights >= 3.5x smaller,
<= 1 point test accuracy drop. Ratio: eager fp32 over int8 at batch 32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from common import REPO, parser, report, run

from anytime.profile import per_sample_latency
from anytime.train.runs import load_run

# Hyper-parameters
CARD = REPO / "models" / "cifar10-resnet20.toml"
BATCHES = {1: 300, 32: 40}  # batch size -> timed batches
WARMUP = 10  # untimed batches first (the compiled model compiles here)
CALIBRATION_IMAGES = 512  # training images
TARGETS = {"batch32": 3.0, "batch1": 2.0, "size": 3.5, "drop_points": 1.0}


def _ensure_run(run_dir: Path, quick: bool) -> None:
    from anytime.train import Trainer, load_card

    if (run_dir / "model.safetensors").is_file():
        return
    card = load_card(CARD)
    config = card.config.replace(epochs=1, limit_train=2000) if quick else card.config
    print(f"training {card.name} into {run_dir} ({config.epochs} epochs)...", flush=True)
    Trainer(config, run_dir, extra_config={"card": str(CARD)}).fit(resume=(run_dir / "checkpoint.pt").is_file())


def _quantized(run_dir: Path) -> Path:
    from anytime.precision.tuning import Int8Settings
    from anytime.tasks.quantize import quantize_run
    from anytime.train.records import precision_record, run_weights_fingerprint

    target = run_dir.with_name(f"{run_dir.name}-int8")
    record = precision_record(target) if target.is_dir() else None
    if record is None or record.get("parent_fingerprint") != run_weights_fingerprint(run_dir) or not record["compile"]:
        print(f"quantizing {run_dir} -> {target}...", flush=True)
        quantize_run(run_dir, "int8", int8=Int8Settings(calibration_images=CALIBRATION_IMAGES), out=target,
                     overwrite=target.exists())  # fmt: skip
    return target


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The int8 graph's int8 weight tensors (bytes) and the float weight tensors they stand for (convolution and
    linear weights, 4 bytes a value); the graph also keeps float copies for its reference arithmetic, so the whole
    state dict is not what a deployed artifact would store."""
    int8 = sum(t.numel() for part in model.parts for t in part.state_dict().values() if t.dtype == torch.int8)  # type: ignore[union-attr]
    float_weights = sum(4 * p.numel() for m in model.float_model.modules()  # type: ignore[union-attr]
                        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) for p in [m.weight])  # fmt: skip
    return int8, float_weights


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=REPO / "runs" / "cifar10-resnet20", help="a trained plain CIFAR-10 run")
    args: argparse.Namespace = p.parse_args()
    run_dir = args.run.with_name(args.run.name + "-quick") if args.quick else args.run
    _ensure_run(run_dir, args.quick)
    qrun = _quantized(run_dir)
    fp32 = load_run(run_dir).model
    int8 = load_run(qrun).model
    compiled = torch.compile(fp32)
    functions = {"eager fp32": fp32, "compiled fp32": compiled, "int8": int8}
    figures: dict[str, object] = {"run": str(run_dir), "quantized run": str(qrun), "threads": torch.get_num_threads()}
    ratios = {}
    for batch, count in BATCHES.items():
        count = max(5, count // 10) if args.quick else count
        inputs = torch.randn(batch * (count + WARMUP), 3, 32, 32, generator=torch.Generator().manual_seed(batch))
        times = per_sample_latency(functions, inputs, warmup=WARMUP, batch_size=batch)
        medians = {name: 1000 * float(np.median(t)) for name, t in times.items()}
        p99 = {name: 1000 * float(np.quantile(t, 0.99)) for name, t in times.items()}
        ratios[batch] = {"eager/int8": medians["eager fp32"] / medians["int8"],
                         "compiled/int8": medians["compiled fp32"] / medians["int8"]}  # fmt: skip
        figures[f"batch {batch}"] = {"median ms": medians, "p99 ms": p99, "images/s": {
            name: 1000 * batch / ms for name, ms in medians.items()}, **ratios[batch]}  # fmt: skip
        print(
            f"batch {batch:<3} "
            + "  ".join(f"{n} {ms:.3f} ms" for n, ms in medians.items())
            + f"  eager/int8 {ratios[batch]['eager/int8']:.2f}x  compiled/int8 {ratios[batch]['compiled/int8']:.2f}x"
        )
    from anytime.precision import Int8Recipe, convert

    # the same graphs before lowering (lowered weights are prepacked and opaque): int8 tensors at one byte each
    reference, _ = convert(
        fp32, "int8", input_shape=(3, 32, 32), int8=Int8Recipe(calibration=[torch.randn(8, 3, 32, 32)]), compile=False
    )
    int8_bytes, fp32_bytes = _weight_bytes(reference)
    summary = json.loads((qrun / "summary.json").read_text())["final"]
    drop = 100 * (summary["parent_test_acc"] - summary["test_acc"])
    figures.update({"fp32 weights bytes": fp32_bytes, "int8 weights bytes": int8_bytes, "size ratio": fp32_bytes / int8_bytes,
                    "test acc fp32": summary["parent_test_acc"], "test acc int8 (PTQ)": summary["test_acc"],
                    "drop points": drop})  # fmt: skip
    print(f"weights {fp32_bytes / 1e6:.2f} MB fp32 vs {int8_bytes / 1e6:.2f} MB int8 ({fp32_bytes / int8_bytes:.2f}x); "
          f"test accuracy {100 * summary['parent_test_acc']:.2f}% fp32, {100 * summary['test_acc']:.2f}% int8 PTQ "
          f"({drop:+.2f} points drop)")  # fmt: skip
    checks = {"batch32": ratios[32]["eager/int8"] >= TARGETS["batch32"], "batch1": ratios[1]["eager/int8"] >= TARGETS["batch1"],
              "size": fp32_bytes / int8_bytes >= TARGETS["size"], "drop": drop <= TARGETS["drop_points"]}  # fmt: skip
    figures["checks"] = checks
    print("targets: " + ", ".join(f"{k} {'pass' if v else 'fail'}" for k, v in checks.items()))
    return report(
        "quantized_member",
        args,
        figures,
        ratios[32]["eager/int8"],
        ">= 3x at batch 32, >= 2x at batch 1, >= 3.5x smaller, <= 1 point",
        all(checks.values()),
    )


if __name__ == "__main__":
    run(main)
