"""Benchmark: the accuracy of each family's steps at matched mean latency on CIFAR-10 (exits vs width
slices vs block drops), all built on ResNet-20 and trained at the same budget.

The runs are those of the residual-cutting study (experiments/residual_cutting.py: 10 epochs on all 45,000
training images; trained here if missing, reused if finished). Every step of every family is timed afresh in this
run at batch 1, in alternating turns of 10 images so that the machine's drift moves the families alike, in three
fresh processes of 300 timings per step, pooled. For 12 latency budgets spread over the families' range, each
family's step is the one a scheduler would pick (best validation accuracy within the budget), and its test accuracy
is reported. Ratio: the width slices' mean test accuracy over the budgets where every family has a step, divided by
the exits'. No target: a comparison (verdict "info").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from common import REPO, parser, report, run

from anytime.plotting.cut import plot_step_families
from anytime.tasks.compare import matched_table
from anytime.utils.io import write_csv


def _study():  # type: ignore[no-untyped-def]
    path = REPO / "experiments" / "residual_cutting.py"
    spec = importlib.util.spec_from_file_location("residual_cutting", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", help="trained runs (default: the study's runs/study, or runs/study-quick with --quick)")
    p.add_argument("--plot", default="runs/ladder_quality", metavar="STEM", help="table and plot (STEM.csv, .png)")
    args = p.parse_args()
    study = _study()
    quick = study.QUICK if args.quick else {}
    runs = Path(args.runs or quick.get("RUNS", study.RUNS))
    limit, epochs = quick.get("LIMIT_TRAIN", study.LIMIT_TRAIN), quick.get("EPOCHS", study.EPOCHS)
    for name in ("resnet20", "resnet20-sd", "resnet20-exits", "resnet20-sliced"):
        study.ensure_run(study.recipes(limit, epochs, study.training_amp())[name], runs / name)
    points = study.family_points(
        runs,
        quick.get("PROFILE_REPEATS", study.PROFILE_REPEATS),
        quick.get("PROFILE_PROCESSES", study.PROFILE_PROCESSES),
    )
    table = matched_table(points, study.budgets(points, study.BUDGETS_MS))
    labels = list(points)
    print(f"{'budget ms':>9}  " + "  ".join(f"{label:>30}" for label in labels))
    for row in table:
        cells = []
        for label in labels:
            acc = row[f"{label}_acc"]
            cells.append(
                f"{'-':>30}"
                if acc is None
                else f"{100 * acc:6.2f}% ({row[f'{label}_step']:>12}, {row[f'{label}_ms']:5.2f} ms)"
            )
        print(f"{row['budget_ms']:9.2f}  " + "  ".join(f"{c:>30}" for c in cells))
    stem = Path(args.plot)
    write_csv(stem.with_suffix(".csv"), table)
    plot_step_families(points, stem, budgets=table, title="ResNet-20 families on CIFAR-10, matched mean latency")
    shared = [row for row in table if all(row[f"{label}_acc"] is not None for label in labels)]
    means = {label: sum(row[f"{label}_acc"] for row in shared) / len(shared) for label in labels}
    figures = {"mean_test_acc_over_shared_budgets": means, "shared_budgets": len(shared), "table": table,
               "steps": {label: [pt.to_dict() for pt in pts] for label, pts in points.items()}}  # fmt: skip
    print("mean test accuracy over the budgets every family meets: "
          + ", ".join(f"{label} {100 * acc:.2f}%" for label, acc in means.items()))  # fmt: skip
    ratio = means["width slices"] / means["early exits"]
    return report("ladder_quality", args, figures, ratio, "none (slices / exits, a comparison)", None)


if __name__ == "__main__":
    run(main)
