"""Benchmark: real early exit of the MobileBERT-shaped encoder on SST-2 dev and test, against its backbone.

The model is the card models/sst2-mobilebert-exits.toml (6 bottleneck layers, an exit after each), trained from
scratch here (checkpointed every epoch; the benchmark resumes an interrupted run). Then: every exit's outputs are
cached on the validation split (10% of SST-2's training phrases, held out), dev and test; thresholds are fit on
validation only, for at most 1 accuracy point below the last exit, for each criterion (patience included), and
the criterion with the fewest validation FLOPs is kept; dev and test run with real early exit, and every sentence
is timed alone (batch 1, at its own length, no padding) with early exit and with the plain backbone, interleaved.
Ratio: the backbone's mean latency / early exit's on test. Targets: at least 1.5x, the last exit at least 80% on
dev, trained in at most 30 minutes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from common import REPO, parser, report, run, train_card

from anytime.calibrate import CRITERIA
from anytime.errors import AnytimeError
from anytime.outputs import load_cache
from anytime.scheduler.query import run_fingerprint
from anytime.tasks.calibration import CalibrationSettings, calibrate_run
from anytime.tasks.collect import collect_run
from anytime.tasks.evaluation import EvaluationSettings, evaluate_run

CARD = REPO / "models" / "sst2-mobilebert-exits.toml"
TARGET = 1.5  # mean latency speed-up at batch 1
MAX_DROP = 1.0  # accuracy points below the last exit, on validation
DEV_TARGET = 0.80  # the last exit on SST-2 dev
TRAIN_BUDGET_S = 30 * 60
CNN_RAND = 0.827  # Kim (2014), CNN-rand (random word vectors, no pre-training), SST-2 test accuracy


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, help="run directory (default runs/sst2-mobilebert-exits)")
    p.add_argument("--threads", type=int, help="torch threads for the timing (default torch's: one per core)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = args.run or REPO / "runs" / (CARD.stem + ("-quick" if args.quick else ""))
    summary = train_card(run_dir, args.quick, CARD)
    fingerprint = run_fingerprint(run_dir)
    caches = {}
    for split in ("val", "dev", "test"):
        try:
            caches[split] = load_cache(run_dir, split, fingerprint=fingerprint)
        except AnytimeError:  # missing, or from other weights
            caches[split] = collect_run(run_dir, split)
    candidates = {c: calibrate_run(run_dir, CalibrationSettings(max_drop=MAX_DROP, criterion=c),
                                   out=run_dir / f"calibration-{c}.json")
                  for c in CRITERIA}  # fmt: skip
    best = min(candidates, key=lambda c: candidates[c].validation.result.mean_flops)
    chosen = calibrate_run(run_dir, CalibrationSettings(max_drop=MAX_DROP, criterion=best))
    samples = 50 if args.quick else 100_000
    evaluations = {
        split: evaluate_run(run_dir, EvaluationSettings(split=split, latency_samples=samples))
        for split in ("dev", "test")
    }
    exits = {split: [float(a) for a in cache.step_accuracy()] for split, cache in caches.items()}
    last_dev = exits["dev"][-1]
    print(f"trained {summary['epochs']} epochs in {summary['train_time_s'] / 60:.1f} min "
          f"({summary['wall_time_s'] / 60:.1f} min with validation)")  # fmt: skip
    for split, accs in exits.items():
        print(f"{split:<5} accuracy per exit: {' '.join(f'{100 * a:.2f}' for a in accs)}")
    print(f"last exit on dev {100 * last_dev:.2f}% (target >= {100 * DEV_TARGET:.0f}%); on test "
          f"{100 * exits['test'][-1]:.2f}% against CNN-rand's {100 * CNN_RAND:.1f}% (Kim 2014, from scratch)")  # fmt: skip
    for criterion, c in candidates.items():
        print(f"  {criterion:<19} validation {100 * c.validation.accuracy:.2f}% at "
              f"{c.validation.result.flops_ratio:.3f}x FLOPs")  # fmt: skip
    print(f"chosen on validation: {best}, thresholds {list(chosen.policy.thresholds)}")
    for split, evaluation in evaluations.items():
        lat = evaluation.latency
        assert lat is not None  # every split's sentences were timed
        print(f"{split}: real early exit {100 * evaluation.accuracy:.2f}% "
              f"({100 * (evaluation.accuracy - exits[split][-1]):+.2f} points vs the last exit), "
              f"{evaluation.flops_ratio:.3f}x FLOPs, exit shares {[round(s, 3) for s in evaluation.exit_share]}; "
              f"batch 1 over {lat.early_exit.count} sentences: {lat.early_exit.mean_ms:.3f} ms against "
              f"{lat.backbone.mean_ms:.3f} ms -> {lat.speedup:.2f}x")  # fmt: skip
    timed = evaluations["test"].latency
    assert timed is not None
    speedup = timed.speedup
    train_ok = summary["wall_time_s"] <= TRAIN_BUDGET_S
    drop_ok = all(exits[s][-1] - evaluations[s].accuracy <= MAX_DROP / 100 for s in evaluations)
    figures = {
        "run": str(run_dir), "threads": torch.get_num_threads(), "criterion": best,
        "thresholds": list(chosen.policy.thresholds), "exit_accuracy": exits, "last_exit_dev_acc": last_dev,
        "train_time_s": summary["train_time_s"], "train_wall_s": summary["wall_time_s"],
        "epochs": summary["epochs"], "cnn_rand_test_acc": CNN_RAND,
        "evaluations": {s: {k: e.to_dict()[k] for k in ("accuracy", "flops_ratio", "exit_share", "latency",
                                                        "agreement_with_cache")} for s, e in evaluations.items()},
        "candidates": {c: {k: v.to_dict()[k] for k in ("validation", "test")} for c, v in candidates.items()},
        "targets": {"speedup": speedup >= TARGET, "last_exit_dev": last_dev >= DEV_TARGET, "train_30_min": train_ok,
                    "within_1_point": drop_ok},
    }  # fmt: skip
    passed = speedup >= TARGET and last_dev >= DEV_TARGET and train_ok and drop_ok
    return report("early_exit_sst2", args, figures, speedup, f">= {TARGET}x, last exit >= 80% dev, <= 30 min", passed)


if __name__ == "__main__":
    run(main)
