"""Benchmark: torchensemble's Voting and Fusion through the framework vs the same members fused by our MLP.

Each method trains ``ESTIMATORS`` copies of ``MODEL`` on CIFAR-10 (``anytime ensemble-baseline``, CPU, the budget
below). Its members are then fused a second way, by the MLP fuser fit on the validation split (cross-fitted, as
``anytime ensemble`` does): same members, same training budget, only the fusion differs. Both are scored on test.

Reported (issue 12, no numeric target): test accuracy of torchensemble's own fusion vs the MLP's, per method, with
training and evaluation time. Ratio: the MLP's accuracy over torchensemble's, for Voting.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from common import parser, report, run

from anytime.data import make_loader
from anytime.families import cross_fit, member_log_probs
from anytime.tasks.baseline import train_baseline
from anytime.train import TrainConfig
from anytime.train.runs import load_run
from anytime.train.splits import run_splits

# Hyper-parameters
MODEL = "lenet"
ESTIMATORS = 3
EPOCHS = 8  # per member (Fusion trains them jointly for as many epochs)
LR = 0.05
BATCH_SIZE = 128
METHODS = ("voting", "fusion")
FOLDS = 5


@torch.no_grad()
def _member_answers(run_dir: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    loaded = load_run(run_dir)
    splits = run_splits(loaded)
    loader = make_loader(getattr(splits, split), splits.info, batch_size=500, train=False, seed=loaded.config.seed)
    chunks, labels = [], []
    for x, y in loader:
        chunks.append(torch.stack([member_log_probs(m, None, x) for m in loaded.model.members]))
        labels.append(y)
    return torch.cat(chunks, dim=1), torch.cat(labels)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    data, epochs, limit = ("digits", 6, None) if args.quick else ("cifar10", EPOCHS, None)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for method in METHODS:
            config = TrainConfig(model=MODEL, data=data, epochs=epochs, batch_size=BATCH_SIZE, lr=LR, limit_train=limit,
                                 device="cpu")  # fmt: skip
            out = Path(scratch) / method
            print(f"{method}: training {ESTIMATORS} x {MODEL} for {epochs} epochs on {data}...", flush=True)
            base = train_baseline(method, config, estimators=ESTIMATORS, out=out)
            val, val_labels = _member_answers(out, "val")
            test, test_labels = _member_answers(out, "test")
            fit = cross_fit("mlp", val, val_labels, folds=FOLDS)
            with torch.no_grad():
                mlp = float((fit.fusers[-1](test).argmax(1) == test_labels).float().mean())
            rows.append({"method": method, "torchensemble test acc": base.test_acc, "mlp test acc": mlp,
                         "train time s": base.train_time_s, "eval time s": base.eval_time_s})  # fmt: skip
            print(f"  torchensemble {method}: {100 * base.test_acc:.2f}%  |  same members, MLP fuser: {100 * mlp:.2f}%  "
                  f"(training {base.train_time_s:.1f} s, evaluation {base.eval_time_s:.2f} s)", flush=True)  # fmt: skip
    voting = rows[0]
    ratio = voting["mlp test acc"] / voting["torchensemble test acc"]
    figures = {"model": MODEL, "estimators": ESTIMATORS, "epochs": epochs, "data": data, "rows": rows,
               "threads": torch.get_num_threads()}  # fmt: skip
    return report(
        "ensemble_baselines", args, figures, ratio, "none (MLP vs torchensemble's own fusion, same members)", None
    )


if __name__ == "__main__":
    run(main)
