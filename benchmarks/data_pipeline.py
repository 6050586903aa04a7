"""Benchmark: training-batch throughput of our cached-tensor pipeline vs the customary torchvision pipeline.

Both draw shuffled, augmented (random crop 32 with padding 4, horizontal flip), normalised batches
of 128 from the same CIFAR-10 image folder. torchvision: ImageFolder + per-image PIL transforms in
a DataLoader with 4 workers and prefetch 2. Ours: the uint8 tensor cache with batched tensor
augmentation, in the main process. Target: ours at least 5x the images per second.
"""

from __future__ import annotations

import time
from pathlib import Path

from common import median, parser, report, run

from anytime.data import Delivery, load_dataset, make_loader
from anytime.data.torchvision_pipeline import torchvision_loader
from anytime.errors import AnytimeError

DATA_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
BATCH_SIZE = 128
TARGET = 5.0


def _images_per_s(loader, batches: int, warmup: int) -> float:
    seen = 0
    start = 0.0
    for i, (images, _) in enumerate(loader):
        if i == warmup:
            start = time.perf_counter()
        if i >= warmup:
            seen += images.shape[0]
        if i + 1 >= warmup + batches:
            break
    return seen / (time.perf_counter() - start)


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    if not (DATA_ROOT / "train").is_dir():
        raise AnytimeError(f"this benchmark reads the CIFAR-10 image folder at {DATA_ROOT}; it is absent")
    batches, rounds = (20, 1) if args.quick else (100, 3)

    start = time.perf_counter()
    splits = load_dataset("cifar10", DATA_ROOT)
    load_s = time.perf_counter() - start
    print(f"dataset ready in {load_s:.1f} s (decoded once into the uint8 cache, reused while the folder is unchanged)")

    ours, theirs = [], []
    for r in range(rounds):
        loader = make_loader(splits.train, splits.info, batch_size=BATCH_SIZE, train=True, seed=r,
                             delivery=Delivery(workers=0))  # fmt: skip
        loader.set_epoch(0)
        ours.append(_images_per_s(loader, batches, warmup=2))
        tv = torchvision_loader(DATA_ROOT / "train", batch_size=BATCH_SIZE, workers=4, prefetch_factor=2, seed=r)
        theirs.append(_images_per_s(tv, batches, warmup=4))
        print(f"round {r + 1}: ours {ours[-1]:8.0f} images/s   torchvision {theirs[-1]:8.0f} images/s")
    ratio = median(ours) / median(theirs)
    figures = {"ours_images_per_s": median(ours), "torchvision_images_per_s": median(theirs), "batch_size": BATCH_SIZE,
               "batches_per_round": batches, "rounds": rounds, "dataset_load_s": load_s,
               "torchvision_workers": 4, "ours_workers": 0}  # fmt: skip
    print(f"ours {median(ours):.0f} images/s vs torchvision {median(theirs):.0f} images/s: {ratio:.1f}x")
    return report("data_pipeline", args, figures, ratio, f">= {TARGET}x", ratio >= TARGET)


if __name__ == "__main__":
    run(main)
