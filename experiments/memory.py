"""Study: peak training memory against batch size, and the memory cost of DataLoader worker processes.

Part 1 trains each model for a few iterations at each batch size, each in a fresh process (peak
RSS only grows within a process). Part 2 draws training batches from an image folder with 0 and 4
workers, through our uint8-cache pipeline and through torchvision's ImageFolder pipeline, sampling
the memory of the whole process tree: RSS summed over processes (counts copy-on-write pages once
per worker) and PSS (shares them out; the honest total on a small-memory device).

Run: `anytime experiment memory [--quick] [--out DIR] [--overwrite] [--drop-caches]` (full: about 10 minutes on 2
CPU cores). The page cache is dropped before each loader probe only with --drop-caches (root; machine-wide).
Writes: by_batch_size.csv, by_workers.csv, results.json, config.json and memory.png / .svg.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from anytime.errors import AnytimeError
from anytime.plotting import plot_memory
from anytime.profile import run_isolated
from anytime.profile.memory import loader_memory, train_step_memory
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import cpu_model
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import page_cache_note, study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
MODELS = ("lenet", "resnet18", "mobilenetv2", "vgg11")
BATCH_SIZES = (8, 16, 32, 128)  # images per mini-batch
ITERATIONS = 3  # SGD iterations per memory probe, after one warm-up
WORKERS = (0, 4)  # DataLoader worker processes compared
LOADER_BATCHES = 60  # batches of 128 drawn per loader probe
DATA_ROOT = "../shared/data/cifar10"  # image folder with train/<class>/*; generated when absent
QUICK = {"MODELS": ("lenet", "resnet20"), "BATCH_SIZES": (8, 32), "LOADER_BATCHES": 10}
# ------------------------------------------------------------------------------------------------------


def _generated_folder(root: Path, per_class: int = 100) -> Path:
    """A stand-in image folder (10 classes of 32x32 PNGs) for machines without the CIFAR-10 images."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("test", per_class // 5)):
        for c in range(10):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def main(argv: list[str] | None = None) -> int:
    args = study_parser("memory", __doc__.splitlines()[0], drops_caches=True).parse_args(argv)
    out_dir, create_parents = study_output(args, "memory")
    models, batch_sizes, loader_batches = MODELS, BATCH_SIZES, LOADER_BATCHES
    if args.quick:
        models, batch_sizes, loader_batches = QUICK["MODELS"], QUICK["BATCH_SIZES"], QUICK["LOADER_BATCHES"]
    notes = []

    by_batch: dict[str, list[dict]] = {}
    progress = StudyProgress(len(models) * len(batch_sizes) + 2 * len(WORKERS), "memory")
    for model in models:
        by_batch[model] = []
        for batch_size in batch_sizes:
            try:
                row = run_isolated(train_step_memory, model, batch_size, iterations=ITERATIONS)
            except RuntimeError as exc:
                raise AnytimeError(f"the memory probe of {model} at batch {batch_size} failed ({exc})") from None
            by_batch[model].append(row)
            progress.done(f"{model:<14} batch {batch_size:>4}: peak RSS {row['peak_rss_mb']:7.0f} MiB "
                          f"(process before the model: {row['baseline_rss_mb']:.0f} MiB)")  # fmt: skip

    with progress, tempfile.TemporaryDirectory() as scratch:
        root = Path(DATA_ROOT)
        if not (root / "train").is_dir():
            root = _generated_folder(Path(scratch) / "images")
            notes.append(f"{DATA_ROOT} not found: a generated folder of 1,000 random 32x32 PNGs was used instead")
        cache_dir = Path(scratch) / "cache"
        try:
            # Build the uint8 cache once so the probes measure steady use, not decoding.
            run_isolated(loader_memory, "anytime", str(root), workers=0, batches=1, cache_dir=str(cache_dir))
        except RuntimeError as exc:
            raise AnytimeError(f"could not read the image folder {root}: {exc}") from None
        by_workers = []
        for pipeline in ("anytime", "torchvision"):
            for workers in WORKERS:
                cache_note = page_cache_note(args)
                row = run_isolated(loader_memory, pipeline, str(root), workers=workers, batches=loader_batches,
                                   cache_dir=str(cache_dir))  # fmt: skip
                by_workers.append(row)
                progress.done(f"{pipeline:<12} {workers} workers: peak PSS {row['peak_pss_mb']:6.0f} MiB, RSS sum "
                              f"{row['peak_rss_mb']:6.0f} MiB over {row['processes']} processes, "
                              f"{row['images_per_s']:7.0f} images/s")  # fmt: skip
        notes.append(cache_note)

    with staged_dir(out_dir, "memory study", overwrite=args.overwrite, create_parents=create_parents) as out:
        flat = [row for rows in by_batch.values() for row in rows]
        write_csv(out / "by_batch_size.csv", flat)
        write_csv(out / "by_workers.csv", by_workers)
        write_json(out / "results.json", {"by_batch_size": flat, "by_workers": by_workers})
        plot_memory(by_batch, by_workers, out / "memory", cpu_model())
        write_study_config(
            out,
            study="memory",
            hyper={
                "models": models,
                "batch_sizes": batch_sizes,
                "iterations": ITERATIONS,
                "workers": WORKERS,
                "loader_batches": loader_batches,
                "data_root": str(root),
                "quick": args.quick,
            },  # fmt: skip
            data_path=root if root.exists() else None,
            notes=notes,
        )
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
