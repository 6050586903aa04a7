"""``anytime ensemble-baseline``: torchensemble's fusion, voting, bagging, gradient boosting or snapshot ensemble,
trained as a baseline and written as a run whose steps are its first k members."""

from __future__ import annotations

import argparse

from anytime.commands.options import (
    DEVICE_HELP,
    add_batch_size,
    add_device,
    add_json,
    add_out,
    add_overwrite,
    finite_float,
    non_negative_int,
    positive_int,
)
from anytime.commands.output import print_json, progress_printer

SUMMARY = "torchensemble's fusion, voting, bagging, gradient boosting or snapshot ensemble, as a run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime ensemble-baseline``."""
    parser.add_argument(
        "--method", required=True, choices=["fusion", "voting", "bagging", "gradient-boosting", "snapshot"]
    )
    parser.add_argument("--model", required=True, help="the members' zoo model (each member a fresh copy)")
    parser.add_argument("--estimators", required=True, type=positive_int, metavar="N", help="members")
    parser.add_argument(
        "--epochs",
        required=True,
        type=positive_int,
        metavar="E",
        help="training epochs (snapshot: a multiple of --estimators)",
    )
    parser.add_argument("--data", choices=["digits", "cifar10", "cifar100", "folder", "synthetic"], default="digits")
    parser.add_argument("--data-root", metavar="PATH", help="dataset folder (as for train)")
    parser.add_argument("--limit-train", type=positive_int, metavar="N", help="train on N images only")
    add_batch_size(parser, default=128)
    parser.add_argument("--lr", type=finite_float, default=0.05, metavar="LR", help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=non_negative_int, default=0, metavar="S")
    parser.add_argument(
        "--shrinkage",
        type=finite_float,
        default=1.0,
        metavar="R",
        help="gradient boosting's shrinkage rate (default 1)",
    )
    add_device(parser, DEVICE_HELP + " (never torchensemble's own cuda=True)")
    add_out(parser, "the run (a new or empty folder)", required=True)
    add_overwrite(parser, "replace an earlier run in --out")
    add_json(parser, "print the baseline's report as JSON")


def run(args: argparse.Namespace) -> int:
    """Train the baseline; print its accuracy, its times, and each prefix's accuracy."""
    from anytime.tasks.baseline import train_baseline
    from anytime.train import TrainConfig

    config = TrainConfig(model=args.model, data=args.data, data_root=args.data_root, limit_train=args.limit_train,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                         device=args.device)  # fmt: skip
    report = train_baseline(args.method, config, estimators=args.estimators, out=args.out, shrinkage=args.shrinkage,
                            overwrite=args.overwrite, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    print(f"run    {report.out}: {args.method}, {report.estimators} x {report.model}, {report.epochs} epochs")
    print("method | test accuracy | training time | evaluation time")
    print(f"{args.method} | {100 * report.test_acc:.2f}% | {report.train_time_s:.2f} s | {report.eval_time_s:.2f} s")
    for k, (val, test) in enumerate(zip(report.step_val_acc, report.step_test_acc, strict=False)):
        print(f"step {k} (first {k + 1} members)  val {100 * val:.2f}%  test {100 * test:.2f}%")
    print(f"next: anytime collect {report.out} --split val; anytime profile {report.out}")
    return 0
