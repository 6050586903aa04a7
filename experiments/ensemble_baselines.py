"""Study: torchensemble's classic ensembles on CIFAR-10 through the framework: accuracy, training and evaluation time.

It reproduces the seed's table (method | test accuracy | training time | evaluation time) for a small CNN (LeNet) and a
ResNet (ResNet-20), each method trained by `anytime ensemble-baseline` on this machine's CPU at the budget below (far
smaller than the seed's GPU runs: say so when quoting it). Every trained ensemble stays in the results folder as a run
(`runs/<model>-<method>/`) whose steps are its first k members, so `anytime collect / profile / schedule` take it.
Without the CIFAR-10 images (or with --quick) it runs on the embedded digits at a smoke-test budget.

Run: `anytime experiment ensemble-baselines [--quick] [--out DIR] [--overwrite]` (full: about 30 minutes on 2 CPU
cores). Writes: results.csv, results.json, config.json, and baselines.png/.svg (accuracy and training time per method).
"""

from __future__ import annotations

from anytime.data import load_dataset
from anytime.errors import AnytimeError
from anytime.plotting.ensembles import plot_baselines
from anytime.tasks.baseline import METHODS, train_baseline
from anytime.train import TrainConfig
from anytime.utils.io import write_csv, write_json
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
# per model: members, epochs, training images (None: the whole 45,000-image training split), lr
BUDGETS = {
    "lenet": {"estimators": 5, "epochs": 5, "limit_train": None, "lr": 0.05},
    "resnet20": {"estimators": 3, "epochs": 3, "limit_train": 5000, "lr": 0.05},
}
QUICK_BUDGETS = {"lenet": {"estimators": 2, "epochs": 10, "limit_train": None, "lr": 0.05}}  # the digits
BATCH_SIZE = 64  # images per mini-batch
SHRINKAGE = 1.0  # gradient boosting's shrinkage rate (torchensemble's default)
SEED = 0
DEVICE = "cpu"  # torchensemble defaults to CUDA; the framework never assumes it
# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = study_parser("ensemble-baselines", __doc__.splitlines()[0]).parse_args(argv)
    out_dir, create_parents = study_output(args, "ensemble-baselines")
    data = "digits" if args.quick else "cifar10"
    if data == "cifar10":
        try:
            load_dataset("cifar10", seed=SEED)
        except AnytimeError as exc:
            print(f"CIFAR-10 unavailable ({exc}); running on the digits at the quick budget")
            data = "digits"
    budgets = BUDGETS if data == "cifar10" else QUICK_BUDGETS
    rows = []
    with (staged_dir(out_dir, "ensemble-baselines study", overwrite=args.overwrite, create_parents=create_parents) as out,
          StudyProgress(len(budgets) * len(METHODS), "ensemble-baselines", unit="method") as progress):  # fmt: skip
        (out / "runs").mkdir()
        for model, budget in budgets.items():
            for method in METHODS:
                config = TrainConfig(model=model, data=data, epochs=int(budget["epochs"]), batch_size=BATCH_SIZE,
                                     lr=float(budget["lr"]), seed=SEED, limit_train=budget["limit_train"], device=DEVICE)  # fmt: skip
                report = train_baseline(method, config, estimators=int(budget["estimators"]),
                                        out=out / "runs" / f"{model}-{method}", shrinkage=SHRINKAGE)  # fmt: skip
                row = {"model": model, "method": method, "estimators": report.estimators, "epochs": report.epochs,
                       "train_images": budget["limit_train"] or "all", "test_acc": report.test_acc,
                       "train_time_s": report.train_time_s, "eval_time_s": report.eval_time_s,
                       "first_member_test_acc": report.step_test_acc[0]}  # fmt: skip
                rows.append(row)
                progress.done(f"{model:<9} {method:<18} | {100 * report.test_acc:6.2f}% | {report.train_time_s:8.1f} s | "
                              f"{report.eval_time_s:6.2f} s   (first member alone {100 * report.step_test_acc[0]:.2f}%)")  # fmt: skip
        write_csv(out / "results.csv", rows)
        write_json(out / "results.json", rows)
        plot_baselines(rows, out / "baselines", title=f"torchensemble on {data} ({DEVICE})")
        write_study_config(
            out, study="ensemble-baselines",
            hyper={"budgets": budgets, "batch_size": BATCH_SIZE, "shrinkage": SHRINKAGE, "seed": SEED,
                   "device": DEVICE, "data": data, "quick": args.quick},
            notes=["test accuracy by torchensemble's own evaluate; training time includes every member",
                   "budgets are CPU-sized, far below the seed's GPU runs"],
        )  # fmt: skip
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
