"""Study: lottery tickets with late resetting, as a sweep of independent jobs, and the sweep's parallel speed-up.

The seed's plan scaled to 2 cores: a dense ResNet-20 is trained once, keeping its checkpoints after the reset
epochs; every (sparsity, reset epoch) pair is then one ticket (one-shot global magnitude pruning of the dense
run's final weights, the survivors rewound to their values after k epochs and trained to the end with the
pruned weights held at zero), and the M x N tickets are the jobs of one `anytime jobs` sweep with no
communication between them. The sweep runs twice, with 1 worker and with 2 workers, a worker being one core
(1 thread), as a worker was one GPU in the seed, and the speed-up S and efficiency E = S / W are measured
against Amdahl's law (efficiency 1).
Frankle et al. (2019) found that at high sparsity rewinding to an early epoch k > 0 keeps accuracy that
rewinding to initialisation (k = 0) loses; the budget here is far below theirs, so compare shapes only.

Run: `anytime experiment lottery [--quick] [--out DIR] [--overwrite]` (full: about 20 minutes on 2 CPU cores with
the CIFAR-10 images in ../shared/data/cifar10; --quick: LeNet on the embedded digits, 2 x 2 tickets).
Writes: tickets.csv, results.json, config.json, lottery.png/.svg (accuracy vs sparsity, one curve per reset epoch,
the dense run as a line; and the sweep's time with 1 and 2 workers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError
from anytime.train import TrainConfig
from anytime.train.jobs import Job, JobOutcome, Sweep, run_job, run_sweep
from anytime.utils.io import write_csv, write_json
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
MODEL = "resnet20"
DATA = "cifar10"
LIMIT_TRAIN = 5_000  # training images (of the 45,000 left after 5,000 are held out for validation)
EPOCHS = 6  # dense run and every ticket's full schedule (a ticket trains from its reset epoch to the end)
BATCH_SIZE = 128  # images per mini-batch
LR = 0.05  # SGD learning rate (momentum 0.9, weight decay 5e-4), cosine schedule
AMP = "bf16"  # autocast of the forward pass (several times faster on this AMX CPU)
SEED = 0
SPARSITIES = [0.5, 0.8, 0.95]  # share of convolution and linear weights pruned (one shot, global magnitude)
RESET_EPOCHS = [0, 2]  # k: rewind to the dense run's weights after k epochs (0: to initialisation)
WORKERS = [1, 2]  # the sweep is run once per worker count, into its own folder
THREADS_PER_WORKER = 1  # a worker is one core, as in the seed a worker was one GPU
RUNS = "runs/lottery"  # the dense run and the tickets are kept here and reused
QUICK = {"MODEL": "lenet", "DATA": "digits", "LIMIT_TRAIN": None, "EPOCHS": 3, "BATCH_SIZE": 64, "AMP": "off",
         "SPARSITIES": [0.5, 0.9], "RESET_EPOCHS": [0, 1], "RUNS": "runs/lottery-quick"}  # fmt: skip
# ------------------------------------------------------------------------------------------------------


def dense_recipe(hyper: dict[str, Any]) -> TrainConfig:
    """The dense run's recipe, keeping the checkpoints the tickets rewind to."""
    return TrainConfig(model=hyper["MODEL"], data=hyper["DATA"], limit_train=hyper["LIMIT_TRAIN"],
                       epochs=hyper["EPOCHS"], batch_size=hyper["BATCH_SIZE"], lr=LR, amp=hyper["AMP"], seed=SEED,
                       keep_checkpoints=tuple(hyper["RESET_EPOCHS"]))  # fmt: skip


def ticket_sweep(dense: TrainConfig, dense_dir: Path, out: Path, hyper: dict[str, Any]) -> Sweep:
    """One job per (sparsity, reset epoch), each a ticket of the dense run's recipe."""
    jobs = []
    for k in hyper["RESET_EPOCHS"]:
        for sparsity in hyper["SPARSITIES"]:
            config = dense.replace(prune_from=str(dense_dir), sparsity=sparsity, reset_epoch=k, keep_checkpoints=())
            name = f"s{sparsity:g}-k{k}"
            jobs.append(Job(name=name, params={"sparsity": sparsity, "reset_epoch": k}, config=config.to_dict(),
                            run_dir=str(out / name)))  # fmt: skip
    return Sweep(path=dense_dir, jobs=tuple(jobs))


