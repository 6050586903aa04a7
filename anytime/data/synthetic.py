"""Seeded random images with a learnable class signal, for smoke tests that need no files."""

from __future__ import annotations

import hashlib

import numpy as np

from anytime.data.base import RawDataset
from anytime.utils.seed import derive_seed

SYNTHETIC_TRAIN = 512
SYNTHETIC_TEST = 128
SYNTHETIC_CLASSES = 10
SYNTHETIC_SIZE = 32


def load_synthetic_raw(seed: int = 0, image_size: int | None = None) -> RawDataset:
    """512 train + 128 test uint8 3xSxS images, 10 classes: a class-dependent mean colour and a
    class-dependent horizontal stripe, plus Gaussian noise."""
    size = image_size or SYNTHETIC_SIZE
    rng = np.random.default_rng(derive_seed("synthetic", seed))
    colours = rng.uniform(60, 196, size=(SYNTHETIC_CLASSES, 3))

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.arange(n, dtype=np.int64) % SYNTHETIC_CLASSES
        labels = rng.permutation(labels)
        base = colours[labels][:, :, None, None] + rng.normal(0, 40, size=(n, 3, size, size))
        stripe = max(1, size // SYNTHETIC_CLASSES)
        for k in range(SYNTHETIC_CLASSES):
            top = k * size // SYNTHETIC_CLASSES
            base[labels == k, :, top : top + stripe, :] += 50
        return np.clip(np.rint(base), 0, 255).astype(np.uint8), labels

    train_images, train_labels = draw(SYNTHETIC_TRAIN)
    test_images, test_labels = draw(SYNTHETIC_TEST)
    return RawDataset(
        name="synthetic",
        classes=tuple(f"class{k}" for k in range(SYNTHETIC_CLASSES)),
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        hflip=True,
        source="synthetic",
        fingerprint=hashlib.sha1(f"synthetic:{seed}:{size}".encode()).hexdigest(),
    )
