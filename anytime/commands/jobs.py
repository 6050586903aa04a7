"""``anytime jobs``: a sweep of training runs, a grid or a list in TOML, on local joblib workers or SLURM job
arrays through submitit: resumable, one run folder per job, a results table and its plot."""

from __future__ import annotations

import argparse
from pathlib import Path

from anytime.commands.options import add_json, add_out, positive_int
from anytime.commands.output import print_error, print_json, progress_printer
from anytime.train.jobs import JobOutcome, load_sweep, run_sweep

SUMMARY = (
    "a sweep of training runs (a grid or a list in TOML) on local joblib workers or SLURM job arrays "
    "(submitit): resumable, one run folder per job, results table and plot"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime jobs``."""
    parser.add_argument(
        "sweep", metavar="SWEEP.toml", help="[base] recipe (or card = NAME), then [grid] lists or [[job]] tables"
    )
    parser.add_argument(
        "--backend",
        choices=["local", "slurm", "submitit-local"],
        default="local",
        help="local: joblib processes on this machine (default); slurm: a job array through submitit "
        "([slurm] table: partition, time_min, gpus_per_job, cpus_per_job, mem_gb, max_parallel); "
        "submitit-local: the slurm path run on this machine",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="jobs at once (local: default 1, the cores shared out as threads; slurm: array tasks at "
        "once, default [slurm] max_parallel, else all)",
    )
    add_out(parser, "the sweep's folder, one run folder per job (default runs/sweeps/NAME)")
    parser.add_argument("--no-plot", action="store_true", help="write the results table only")
    add_json(parser, "print the results table as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the sweep's jobs (those not finished yet), reporting each as it ends; write the table and plot."""
    out = Path(args.out or Path("runs") / "sweeps" / Path(args.sweep).stem)
    sweep = load_sweep(args.sweep, out)
    say = progress_printer(args)
    workers = args.workers or ("1" if args.backend == "local" else "all")
    say(f"{len(sweep.jobs)} job(s) from {args.sweep} on {args.backend} with {workers} worker(s) -> {out}")

    def report(outcome: JobOutcome) -> None:
        if outcome.status == "failed":
            say(f"  {outcome.job}: failed: {outcome.error} (log: {outcome.log})")
        else:
            say(f"  {outcome.job}: {outcome.status}, test {100 * (outcome.test_acc or 0):.2f}%  "
                f"({outcome.train_time_s or 0:.1f} s training)")  # fmt: skip

    result = run_sweep(sweep, out, backend=args.backend, workers=args.workers, on_outcome=report)
    written = [result.table_csv, result.table_json]
    if not args.no_plot and any(o.test_acc is not None for o in result.outcomes):
        from anytime.plotting.sweeps import plot_sweep

        written += plot_sweep(result.outcomes, out / "results", f"{sweep.path.name}: {len(sweep.jobs)} jobs")
    if args.json:
        print_json([o.row() for o in result.outcomes])
    else:
        print(f"results    {', '.join(str(p) for p in written)}")
    if result.failed:
        print_error("jobs", f"{len(result.failed)} of {len(result.outcomes)} job(s) failed (their logs are named "
                    "above); fix the cause and run the same command again: finished jobs are kept")  # fmt: skip
        return 1
    return 0
