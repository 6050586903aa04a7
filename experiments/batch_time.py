"""Study: time per training mini-batch against batch size, split into forward, backward and optimizer step.

The edge-training characterisation: for each model and batch size, train on one real CIFAR-10
batch (synthetic 3x32x32 tensors when the images are absent), discard warm-up iterations, and time
the rest. The first (cold) iteration is reported apart from the steady-state median.

Run: `anytime experiment batch-time [--quick] [--out DIR] [--overwrite] [--drop-caches]` (full: about 10 minutes
on 2 CPU cores). The page cache is dropped first only with --drop-caches (root; it affects the whole machine).
Writes: results.csv, results.json, config.json (which says whether the cache was dropped) and one bar plot per
model (PNG + SVG).
"""

from __future__ import annotations

import time

import torch

from anytime.backbones import create_model
from anytime.data import load_dataset, make_loader
from anytime.errors import AnytimeError
from anytime.plotting import plot_batch_time
from anytime.profile import measure_train_step
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import device_label, resolve_device
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import page_cache_note, study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
MODELS = ("lenet", "resnet18", "preact_resnet18", "resnext29_2x64d", "mobilenetv2", "vgg11")
BATCH_SIZES = (8, 16, 32, 128)  # images per mini-batch
WARMUP = 2  # iterations run first and not timed
REPEATS = 10  # timed iterations per (model, batch size)
LR, MOMENTUM = 0.01, 0.9  # SGD, the field's usual recipe
DEVICE = "auto"  # cuda when present
SEED = 0
QUICK = {"BATCH_SIZES": (8, 16), "WARMUP": 1, "REPEATS": 3}  # minutes, not tens of minutes
# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = study_parser("batch-time", __doc__.splitlines()[0], drops_caches=True).parse_args(argv)
    out_dir, create_parents = study_output(args, "batch-time")
    batch_sizes, warmup, repeats = BATCH_SIZES, WARMUP, REPEATS
    if args.quick:
        batch_sizes, warmup, repeats = QUICK["BATCH_SIZES"], QUICK["WARMUP"], QUICK["REPEATS"]
    device = resolve_device(DEVICE)

    # Real images when they are on disk; the timing of a forward pass does not depend on pixel values,
    # but the record says which was used.
    try:
        splits = load_dataset("cifar10", seed=SEED)
        data_name, data_path = "cifar10", splits.info.source
    except AnytimeError:
        splits = load_dataset("synthetic", seed=SEED)
        data_name, data_path = "synthetic", None
    info = splits.info
    loader = make_loader(splits.train, info, batch_size=max(batch_sizes), train=True, seed=SEED)
    images, labels = next(iter(loader))
    images, labels = images.to(device), labels.to(device)

    cache_note = page_cache_note(args)
    rows = []
    with (staged_dir(out_dir, "batch-time study", overwrite=args.overwrite, create_parents=create_parents) as out,
          StudyProgress(len(MODELS) * len(batch_sizes), "batch-time") as progress):  # fmt: skip
        for model_name in MODELS:
            model_rows = []
            for batch_size in batch_sizes:
                torch.manual_seed(SEED)
                model = create_model(model_name, num_classes=info.num_classes, in_channels=info.in_channels).to(device)
                start = time.perf_counter()
                cold = measure_train_step(model, images[:batch_size], labels[:batch_size], warmup=0, repeats=1)
                cold_s = time.perf_counter() - start
                timing = measure_train_step(
                    model, images[:batch_size], labels[:batch_size], warmup=warmup, repeats=repeats, lr=LR,
                    momentum=MOMENTUM,
                )  # fmt: skip
                row = {"model": model_name, **timing.summary(), "first_iteration_s": cold_s,
                       "first_forward_s": cold.forward_s[0]}  # fmt: skip
                model_rows.append(row)
                progress.done(f"{model_name:<18} batch {batch_size:>4}: {1000 * row['total_p50_s']:8.1f} ms/batch "
                              f"(fwd {1000 * row['forward_p50_s']:.1f}, bwd {1000 * row['backward_p50_s']:.1f}, "
                              f"step {1000 * row['step_p50_s']:.1f}); first iteration {1000 * cold_s:.0f} ms")  # fmt: skip
            plot_batch_time(model_name, model_rows, out / f"batch_time_{model_name}", device_label(device))
            rows.extend(model_rows)

        write_csv(out / "results.csv", rows)
        write_json(out / "results.json", rows)
        write_study_config(
            out,
            study="batch-time",
            hyper={
                "models": MODELS,
                "batch_sizes": batch_sizes,
                "warmup": warmup,
                "repeats": repeats,
                "lr": LR,
                "momentum": MOMENTUM,
                "device": str(device),
                "data": data_name,
                "seed": SEED,
                "quick": args.quick,
            },  # fmt: skip
            data_path=data_path,
            notes=[cache_note, "times are medians of the timed iterations; first_iteration_s is the cold start"],
        )
    print(f"results in {out_dir}/ ({cache_note})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
