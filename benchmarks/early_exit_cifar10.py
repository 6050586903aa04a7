"""Benchmark: real early exit of a multi-exit CIFAR ResNet on the CIFAR-10 test images, against its backbone.

The model is the card models/cifar10-resnet32-exits.toml (ResNet-32, exits at about 15, 35, 55 and 75%
of its FLOPs, trained jointly on the real CIFAR-10 images). Training takes over an hour on 2 CPU cores,
so it is checkpointed every epoch and resumed when the benchmark (or `anytime train --resume`) is run
again. Then: every exit's outputs are cached on the validation and test splits; thresholds are fit on
validation only, for at most 1 accuracy point below the last exit, for each criterion, and the
criterion with the fewest validation FLOPs is kept; the test split is run with real early exit, and
every test image is timed one at a time (batch 1) with early exit and with the plain backbone, in
alternating turns of 50 images. Ratio: the median over those turns (paired rounds) of the backbone's mean latency /
early exit's, its 95% interval printed beside it. Target: at least 2x, measured, with test accuracy at most
``--max-drop`` (default 1) point below the last exit's.

``--onnx`` then does the same as deployed: the run's multi-exit model and its plain backbone exported as fp32 ONNX
graphs, the calibrated policy compiled into the exit graphs (``ExportedModel.exit_program``), both run by ONNX
Runtime on arrays; accuracy and agreement with PyTorch's early exit on every test image, and a seeded sample of
them timed at batch 1. The verdict is then ONNX Runtime's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_exit_run_options, exit_run_dir, onnx_programs, parser, prepare_exit_run, report, run

from anytime.calibrate import ExitPolicy
from anytime.data import make_loader
from anytime.profile import latency_summary, per_sample_latency
from anytime.tasks.calibration import CalibrationSettings, calibrate_run
from anytime.tasks.evaluation import EvaluationSettings, evaluate_run
from anytime.tasks.plots import plot_run
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.train import load_splits
from anytime.train.runs import load_run

TARGET = 2.0
MAX_DROP = 1.0  # accuracy points below the last exit


def onnx_early_exit(run_dir: Path, policy: ExitPolicy, latency_samples: int) -> dict[str, Any]:
    """The run's early exit as deployed through ONNX Runtime: accuracy and agreement with PyTorch's exits on the
    whole test split, and batch-1 latency of the compiled policy against the plain export on a seeded sample."""
    loaded = load_run(run_dir, "cpu")
    splits = load_splits(loaded.config)
    test = list(make_loader(splits.test, splits.info, batch_size=500, train=False, seed=0))
    images, labels = torch.cat([x for x, _ in test]), torch.cat([y for _, y in test])
    shape = (int(loaded.dataset["in_channels"]), *(int(v) for v in (loaded.dataset.get("image_size") or [32, 32])))
    classes = int(loaded.dataset["num_classes"])
    with tempfile.TemporaryDirectory() as scratch:
        program, plain, _, _ = onnx_programs(
            loaded.model, policy, Path(scratch), input_shape=shape, num_classes=classes
        )
        answered = [program(x.numpy()) for x, _ in test]
        eager = torch.cat([policy.run(loaded.model, x).exits for x, _ in test])
        predictions = torch.from_numpy(np.concatenate([a.predictions for a in answered]))
        exits = torch.from_numpy(np.concatenate([a.exits for a in answered]))
        timed = images[torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:latency_samples]]
        times = per_sample_latency({"early_exit": lambda x: program(x.numpy()), "backbone": lambda x: plain(x.numpy())},
                                   timed, warmup=20, turn=50)  # fmt: skip
    early, backbone = latency_summary(times["early_exit"]), latency_summary(times["backbone"])
    return {"accuracy": float((predictions == labels).double().mean()),
            "exit_share": [float((exits == k).double().mean()) for k in range(policy.num_steps)],
            "agreement_exits": float((exits == eager).double().mean()),
            "early_exit": early, "backbone": backbone, "speedup": backbone["mean_ms"] / early["mean_ms"]}  # fmt: skip


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    add_exit_run_options(p)
    p.add_argument("--latency-samples", type=int, default=10_000, help="test images timed at batch 1")
    p.add_argument("--max-drop", type=float, default=MAX_DROP,
                   help=f"accuracy points below the last exit the thresholds may cost (default {MAX_DROP:g})")  # fmt: skip
    p.add_argument(
        "--select-exits",
        action="store_true",
        help="also choose the exits to keep, costed in time measured at batch 1 (calibrate --select-exits)",
    )
    p.add_argument(
        "--combine-exits",
        action="store_true",
        help="every exit answers with a weighted ensemble of itself and the earlier exits (calibrate --combine-exits)",
    )
    p.add_argument("--onnx", action="store_true", help="also time early exit as deployed through ONNX Runtime (the "
                   "policy compiled into the exported graphs); the verdict is then ONNX Runtime's")  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = exit_run_dir(args.run, args.quick, args.card)
    latency_samples = 100 if args.quick else args.latency_samples
    candidates, best, chosen = prepare_exit_run(run_dir, args.quick, max_drop=args.max_drop, card_path=args.card,
                                                combine=args.combine_exits)  # fmt: skip
    if args.select_exits:
        profile_path = run_dir / "profile-for-selection.json"
        profile_run(
            run_dir,
            ProfileSettings(batch_sizes=(1,), repeats=50 if args.quick else 500, memory=False, form=args.form),
            out=profile_path,
        )
        chosen = calibrate_run(
            run_dir,
            CalibrationSettings(max_drop=args.max_drop, criterion=best, select=True, combine=args.combine_exits),
            profile=profile_path,
        )
        selection = chosen.selection
        assert selection is not None and selection.test_speedup is not None  # selected, and the test split collected
        print(f"exit selection ({best}, costed by {profile_path.name}): kept exits {list(selection.exits)}, "
              f"predicted {selection.test_speedup:.2f}x on test from the profile's times")  # fmt: skip
    evaluation = evaluate_run(run_dir, EvaluationSettings(latency_samples=latency_samples, form=args.form))
    plot_run(run_dir)
    val, test, oracle = chosen.validation.to_dict(), chosen.to_dict()["test"], chosen.oracle["test"]
    assert test is not None and oracle is not None  # the test split is collected
    lat = evaluation.latency
    assert lat is not None  # test images were timed
    print(
        f"last exit alone: test {100 * test['last_exit_accuracy']:.2f}% (validation {100 * val['last_exit_accuracy']:.2f}%)"
    )
    print(f"oracle (first correct exit): {100 * oracle['accuracy']:.2f}% at {oracle['flops_ratio']:.3f}x FLOPs "
          f"= {oracle['flops_speedup']:.2f}x fewer (the ceiling)")  # fmt: skip
    for criterion, c in candidates.items():
        ctest = c.to_dict()["test"]
        print(f"  {criterion:<19} validation {100 * c.validation.accuracy:.2f}% at "
              f"{c.validation.result.flops_ratio:.3f}x FLOPs; test {100 * ctest['accuracy']:.2f}% at "
              f"{ctest['flops_ratio']:.3f}x")  # fmt: skip
    print(f"chosen on validation: {best}, thresholds {list(chosen.policy.thresholds)}")
    print(f"test with real early exit: {100 * evaluation.accuracy:.2f}% "
          f"({100 * (evaluation.accuracy - test['last_exit_accuracy']):+.2f} points vs the last exit), "
          f"{evaluation.flops_ratio:.3f}x FLOPs ({1 / evaluation.flops_ratio:.2f}x fewer), "
          f"exit shares {[round(s, 3) for s in evaluation.exit_share]}")  # fmt: skip
    print(f"latency per image at batch 1 over {lat.early_exit.count} test images: early exit "
          f"{lat.early_exit.mean_ms:.3f} ms (p99 {lat.early_exit.p99_ms:.3f}), backbone "
          f"{lat.backbone.mean_ms:.3f} ms (p99 {lat.backbone.p99_ms:.3f}) -> {lat.speedup:.2f}x")  # fmt: skip
    if lat.paired is not None and lat.paired.rounds >= 6:  # fewer rounds (a smoke run) give no interval
        print(f"paired, turn by turn ({lat.paired.rounds} rounds of {lat.turn} images each way): speed-up median "
              f"{lat.paired.median:.2f}x, 95% interval {lat.paired.low:.2f}x to {lat.paired.high:.2f}x")  # fmt: skip
    figures = {
        "run": str(run_dir), "form": args.form, "combine_exits": chosen.policy.to_dict()["combine"],
        "threads": torch.get_num_threads(), "selection": chosen.to_dict().get("selection"), "criterion": best,
        "thresholds": list(chosen.policy.thresholds),
        "last_exit_test_acc": test["last_exit_accuracy"], "test_acc": evaluation.accuracy,
        "val_acc": val["accuracy"], "last_exit_val_acc": val["last_exit_accuracy"],
        "flops_ratio": evaluation.flops_ratio, "oracle_flops_ratio": oracle["flops_ratio"],
        "exit_share": list(evaluation.exit_share), "latency": lat.to_dict(),
        "agreement": evaluation.to_dict().get("agreement_with_cache"),
        "candidates": {c: {k: v.to_dict()[k] for k in ("validation", "test")} for c, v in candidates.items()},
    }  # fmt: skip
    accuracy, speedup = evaluation.accuracy, (lat.paired.median if lat.paired is not None else lat.speedup)
    if args.onnx:
        deployed = onnx_early_exit(run_dir, chosen.policy, latency_samples)
        figures["onnx"] = deployed
        accuracy, speedup = deployed["accuracy"], deployed["speedup"]
        print(f"ONNX Runtime, the policy compiled into the graphs: test {100 * accuracy:.2f}% "
              f"({100 * (accuracy - test['last_exit_accuracy']):+.2f} points vs the last exit), exit shares "
              f"{[round(s, 3) for s in deployed['exit_share']]}, same exit as PyTorch on "
              f"{100 * deployed['agreement_exits']:.2f}% of the test images; batch 1: early exit "
              f"{deployed['early_exit']['mean_ms']:.3f} ms (p99 {deployed['early_exit']['p99_ms']:.3f}), backbone "
              f"{deployed['backbone']['mean_ms']:.3f} ms (p99 {deployed['backbone']['p99_ms']:.3f}) -> {speedup:.2f}x")  # fmt: skip
    close_enough = accuracy >= test["last_exit_accuracy"] - args.max_drop / 100
    return report(
        "early_exit_cifar10",
        args,
        figures,
        speedup,
        f">= {TARGET}x (the paired median) at <= {args.max_drop:g} point below the last exit on test",
        speedup >= TARGET and close_enough,
    )


if __name__ == "__main__":
    run(main)
