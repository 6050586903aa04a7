"""Benchmark: the deadline frontier over (exit, precision) against fp32 alone, on the multi-exit CIFAR-10 card.

The run (``--run``, default ``runs/cifar10-resnet32-exits``: the card models/cifar10-resnet32-exits.toml,
trained here if missing) and its int8 form (``anytime quantize``, oneDNN kernels) are each collected, calibrated
on validation (entropy, at most 1 point below the last exit) and profiled on this machine at batch 1. For a sweep
of deadlines, the scheduler over both precisions and the scheduler over fp32 alone each choose the most
accurate option whose p99 latency fits.

Target (issue 11): at every deadline where both have an option, the accuracy of the two-precision choice is at
least as high; reported too, the deadlines where int8 makes an option fit that fp32 cannot. Ratio: the share of
those deadlines where it is at least as high (target 1.0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from common import add_exit_run_options, exit_run_dir, parser, prepare_exit_run, report, run

from anytime.scheduler.query import precision_scheduler, scheduler_for_run
from anytime.tasks.calibration import CalibrationSettings, calibrate_run
from anytime.tasks.collect import collect_run
from anytime.tasks.profiling import ProfileSettings, profile_run

# Hyper-parameters
MAX_DROP = 1.0  # accuracy points below the last exit that a calibrated policy may give up (validation)
REPEATS = 300  # timed repetitions per step at batch 1 (a p99 needs at least 100)
DEADLINES = 60  # deadlines swept, evenly from 0.8x the cheapest option's p99 to 1.2x the dearest
QUANTILE = 0.99


def _profiled(run_dir: Path, repeats: int) -> None:
    for stale in run_dir.glob("profile-*.json"):
        stale.unlink()  # profiled again, now, beside the other precision: same machine state
    profile_run(run_dir, ProfileSettings(batch_sizes=(1,), repeats=repeats, warmup=20, memory=False))


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    add_exit_run_options(p)
    args = p.parse_args()
    run_dir = exit_run_dir(args.run, args.quick, args.card)
    prepare_exit_run(run_dir, args.quick, max_drop=MAX_DROP, card_path=args.card)
    from anytime.tasks.quantize import quantize_run
    from anytime.train.records import precision_record, run_weights_fingerprint

    qrun = run_dir.with_name(f"{run_dir.name}-int8")
    record = precision_record(qrun) if qrun.is_dir() else None
    if record is None or record.get("parent_fingerprint") != run_weights_fingerprint(run_dir) or not record["compile"]:
        quantize_run(run_dir, "int8", out=qrun, overwrite=qrun.exists())
        collect_run(qrun, "val")
        collect_run(qrun, "test")
        calibrate_run(qrun, CalibrationSettings(max_drop=MAX_DROP))
    repeats = 100 if args.quick else REPEATS
    _profiled(run_dir, repeats)
    _profiled(qrun, repeats)
    both, _ = precision_scheduler([run_dir, qrun])
    alone, _ = scheduler_for_run(run_dir)
    latencies = [latency for _, latency in both.frontier(QUANTILE)] + [
        latency for _, latency in alone.frontier(QUANTILE)
    ]
    grid = np.linspace(0.8 * min(latencies), 1.2 * max(latencies), DEADLINES)
    rows, compared, not_worse, only_int8 = [], 0, 0, []
    for deadline in grid:
        a, b = both.select(float(deadline), QUANTILE), alone.select(float(deadline), QUANTILE)
        rows.append({"deadline_ms": float(deadline), "both": a.option, "both_acc": a.accuracy, "both_fits": a.fits,
                     "fp32": b.option, "fp32_acc": b.accuracy, "fp32_fits": b.fits})  # fmt: skip
        if a.fits and b.fits:
            compared += 1
            not_worse += a.accuracy >= b.accuracy
        elif a.fits and not b.fits:
            only_int8.append(float(deadline))
    for row in rows[:: max(1, len(rows) // 12)]:
        print(f"{row['deadline_ms']:8.3f} ms: both -> {row['both']:<36} {100 * row['both_acc']:5.2f}% "
              f"{'' if row['both_fits'] else '(late)'} | fp32 -> {row['fp32']:<30} {100 * row['fp32_acc']:5.2f}% "
              f"{'' if row['fp32_fits'] else '(late)'}")  # fmt: skip
    gain = [r["both_acc"] - r["fp32_acc"] for r in rows if r["both_fits"] and r["fp32_fits"]]
    print(
        f"{compared} deadlines where both fit: at least as accurate at {not_worse}; mean gain "
        f"{100 * float(np.mean(gain)) if gain else 0:.2f} points, most {100 * max(gain, default=0):.2f}"
    )
    if only_int8:
        print(
            f"int8 makes an option fit where fp32 has none from {min(only_int8):.3f} to {max(only_int8):.3f} ms "
            f"({len(only_int8)} of {len(rows)} deadlines)"
        )
    frontier = [{"option": o.name, "accuracy": o.accuracy, "p99_ms": latency} for o, latency in both.frontier(QUANTILE)]
    ratio = not_worse / compared if compared else float("nan")
    figures = {"run": str(run_dir), "int8 run": str(qrun), "rows": rows, "frontier": frontier,
               "only int8 fits ms": only_int8, "mean gain points": 100 * float(np.mean(gain)) if gain else 0.0}  # fmt: skip
    return report(
        "precision_schedule",
        args,
        figures,
        ratio,
        "1.0 (never less accurate than fp32 alone)",
        compared > 0 and not_worse == compared,
    )


if __name__ == "__main__":
    run(main)