def main(argv: list[str] | None = None) -> int:
    args = study_parser("lottery", __doc__.splitlines()[0]).parse_args(argv)
    out_dir, create_parents = study_output(args, "lottery")
    hyper = {k: QUICK.get(k, v) if args.quick else v for k, v in {
        "MODEL": MODEL, "DATA": DATA, "LIMIT_TRAIN": LIMIT_TRAIN, "EPOCHS": EPOCHS, "BATCH_SIZE": BATCH_SIZE,
        "AMP": AMP, "SPARSITIES": SPARSITIES, "RESET_EPOCHS": RESET_EPOCHS, "RUNS": RUNS}.items()}  # fmt: skip
    runs = Path(hyper["RUNS"])

    # 1. The dense run (reused when finished with this recipe; resumed when interrupted).
    dense = dense_recipe(hyper)
    dense_dir = runs / "dense"
    progress = StudyProgress(1 + len(WORKERS) * len(hyper["SPARSITIES"]) * len(hyper["RESET_EPOCHS"]), "lottery",
                             unit="run")  # fmt: skip
    outcome = run_job(Job(name="dense", params={}, config=dense.to_dict(), run_dir=str(dense_dir)))
    if outcome.status == "failed":
        raise AnytimeError(f"the dense run failed: {outcome.error} (log: {outcome.log})")
    dense_acc = outcome.test_acc
    progress.done(f"dense {hyper['MODEL']}: test {100 * (dense_acc or 0):.2f}%")

    # 2. The tickets, once per worker count, each an ordinary run folder kept in RUNS (a study stopped halfway
    #    keeps its finished tickets; a pass that found some finished has no timing to compare).
    timings: dict[int, float] = {}
    trained: dict[int, int] = {}
    outcomes: dict[int, tuple[JobOutcome, ...]] = {}
    with progress:
        for workers in WORKERS:
            folder = runs / f"tickets-{workers}-worker{'s' if workers > 1 else ''}"
            sweep = ticket_sweep(dense, dense_dir, folder, hyper)
            start = time.perf_counter()
            result = run_sweep(sweep, folder, workers=workers, threads=THREADS_PER_WORKER,
                               on_outcome=lambda _: progress.done())  # fmt: skip
            timings[workers] = time.perf_counter() - start
            if result.failed:
                raise AnytimeError(f"ticket {result.failed[0].job} failed: {result.failed[0].error} "
                                   f"(log: {result.failed[0].log})")  # fmt: skip
            outcomes[workers] = result.outcomes
            trained[workers] = sum(o.status == "done" for o in result.outcomes)
            progress.say(f"{len(sweep.jobs)} tickets with {workers} worker(s): {timings[workers]:.1f} s "
                         f"({trained[workers]} trained now)")  # fmt: skip
    timed = all(trained[w] == len(outcomes[w]) for w in WORKERS)
    speedup = timings[WORKERS[0]] / timings[WORKERS[-1]] if timed else None
    efficiency = speedup / (WORKERS[-1] / WORKERS[0]) if speedup is not None else None
    if speedup is not None and efficiency is not None:
        print(f"speed-up S = {speedup:.2f} with {WORKERS[-1]} workers, efficiency E = {efficiency:.2f}")
    else:
        print("no speed-up: some tickets were found finished; remove the tickets folders in RUNS to time the sweep")
    for o in outcomes[WORKERS[-1]]:
        print(f"  sparsity {o.params['sparsity']:<5g} reset epoch {o.params['reset_epoch']}: "
              f"test {100 * (o.test_acc or 0):.2f}%")  # fmt: skip

    with staged_dir(out_dir, "lottery study", overwrite=args.overwrite, create_parents=create_parents) as out:
        # 3. Tables and the figure.
        rows = [{**o.row(), "workers": w} for w in WORKERS for o in outcomes[w]]
        write_csv(out / "tickets.csv", rows)
        write_json(out / "results.json", {"dense_test_acc": dense_acc, "seconds_by_workers": timings,
                                          "trained_by_workers": trained, "speedup": speedup,
                                          "efficiency": efficiency, "tickets": rows})  # fmt: skip
        from anytime.plotting.sweeps import plot_lottery

        plot_lottery(outcomes[WORKERS[-1]], dense_acc or 0.0, timings if timed else {}, out / "lottery",
                     title=f"{hyper['MODEL']} on {hyper['DATA']}, {hyper['EPOCHS']} epochs")  # fmt: skip
        write_study_config(out, study="lottery", hyper={**hyper, "lr": LR, "seed": SEED, "workers": WORKERS,
                                                        "quick": args.quick})  # fmt: skip
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
