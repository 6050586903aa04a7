"""Benchmark: data-parallel training, 2 gloo processes against 1 process on this machine's cores.

Four trainings of one recipe at the same global batch, each in its own processes, one after the other:
1 process with 1 thread, 1 process with every core's thread, and ``--nproc 2`` (2 gloo processes, the cores shared
out, 1 thread each on 2 cores) with batch norm per process (the default) and with ``--sync-bn``. Throughput is the training images per second of the whole job (all processes),
the median over the epochs after the first. Ratio: 2 processes over 1 process with 1 thread (the speed-up S of the
usual scaling figure; efficiency E = S / 2). The 1-process-all-cores figure says what data parallelism adds over
intra-op threads on the same cores. The loss curves of the 2-process runs and the 1-process run are compared too.
Default recipe: ResNet-20 on 10,000 CIFAR-10 training images (``../shared/data/cifar10``), batch 128, 3 epochs;
``--quick``: LeNet on the embedded digits. No target on a 2-core machine: the figures are recorded as they are.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, parser, report, run

from anytime.utils.io import read_csv
from anytime.utils.threads import usable_cores

CIFAR = REPO.parent / "shared" / "data" / "cifar10"


def _train(out: Path, recipe: list[str], *, threads: int, nproc: int, sync_bn: bool = False) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-m", "anytime", "train", *recipe, "--out", str(out), "--no-progress", "--json"]
    if nproc > 1:
        argv += ["--nproc", str(nproc), *(["--sync-bn"] if sync_bn else [])]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"training failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        )
    rows = read_csv(out / "metrics.csv")
    rates = [float(r["images_per_s"]) for r in rows[1:]] or [float(rows[0]["images_per_s"])]
    return {"processes": nproc, "threads_per_process": threads, "images_per_s": statistics.median(rates),
            "train_loss": [float(r["train_loss"]) for r in rows], "val_acc": float(rows[-1]["val_acc"]),
            "train_s": sum(float(r["train_s"]) for r in rows)}  # fmt: skip


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    cores = usable_cores()
    if args.quick or not (CIFAR / "train").is_dir():
        recipe = ["--model", "lenet", "--data", "digits", "--epochs", "2" if args.quick else str(args.epochs),
                  "--batch-size", "64"]  # fmt: skip
        what = "lenet on digits, batch 64"
    else:
        recipe = ["--model", "resnet20", "--data", "cifar10", "--data-root", str(CIFAR), "--limit-train", "10000",
                  "--epochs", str(args.epochs), "--batch-size", "128", "--lr", "0.1"]  # fmt: skip
        what = "resnet20 on 10,000 CIFAR-10 images, batch 128"
    with tempfile.TemporaryDirectory() as tmp:
        one_1 = _train(Path(tmp) / "one-1", recipe, threads=1, nproc=1)
        one_all = _train(Path(tmp) / f"one-{cores}", recipe, threads=cores, nproc=1)
        two = _train(Path(tmp) / "two", recipe, threads=max(1, cores // 2), nproc=2)
        synced = _train(Path(tmp) / "two-sync", recipe, threads=max(1, cores // 2), nproc=2, sync_bn=True)

    def gap(run: dict[str, object]) -> float:
        return max(abs(a - b) / b for a, b in zip(run["train_loss"], one_1["train_loss"]))  # type: ignore[call-overload]

    speedup = two["images_per_s"] / one_1["images_per_s"]  # type: ignore[operator]
    figures = {"recipe": what, "cores": cores, "one process, 1 thread": one_1, f"one process, {cores} threads": one_all,
               "two processes": two, "two processes, --sync-bn": synced, "speedup_vs_1_thread": speedup,
               "efficiency": speedup / 2, "vs_one_process_all_cores": two["images_per_s"] / one_all["images_per_s"],
               "sync_bn_speedup_vs_1_thread": synced["images_per_s"] / one_1["images_per_s"],
               "largest_relative_loss_gap": gap(two), "largest_relative_loss_gap_sync_bn": gap(synced),
               "largest_relative_loss_gap_threads": gap(one_all)}  # type: ignore[operator]  # fmt: skip
    for name in ("one process, 1 thread", f"one process, {cores} threads", "two processes", "two processes, --sync-bn"):
        f = figures[name]
        print(f"{name:<26} {f['images_per_s']:8.0f} images/s  train {f['train_s']:.1f} s  final val "
              f"{100 * f['val_acc']:.2f}%  losses {f['train_loss']}")  # fmt: skip
    print(f"speed-up S = {speedup:.2f} (E = {speedup / 2:.2f}); against one process on all cores "
          f"{figures['vs_one_process_all_cores']:.2f}x; loss curves against 1 process, 1 thread: 2 processes within "
          f"{100 * gap(two):.2f}%, with --sync-bn {100 * gap(synced):.2f}%, 1 process on {cores} threads "
          f"{100 * gap(one_all):.2f}%")  # fmt: skip
    return report("ddp_scaling", args, figures, speedup, "none (recorded; 2 cores)", None)


if __name__ == "__main__":
    run(main)
