"""scikit-learn's bundled handwritten digits (1,797 real 8x8 grey images), served as uint8 1x32x32."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from anytime.data.base import RawDataset

DIGITS_SIZE = 32


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels ``[N, 8, 8]`` (0..16, float64) and labels (int64), as ``sklearn.datasets.load_digits``
    gives them. The file it reads is read here without importing scikit-learn, whose import took 1.6 s of a
    2-epoch training's 6.5 s on two cores (every process of a data-parallel run pays it); where the file is not
    where scikit-learn has kept it, its loader is used."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = next((Path(f) / "datasets" / "data" / "digits.csv.gz" for f in folders), None)
    if path is not None and path.is_file():
        with gzip.open(path, "rt") as handle:
            table = np.loadtxt(handle, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def load_digits_raw(image_size: int | None = None) -> RawDataset:
    """All 1,797 digits as one training pool (no official test split; the caller carves one)."""
    pixels, labels = _digits_arrays()  # [N, 8, 8], values 0..16
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
