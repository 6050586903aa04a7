"""The cheap baseline fit beside every training run: what it reaches where a linear model should, that it learns
nothing from labels that carry nothing, and where it shows up (summary, CLI, report, card)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from anytime.data import load_dataset
from anytime.data.base import DatasetInfo, DatasetSplits, Split
from anytime.train.linear_baseline import MAX_PIXEL_FEATURES, PIXEL_L2_GRID, TEXT_C_GRID, Baseline, fit_baseline


@pytest.fixture(scope="module")
def digits() -> DatasetSplits:
    return load_dataset("digits")


def test_pixels_of_the_digits_reach_what_a_linear_model_reaches_and_the_fit_repeats(digits):
    first, again = fit_baseline(digits), fit_baseline(digits)
    assert first.kind == "pixel-logistic" and first.features <= MAX_PIXEL_FEATURES
    assert first.test_acc > 0.93 and first.val_acc is not None and first.val_acc > 0.9  # sklearn's: about 0.96
    assert first.regularisation in PIXEL_L2_GRID and "chosen on validation" in first.description
    assert dataclasses.replace(first, fit_time_s=0) == dataclasses.replace(again, fit_time_s=0)
    assert Baseline.from_dict(json.loads(json.dumps(first.to_dict()))) == first


def test_labels_that_carry_nothing_leave_the_baseline_at_chance(digits):
    rng = np.random.default_rng(0)

    def shuffled(split: Split) -> Split:
        return Split(split.name, split.images, torch.from_numpy(rng.permutation(split.labels.numpy())))

    noise = DatasetSplits(digits.info, shuffled(digits.train), shuffled(digits.val), shuffled(digits.test))
    assert fit_baseline(noise).test_acc < 0.2  # ten classes: chance is 0.1


def _text_splits(val: int = 40) -> DatasetSplits:
    """Token-id sentences whose label is told by one token (3 or 4) among neutral ones (5..20), padded with 0."""
    rng = np.random.default_rng(1)

    def split(name: str, count: int) -> Split:
        ids = np.zeros((count, 12), dtype=np.int64)
        labels = np.arange(count) % 2
        for row, label in enumerate(labels):
            length = int(rng.integers(3, 12))
            ids[row, :length] = rng.integers(5, 21, size=length)
            ids[row, int(rng.integers(0, length))] = 3 + label
        return Split(name, torch.from_numpy(ids), torch.from_numpy(labels))

    info = DatasetInfo(name="toy", num_classes=2, in_channels=1, image_size=(1, 12), classes=("0", "1"), mean=(0.0,),
                       std=(1.0,), hflip=False, source="memory", fingerprint="0" * 40, modality="text",
                       vocab_size=21, max_length=12)  # fmt: skip
    return DatasetSplits(info, split("train", 200), split("val", val), split("test", 100))


def test_text_gets_tfidf_ngrams_and_a_linear_svm():
    baseline = fit_baseline(_text_splits())
    assert baseline.kind == "tfidf-linear-svm" and baseline.regularisation in TEXT_C_GRID
    assert baseline.test_acc == 1.0 and baseline.features > 20  # unigrams and bigrams of the tokens


def test_without_a_validation_split_the_grids_middle_is_taken(digits):
    baseline = fit_baseline(_text_splits(val=0))
    assert baseline.val_acc is None and baseline.regularisation == TEXT_C_GRID[len(TEXT_C_GRID) // 2]
    no_val = DatasetSplits(digits.info, digits.train, digits.val.sample(0), digits.test)
    assert fit_baseline(no_val).regularisation == PIXEL_L2_GRID[len(PIXEL_L2_GRID) // 2]
