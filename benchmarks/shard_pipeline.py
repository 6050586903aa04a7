"""Benchmark: training batches from shards (anytime prepare-data) vs torchvision's ImageFolder pipeline, with peak memory.

The benchmark generates an image folder (JPEG, quality 90, 64x64, 10 classes of coloured gradients with noise;
a tenth as many test images) in --work, a temporary folder by default, removed at the end: nothing is committed.
A smaller size is a subset of the largest, hard-linked. For each size it packs the folder into shards at 64x64
(`prepare_shards`, 2 workers), then measures one epoch of shuffled, augmented (random crop with padding 4,
horizontal flip), normalised training batches of 256 from each pipeline, each in a process of its own:

- shards: ``load_dataset("shards")`` + the framework's loader, in the main process (no workers), its tensor
  ops on one thread (--threads; two threads were slower on a busy 2-core machine);
- shards, 2 workers: the same batches built in 2 DataLoader workers (one thread each);
- torchvision: ImageFolder + RandomCrop(64, padding=4), RandomHorizontalFlip, ToTensor, Normalize in a
  DataLoader with 4 workers (prefetch 2).

Peak memory is the largest sum of PSS (proportional set size: shared pages counted once) over the process and
its DataLoader workers, sampled every 50 ms from /proc. Both read from a warm page cache (the files were just
written), which is outside either process's memory. Ratio: shard images/s over torchvision's at the largest size;
target >= 5x (main-process shards), with the shards' peak memory at the largest size within 10% (or 32 MiB) of the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import REPO, parser, report, run

IMAGE_SIZE = 64
CLASSES = 10
BATCH_SIZE = 256
TV_WORKERS = 4
SHARD_WORKERS = 2
PIPELINES = {"shards": "shards (main process)", "shards-workers": f"shards ({SHARD_WORKERS} workers)",
             "torchvision": f"torchvision ({TV_WORKERS} workers)"}  # fmt: skip
TARGET = 5.0
SIZES = (25_000, 100_000)
QUICK_SIZES = (300, 600)
DEFAULT_JSON = REPO / "results" / "bench" / "shard_pipeline.json"


# ---- the image folder ------------------------------------------------------------------------------------------


def _write_images(job: tuple[str, int, int, int, int]) -> int:
    """Write images ``start..stop`` of class ``label`` into ``folder`` (a worker's share)."""
    import numpy as np
    from PIL import Image

    folder, label, start, stop, seed = job
    rng = np.random.default_rng([seed, label, start])
    ramp = np.linspace(0, 1, IMAGE_SIZE, dtype=np.float32)
    hue = np.array([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256], dtype=np.float32)
    for i in range(start, stop):
        angle = rng.uniform(0, np.pi)
        field = np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]
        pixels = hue * (0.5 + 0.5 * field[..., None]) + rng.normal(0, 24, (IMAGE_SIZE, IMAGE_SIZE, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(Path(folder) / f"{i:06d}.jpg", quality=90)
    return stop - start


def generate_folder(root: Path, count: int, *, workers: int = 2, seed: int = 0) -> float:
    """An image folder of ``count`` training images and ``count // 10`` test images in 10 classes; seconds taken."""
    import concurrent.futures

    started = time.perf_counter()
    jobs = []
    for split, total in (("train", count), ("test", max(CLASSES, count // 10))):
        per_class = total // CLASSES
        for label in range(CLASSES):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for start in range(0, per_class, 1000):
                jobs.append((str(folder), label, start, min(per_class, start + 1000), seed + (split == "test")))
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_images, jobs))
    return time.perf_counter() - started


def link_subset(source: Path, target: Path, count: int) -> None:
    """``target``: the first ``count // 10`` images of each class of ``source`` (train; a tenth for test), hard-linked."""
    for split, total in (("train", count), ("test", max(CLASSES, count // 10))):
        for label in range(CLASSES):
            src, dst = source / split / f"class{label}", target / split / f"class{label}"
            dst.mkdir(parents=True, exist_ok=True)
            for name in sorted(os.listdir(src))[: total // CLASSES]:
                os.link(src / name, dst / name)


# ---- one pipeline, measured in a process of its own ------------------------------------------------------------


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


class PeakMemory:
    """The largest sum of PSS over this process and its children, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        me = os.getpid()
        total = _pss_kib(me) + sum(_pss_kib(child) for child in _children(me))
        self.peak_kib = max(self.peak_kib, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def measure(kind: str, root: Path, batch_size: int, workers: int, batches: int | None, threads: int) -> dict[str, Any]:
    """One epoch (or ``batches`` batches) of training batches from pipeline ``kind``: images/s and peak memory."""
    with PeakMemory() as memory:
        if kind.startswith("shards"):
            import torch

            from anytime.data import Delivery, load_dataset, make_loader

            torch.set_num_threads(threads)
            splits = load_dataset("shards", root, val_fraction=0.0)
            shard_workers = SHARD_WORKERS if kind == "shards-workers" else 0
            loader: Any = make_loader(splits.train, splits.info, batch_size=batch_size, train=True, seed=0,
                                      delivery=Delivery(workers=shard_workers))  # fmt: skip
            dataset_images = len(splits.train)
        else:
            from anytime.data.torchvision_pipeline import torchvision_loader

            loader = torchvision_loader(root / "train", batch_size=batch_size, workers=workers, crop=IMAGE_SIZE)
            dataset_images = len(loader.dataset)
        seen, started, first = 0, time.perf_counter(), None
        for i, (images, _) in enumerate(loader):
            if first is None:
                first = time.perf_counter() - started  # worker start-up and the first batch, reported apart
                started = time.perf_counter()
            else:
                seen += images.shape[0]
            if batches is not None and i + 1 >= batches:
                break
        seconds = time.perf_counter() - started
        del loader
    return {
        "pipeline": kind, "dataset_images": dataset_images, "images_timed": seen, "seconds": seconds,
        "images_per_s": seen / seconds if seconds > 0 else 0.0, "first_batch_s": first,
        "peak_pss_mib": memory.peak_kib / 1024,
        "max_rss_main_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "max_rss_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }  # fmt: skip


def measure_in_subprocess(kind: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", kind, "--root", str(root), "--batch-size", str(args.batch_size),
               "--tv-workers", str(args.tv_workers), "--threads", str(args.threads)]  # fmt: skip
    if args.batches:
        command += ["--batches", str(args.batches)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {kind} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the benchmark ---------------------------------------------------------------------------------------------


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="folder for the generated images and shards (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the generated images and shards")
    p.add_argument("--sizes", help=f"training-set sizes, comma-separated (default {','.join(map(str, SIZES))})")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--tv-workers", type=int, default=TV_WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, help="batches timed per pipeline (default: one epoch)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the shard pipeline's main process")
    p.add_argument("--measure", choices=list(PIPELINES), help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(
            json.dumps(measure(args.measure, args.root, args.batch_size, args.tv_workers, args.batches, args.threads))
        )
        return 0
    if args.json is None and not args.quick:
        args.json = str(DEFAULT_JSON)
    sizes = sorted(int(v) for v in args.sizes.split(",")) if args.sizes else list(QUICK_SIZES if args.quick else SIZES)

    from anytime.data.shard_writer import prepare_shards

    work = args.work if args.work is not None else Path(tempfile.mkdtemp(prefix="shard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        largest = work / f"images-{sizes[-1]}"
        generate_s = None
        if not (largest / "train").is_dir():
            generate_s = generate_folder(largest, sizes[-1])
            print(f"generated {sizes[-1]:,} + {max(CLASSES, sizes[-1] // 10):,} JPEG images of {IMAGE_SIZE}x{IMAGE_SIZE} "
                  f"in {generate_s:.1f} s")  # fmt: skip
        rows: list[dict[str, Any]] = []
        for size in sizes:
            tree = work / f"images-{size}"
            if not (tree / "train").is_dir():
                link_subset(largest, tree, size)
            shards = work / f"shards-{size}"
            prepared = prepare_shards(tree, shards, image_size=IMAGE_SIZE, workers=2)
            prepare_s = prepared.seconds if prepared.written else None
            shard_mib = sum(s.bytes for s in prepared.manifest.train.shards + prepared.manifest.test.shards) / 2**20
            print(f"{size:,} images: shards ready ({shard_mib:.0f} MiB)"
                  + (f", prepared in {prepare_s:.1f} s" if prepare_s else " (already there)"))  # fmt: skip
            measured = {kind: measure_in_subprocess(kind, tree if kind == "torchvision" else shards, args)
                        for kind in PIPELINES}  # fmt: skip
            speed = measured["torchvision"]["images_per_s"]
            rows.append({"size": size, "prepare_s": prepare_s, "shard_mib": shard_mib, **measured,
                         "speedup": measured["shards"]["images_per_s"] / speed,
                         "speedup_workers": measured["shards-workers"]["images_per_s"] / speed})  # fmt: skip
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'images':>8} {'pipeline':<22} {'images/s':>9} {'peak PSS MiB':>13} {'main RSS MiB':>13} {'speedup':>8}")
    for row in rows:
        for kind, label in PIPELINES.items():
            r = row[kind]
            speed = {"shards": f"{row['speedup']:7.1f}x", "shards-workers": f"{row['speedup_workers']:7.1f}x"}.get(
                kind, ""
            )
            print(f"{row['size']:>8,} {label:<22} {r['images_per_s']:9.0f} {r['peak_pss_mib']:13.0f} "
                  f"{r['max_rss_main_mib']:13.0f} {speed:>8}")  # fmt: skip
    small, large = rows[0]["shards"]["peak_pss_mib"], rows[-1]["shards"]["peak_pss_mib"]
    growth = large - small
    flat = growth <= max(32.0, 0.10 * small)
    ratio = rows[-1]["speedup"]
    print(f"shard peak memory: {small:.0f} MiB at {sizes[0]:,} images, {large:.0f} MiB at {sizes[-1]:,} "
          f"({'flat' if flat else 'grows'}: {growth:+.0f} MiB)")  # fmt: skip
    figures = {"rows": rows, "generate_s": generate_s, "image_size": IMAGE_SIZE, "image_format": "jpeg (quality 90)",
               "batch_size": args.batch_size, "torchvision_workers": args.tv_workers, "threads": args.threads,
               "shard_memory_growth_mib": growth, "shard_memory_flat": flat, "cpu_count": os.cpu_count()}  # fmt: skip
    return report("shard_pipeline", args, figures, ratio, f">= {TARGET}x, flat shard memory", ratio >= TARGET and flat)


if __name__ == "__main__":
    run(main)
