"""The data a run trains and is judged on: its splits, its tokenizer, checked against what the run recorded."""

from __future__ import annotations

from pathlib import Path

from anytime.data import DatasetSplits, load_dataset
from anytime.data.text import TEXT_DATASETS, TOKENIZER_FILE, TextOptions
from anytime.errors import AnytimeError
from anytime.train.config import TrainConfig
from anytime.train.runs import LoadedRun, run_config


def load_splits(config: TrainConfig, run_dir: str | Path | None = None) -> DatasetSplits:
    """The train / validation / test splits a recipe trains on. Text is encoded with the tokenizer ``run_dir``
    holds (``tokenizer.json``), else the recipe's ``tokenizer`` file, else a new one trained on the split."""
    tokenizer = None
    if config.data in TEXT_DATASETS:
        tokenizer = read_tokenizer(config, run_dir)
    return load_dataset(
        config.data, config.data_root, val_fraction=config.val_fraction, seed=config.seed,
        image_size=config.image_size, limit_train=config.limit_train,
        text=TextOptions(vocab_size=config.vocab_size, max_length=config.max_length, tokenizer=tokenizer),
    )  # fmt: skip


def read_tokenizer(config: TrainConfig, run_dir: str | Path | None) -> str | None:
    """The JSON of the tokenizer a text run uses: the run's own ``tokenizer.json`` (refused if it is gone), or for a
    new run (``run_dir`` None) the recipe's ``tokenizer`` file, else the ``tokenizer.json`` of the checkpoint
    directory it starts from (``--init``); None when there is none (a new run trains one)."""
    if run_dir is not None:
        path = Path(run_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise AnytimeError(f"{run_dir} has no {TOKENIZER_FILE}, which its token ids were made with; restore it "
                               "from a copy of the run, or train again")  # fmt: skip
    elif config.tokenizer is not None:
        path = Path(config.tokenizer).expanduser()
    elif config.init is not None and (Path(config.init).expanduser() / TOKENIZER_FILE).is_file():
        path = Path(config.init).expanduser() / TOKENIZER_FILE  # a Hugging Face checkpoint's own vocabulary
    else:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AnytimeError(f"cannot read the tokenizer {path} ({exc}); give a tokenizer.json `anytime train` "
                           "wrote") from None  # fmt: skip


def run_splits(run: LoadedRun) -> DatasetSplits:
    """A trained run's splits, refused where the data or the tokenizer changed since it was trained (its validation
    split might no longer be held out)."""
    splits = load_splits(run.config, run.run_dir)
    trained_on = run.dataset.get("fingerprint")
    if trained_on is not None and splits.info.fingerprint != trained_on:
        raise AnytimeError(
            f"the {splits.info.name} data at {splits.info.source} changed since {run.run_dir} was trained; "
            "its validation split may no longer be held out, so train again on the current data"
        )
    if splits.info.tokenizer != run.dataset.get("tokenizer", ""):
        raise AnytimeError(f"{run.run_dir / TOKENIZER_FILE} is not the tokenizer {run.run_dir} was trained with "
                           "(another run's?); put the run's own tokenizer.json back, or train again")  # fmt: skip
    return splits


def run_tokenizer(run_dir: str | Path) -> str | None:
    """The JSON of a text run's own tokenizer (refused when it is gone; None for a run that has none)."""
    config, _ = run_config(run_dir)
    return read_tokenizer(config, run_dir)
