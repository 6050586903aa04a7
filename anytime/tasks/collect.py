"""Collect: run a trained run once over a split and cache every step's logits (``RUN/outputs/SPLIT.npz``)."""

from __future__ import annotations

from pathlib import Path

from anytime.backbones.footprint import check_forward_memory
from anytime.data import make_loader
from anytime.errors import AnytimeError
from anytime.families import EnsembleModel
from anytime.outputs import SPLITS, OutputCache, cache_path, collect, load_cache
from anytime.train.folder import RunFolder, open_run
from anytime.train.runs import LoadedRun, dataset_input_shape
from anytime.train.splits import run_splits
from anytime.utils.outputs import check_output_file, output_lock


def check_split(split: str) -> None:
    """Refuse a split name the outputs cache does not know."""
    if split not in SPLITS:
        raise AnytimeError(f"unknown split '{split}'; choose one of {', '.join(SPLITS)}")


def collect_run(
    run: RunFolder | str | Path, split: str, *, device: str = "cpu", batch_size: int = 512, progress: bool = False
) -> OutputCache:
    """Run a trained multi-exit model once over ``split`` and save every exit's logits to ``RUN/outputs/``
    (a progress bar on stderr with ``progress``)."""
    check_split(split)
    folder = open_run(run)
    loaded = folder.load(device)
    if loaded.num_steps < 2:
        raise AnytimeError(f"{folder.path} holds a plain model; train it with --exits to collect exits' outputs")
    target = check_output_file(cache_path(folder.path, split), what="output cache", flag="")
    check_forward_memory(loaded.model, input_shape(loaded), batch_size, what=f"collecting at batch {batch_size}",
                         hint="lower --batch-size")  # fmt: skip
    with output_lock(target):
        splits = run_splits(loaded)
        data = splits.split(split)
        loader = make_loader(data, splits.info, batch_size=batch_size, train=False, seed=loaded.config.seed)
        model = loaded.model
        if split == "val" and isinstance(model, EnsembleModel):  # its fusers were fit on this split: cross-fitted
            model = model.heldout_view()
        cache = collect(
            model, loader, split=split, model_fingerprint=loaded.fingerprint, device=loaded.device,
            meta={"dataset_fingerprint": splits.info.fingerprint, "model": loaded.name, "run": str(loaded.run_dir)},
            progress=progress,
        )  # fmt: skip
        cache.save(target)
    return cache


def input_shape(run: LoadedRun) -> tuple[int, ...]:
    """One sample's shape in ``run``'s data."""
    return dataset_input_shape(run.dataset)


def run_cache(run: RunFolder | str | Path, split: str) -> OutputCache:
    """The run's cache of ``split``, refused if it was collected from other weights."""
    folder = open_run(run)
    return load_cache(folder.path, split, fingerprint=folder.fingerprint)
