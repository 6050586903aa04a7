"""``anytime ticket``: lottery tickets by iterative magnitude pruning of a dense run, rewound to its epoch K (late
resetting): one ordinary run per round, trained as a sweep of jobs."""

from __future__ import annotations

import argparse
from pathlib import Path

from anytime.commands.options import add_json, add_out, add_reset_epoch, add_sparsity, positive_int
from anytime.commands.output import print_error, print_json, progress_printer
from anytime.train.jobs import JobOutcome, Sweep, run_sweep, ticket_jobs

SUMMARY = (
    "lottery tickets by iterative magnitude pruning of a dense run, rewound to its epoch K (late "
    "resetting): one ordinary run per round"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime ticket``."""
    parser.add_argument("dense", metavar="DENSE_RUN", help="a finished run trained with --keep-checkpoints K")
    add_sparsity(
        parser,
        "share of convolution and linear weights (with --unit channels: of the prunable channels) "
        "pruned at the end, e.g. 0.9",
        required=True,
    )
    add_reset_epoch(parser, "rewind the surviving weights to the dense run's after K epochs (default 0: init)", 0)
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="R",
        help="prune in R rounds, each the same share of what is left (default 1: one shot)",
    )
    parser.add_argument(
        "--scope",
        choices=["global", "layer"],
        default="global",
        help="rank weights over all layers at once (default) or prune each layer alike",
    )
    parser.add_argument(
        "--unit",
        choices=["weights", "channels"],
        default="weights",
        help="prune single weights (masked, default) or whole channels: a smaller, faster network "
        "(Torch-Pruning's dependency graph; residual streams and classifiers are kept whole)",
    )
    add_out(parser, "one run folder per round, DIR/round-R (default DENSE_RUN-ticket)")
    add_json(parser, "print the rounds' results as JSON")


def run(args: argparse.Namespace) -> int:
    """Train the rounds (those not finished yet), reporting each as it ends."""
    dense = Path(args.dense)
    named = dense.resolve()
    unit = "-channels" if args.unit == "channels" else ""
    out = Path(args.out or named.with_name(f"{named.name}-ticket{unit}-s{args.sparsity:g}-k{args.reset_epoch}"))
    jobs = ticket_jobs(dense, out, sparsity=args.sparsity, reset_epoch=args.reset_epoch, rounds=args.rounds,
                       scope=args.scope, unit=args.unit)  # fmt: skip
    say = progress_printer(args)
    say(f"{len(jobs)} round(s) of pruning {dense} to sparsity {args.sparsity:g}, rewound to epoch {args.reset_epoch} "
        f"-> {out}")  # fmt: skip

    def report(o: JobOutcome) -> None:
        if o.status == "failed":
            outcome = f"failed: {o.error} (log: {o.log})"
        else:
            outcome = f"{o.status}, test {100 * (o.test_acc or 0):.2f}%"
        say(f"  {o.job}: sparsity {o.params['sparsity']:.4f}: {outcome}")

    result = run_sweep(Sweep(path=dense, jobs=tuple(jobs)), out, on_outcome=report)
    if args.json:
        print_json([o.row() for o in result.outcomes])
    else:
        print(f"results    {result.table_csv}")
    if result.failed:
        print_error("ticket", f"round {result.failed[0].job} failed; fix the cause and run the same command again: "
                    "finished rounds are kept")  # fmt: skip
        return 1
    return 0
