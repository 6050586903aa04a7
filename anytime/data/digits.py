"""scikit-learn's bundled handwritten digits (1,797 real 8x8 grey images), served as uint8 1x32x32."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F

from anytime.data.base import RawDataset

DIGITS_SIZE = 32


def load_digits_raw(image_size: int | None = None) -> RawDataset:
    """All 1,797 digits as one training pool (no official test split; the caller carves one)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = np.asarray(bunch.images, dtype=np.float64)  # [N, 8, 8], values 0..16
    labels = np.asarray(bunch.target, dtype=np.int64)
    fingerprint = hashlib.sha1(pixels.tobytes() + labels.tobytes()).hexdigest()
    small = torch.from_numpy(np.rint(pixels * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    size = image_size or DIGITS_SIZE
    # Nearest-neighbour upsampling: every original pixel becomes a uniform block, so no intensities
    # are invented and the 8x8 original is recoverable exactly by subsampling.
    images = F.interpolate(small, size=(size, size), mode="nearest-exact").contiguous().numpy()
    return RawDataset(
        name="digits",
        classes=tuple(str(d) for d in range(10)),
        train_images=images,
        train_labels=labels,
        test_images=None,
        test_labels=None,
        hflip=False,
        source="sklearn:load_digits",
        fingerprint=fingerprint,
    )
