"""What `anytime train` trains when no model or card is named: a default recipe per modality, and the least
number of optimizer steps the image recipe runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from anytime.data import DatasetSplits
from anytime.train.cards import ModelCard, load_card
from anytime.train.config import TrainConfig
from anytime.train.splits import load_splits

DEFAULT_TEXT_CARD = "text-ngram-exits"  # sst2 and textfolder data
DEFAULT_IMAGE_CARD = "image-lenet"  # any other data
# The default image recipe runs at least this many optimizer steps unless its epochs are named: a fixed number of
# epochs leaves a network untrained on a small folder (10 epochs were 110 steps on the 1,294 training digits).
DEFAULT_IMAGE_MIN_STEPS = 2000
TEXT_DATA: tuple[str, ...] = ("sst2", "textfolder")


def default_card(data: str | None) -> tuple[ModelCard, str]:
    """The card trained on ``data`` (None: the embedded digits) when no model is named, and a line that says so."""
    text = data in TEXT_DATA
    card = load_card(DEFAULT_TEXT_CARD if text else DEFAULT_IMAGE_CARD)
    return card, (f"no model named: training the {'small-data text' if text else 'default image'} recipe, card "
                  f"{card.name} (its model {card.config.model}); name one with --model or --card")  # fmt: skip


@dataclass(frozen=True)
class StepFloor:
    """A recipe with its epochs raised to reach a number of optimizer steps on its data."""

    config: TrainConfig
    splits: DatasetSplits  # what it was counted on, for the trainer (not loaded twice)
    note: str  # "" when the epochs were not raised


def at_least_steps(config: TrainConfig, steps: int | None = None) -> StepFloor:
    """``config`` with its epochs raised so that it runs at least ``steps`` (default ``DEFAULT_IMAGE_MIN_STEPS``)
    optimizer steps on its training split."""
    steps = DEFAULT_IMAGE_MIN_STEPS if steps is None else steps
    splits = load_splits(config)
    per_epoch = math.ceil(len(splits.train) / config.batch_size)
    epochs = max(config.epochs, math.ceil(steps / per_epoch))
    note = (f"{len(splits.train):,} training images make {per_epoch} steps an epoch: {epochs} epochs, for at least "
            f"{steps:,} steps (--epochs N sets them)")  # fmt: skip
    return StepFloor(config.replace(epochs=epochs), splits, note if epochs > config.epochs else "")
