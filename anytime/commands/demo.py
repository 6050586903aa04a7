"""``anytime demo``: the whole multi-exit pipeline on the embedded digits (train, calibrate, evaluate, schedule,
replay deadlines) and where training time goes; no files needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from anytime.commands.options import add_json, add_out, add_overwrite
from anytime.commands.output import baseline_line, print_policy_figures
from anytime.utils.outputs import check_replaceable

SUMMARY = "the whole multi-exit pipeline on the embedded digits, and where training time goes (no files needed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime demo``."""
    add_out(parser, "results folder (default runs/demo)")
    add_overwrite(parser, "replace an earlier demo's results in --out")
    add_json(parser, "print the demo's demo.json (what the summary shows)")


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary: accuracy per exit, calibration, early exit, deadlines, batch times."""
    from anytime.tasks.demo import DEMO_CONFIG, DEMO_REQUESTS, run_demo
    from anytime.tasks.promises import promise_lines

    out = Path(args.out) if args.out else Path("runs") / "demo"
    check_replaceable(out, "demo", overwrite=args.overwrite, create_parents=args.out is None)
    print(f"demo: training {DEMO_CONFIG.model} on the embedded digits for {DEMO_CONFIG.epochs} epochs...",
          file=sys.stderr)  # fmt: skip
    result = run_demo(out, progress=sys.stderr.isatty(), overwrite=args.overwrite, create_parents=args.out is None)
    if args.json:
        print((result.out_dir / "demo.json").read_text())
        return 0
    summary = result.summary
    print(f"test accuracy {100 * summary.test_acc:.2f}% (validation {100 * summary.val_acc:.2f}%) "
          f"in {summary.train_time_s:.1f} s of training")  # fmt: skip
    for e in summary.steps:
        share = 100 * e.flops / (summary.backbone_flops or 1)
        print(f"  exit {e.index} after {e.name:<11} {share:5.1f}% of the FLOPs: test {100 * e.test_acc:.2f}%")
    if summary.baseline is not None:
        print(baseline_line(summary.baseline, summary.test_acc))
    cal, ev = result.calibration, result.evaluation
    thresholds = [None if t is None else round(t, 3) for t in cal.policy.thresholds]
    print(f"calibrated on validation for at most {cal.calibration.target['max_drop_points']:g} point below the last "
          f"exit ({cal.policy.criterion} thresholds {thresholds}):")  # fmt: skip
    print_policy_figures("  validation", cal.validation)
    print_policy_figures("  test", cal.test)
    lat = ev.latency
    assert lat is not None  # the demo times its test samples
    print(f"real early exit on the test split: {100 * ev.accuracy:.2f}%, {lat.speedup:.2f}x faster per sample "
          f"at batch 1 than the plain backbone ({lat.early_exit.mean_ms:.2f} vs {lat.backbone.mean_ms:.2f} ms)")  # fmt: skip
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
