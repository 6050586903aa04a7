"""Study: validation accuracy against wall-clock training time on CIFAR-10, one curve per model.

Each model is trained with the trainer (SGD, cosine schedule) on the real CIFAR-10 images; the
validation split (carved from the training images, never trained on) is scored after every epoch.
Epoch 0 (start-up costs) and the steady-state epochs are reported apart.

Run: `anytime experiment time-accuracy [--quick] [--out DIR] [--overwrite] [--drop-caches]`
(full: about an hour on 2 CPU cores; --quick trains on 2,000 images for 2 epochs, a few minutes).
Writes: curves.csv, results.json, config.json, time_accuracy.png / .svg and each model's run folder.
"""

from __future__ import annotations

import sys

from anytime.data import load_dataset
from anytime.plotting import plot_time_accuracy
from anytime.train import TrainConfig, Trainer, read_metrics
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import device_label, resolve_device
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import page_cache_note, study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
MODELS = {"lenet": 20, "resnet20": 15, "resnet32": 10}  # model -> epochs
BATCH_SIZE = 128  # images per mini-batch
LR = 0.05  # SGD learning rate (momentum 0.9, weight decay 5e-4, cosine schedule)
LIMIT_TRAIN = None  # train on all 45,000 training images (5,000 held out for validation)
SEED = 0
QUICK = {"MODELS": {"lenet": 2, "resnet20": 2}, "LIMIT_TRAIN": 2000}
# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = study_parser("time-accuracy", __doc__.splitlines()[0], drops_caches=True).parse_args(argv)
    out_dir, create_parents = study_output(args, "time-accuracy")
    models, limit = (QUICK["MODELS"], QUICK["LIMIT_TRAIN"]) if args.quick else (MODELS, LIMIT_TRAIN)

    # Dropped before the images are read from disk, the only cold read of the study.
    cache_note = page_cache_note(args)
    splits = load_dataset("cifar10", seed=SEED, limit_train=limit)  # a clear error when the images are absent
    notes = [cache_note]
    curves: dict[str, list[dict]] = {}
    summaries = {}
    with (staged_dir(out_dir, "time-accuracy study", overwrite=args.overwrite, create_parents=create_parents) as out,
          StudyProgress(sum(models.values()), "time-accuracy", unit="epoch") as progress):  # fmt: skip
        for model, epochs in models.items():
            config = TrainConfig(model=model, data="cifar10", epochs=epochs, batch_size=BATCH_SIZE, lr=LR, seed=SEED,
                                 limit_train=limit)  # fmt: skip
            trainer = Trainer(config, out / "runs" / model, progress=sys.stderr.isatty(),
                              on_epoch_end=lambda _: progress.done())  # fmt: skip
            summary = trainer.fit(splits=splits).to_dict()
            curves[model] = read_metrics(out / "runs" / model)
            summaries[model] = summary
            steady = summary["timing"]["steady"]
            progress.say(f"{model:<10} {epochs} epochs: val {100 * summary['final']['val_acc']:.2f}%, "
                         f"test {100 * summary['final']['test_acc']:.2f}%, {summary['wall_time_s'] / 60:.1f} min; "
                         f"epoch 0 {summary['timing']['epoch0']['images_per_s']:.0f} images/s"
                         + (f", steady {steady['images_per_s']:.0f} images/s" if steady else ""))  # fmt: skip
        columns = ["model", "epoch", "elapsed_s", "train_s", "val_acc", "train_acc", "images_per_s"]
        write_csv(out / "curves.csv", [{"model": m, **r} for m, rows in curves.items() for r in rows], columns)
        write_json(out / "results.json", summaries)
        title = f"CIFAR-10{' (quick: 2,000 images)' if args.quick else ''} on {device_label(resolve_device('auto'))}"
        plot_time_accuracy(curves, out / "time_accuracy", title)
        write_study_config(
            out,
            study="time-accuracy",
            hyper={
                "models": models,
                "batch_size": BATCH_SIZE,
                "lr": LR,
                "limit_train": limit,
                "seed": SEED,
                "quick": args.quick,
            },  # fmt: skip
            data_path=splits.info.source,
            notes=notes,
        )
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
