"""Benchmark: a sweep of M x N small training jobs (`anytime jobs`) on 1 worker against 2 workers.

The seed's Amdahl analysis, measured: M learning rates x N seeds, each job an ordinary run, each sweep into its own
fresh folder. As in the seed, where a worker is a GPU a job cannot share, a worker here is one core: the sweep runs
with 1 worker of 1 thread and with 2 workers of 1 thread each. Ratio: speed-up S = T(1 worker) / T(2 workers) in
wall-clock seconds of the whole sweep; efficiency E = S / 2; both sweeps give every job the same test accuracy.
Also timed: 1 worker given both cores as threads (what `anytime jobs --workers 1` does here), which says whether
running jobs side by side beats running each on every core. Default: ResNet-20 on the embedded digits, 2 epochs, 2 x 3 = 6 jobs;
``--quick``: LeNet, 2 x 2 jobs. Target: S >= 1.5 (E >= 0.75).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import parser, report, run

from anytime.train.jobs import load_sweep, run_sweep
from anytime.utils.threads import usable_cores

TARGET = 1.5


def _sweep_file(folder: Path, quick: bool) -> Path:
    model, lrs, seeds, epochs = (
        ("lenet", [0.02, 0.05], [0, 1], 2) if quick else ("resnet20", [0.02, 0.05], [0, 1, 2], 2)
    )
    path = folder / "sweep.toml"
    path.write_text(f'[base]\nmodel = "{model}"\ndata = "digits"\nepochs = {epochs}\nbatch_size = 64\n\n'
                    f"[grid]\nlr = {lrs}\nseed = {seeds}\n")  # fmt: skip
    return path


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    figures: dict[str, dict[str, float]] = {}
    accuracies: dict[str, dict[str, float | None]] = {}
    cores = usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        sweep_path = _sweep_file(Path(tmp), args.quick)
        for name, workers, threads in (("1 worker, 1 thread", 1, 1), ("2 workers, 1 thread each", 2, 1),
                                       (f"1 worker, {cores} threads", 1, cores)):  # fmt: skip
            out = Path(tmp) / name.replace(" ", "-").replace(",", "")
            sweep = load_sweep(sweep_path, out)
            start = time.perf_counter()
            result = run_sweep(sweep, out, workers=workers, threads=threads)
            seconds = time.perf_counter() - start
            if result.failed:
                raise SystemExit(f"job {result.failed[0].job} failed: {result.failed[0].error}")
            accuracies[name] = {o.job: o.test_acc for o in result.outcomes}
            figures[name] = {"seconds": seconds, "jobs": len(sweep.jobs),
                             "train_s": sum(o.train_time_s or 0 for o in result.outcomes)}  # fmt: skip
            print(f"{name:<26} {len(sweep.jobs)} jobs in {seconds:.1f} s")
    same = accuracies["1 worker, 1 thread"] == accuracies["2 workers, 1 thread each"]
    speedup = figures["1 worker, 1 thread"]["seconds"] / figures["2 workers, 1 thread each"]["seconds"]
    versus_threads = figures[f"1 worker, {cores} threads"]["seconds"] / figures["2 workers, 1 thread each"]["seconds"]
    summary = {"speedup": speedup, "efficiency": speedup / 2, "same_accuracies": same,
               "speedup_vs_one_worker_all_cores": versus_threads}  # fmt: skip
    print(f"speed-up S = {speedup:.2f}, efficiency E = {speedup / 2:.2f} (same test accuracies: {same}); "
          f"against 1 worker on all {cores} cores: {versus_threads:.2f}x")  # fmt: skip
    return report("sweep_parallel", args, {**figures, **summary}, speedup, f">= {TARGET}", speedup >= TARGET and same)


if __name__ == "__main__":
    run(main)
