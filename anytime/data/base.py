"""Dataset containers and the seeded, stratified splitting shared by every dataset."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.errors import AnytimeError

SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")


@dataclass(frozen=True)
class DatasetInfo:
    """What a model and a report need to know about a loaded dataset."""

    name: str
    num_classes: int
    in_channels: int
    image_size: tuple[int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool
    source: str
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (tuples become lists)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


@dataclass(frozen=True)
class Split:
    """One split held in memory as uint8 images and int64 labels.

    ``indices`` (optional) are the positions of the samples in the source's original
    training set (train/val) or test set (test); for digits, in the whole 1,797-image set.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(f"split {self.name}: images must be uint8 [N,C,H,W], got {self.images.dtype} "
                             f"{tuple(self.images.shape)}")  # fmt: skip
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"split {self.name}: labels must be int64 [N] matching the images")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def sample(self, count: int | None, seed: int = 0) -> Split:
        """``count`` samples drawn at random (seeded), in random order, so that any prefix is a random sample too;
        the whole split if ``count`` is None or not smaller. A split stored class by class (an image folder's test
        split is) must not be scored on its first classes only."""
        if count is None or count >= len(self):
            return self
        chosen = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:count]
        indices = None if self.indices is None else self.indices[chosen]
        return Split(self.name, self.images[chosen], self.labels[chosen], indices)


@dataclass(frozen=True)
class DatasetSplits:
    """The train, validation and test splits of one dataset, with its description."""

    info: DatasetInfo
    train: Split
    val: Split
    test: Split

    def split(self, name: str) -> Split:
        """The split called ``name`` ("train", "val" or "test")."""
        if name not in SPLIT_NAMES:
            raise AnytimeError(f"unknown split {name!r}; choose one of {', '.join(SPLIT_NAMES)}")
        return getattr(self, name)


@dataclass(frozen=True)
class RawDataset:
    """A decoded source before splitting: numpy uint8 [N,C,H,W] images and int64 labels.

    ``test_images`` is None for sources without an official test split (a test split is carved).
    ``mean``/``std`` None means: compute them from the final training split.
    """

    name: str
    classes: tuple[str, ...]
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray | None
    test_labels: np.ndarray | None
    hflip: bool
    source: str
    fingerprint: str
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


def stratified_pick(labels: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pick ``count`` indices with class proportions kept; return ``(picked, rest)``, both sorted.

    Each class contributes its proportional share, rounded by largest remainder so that the
    total is exactly ``count``; which samples of a class are picked is drawn with ``seed``.
    """
    labels = np.asarray(labels)
    total = len(labels)
    count = max(0, min(int(count), total))
    rng = np.random.default_rng(seed)
    classes, per_class = np.unique(labels, return_counts=True)
    exact = per_class * (count / total) if total else per_class.astype(float)
    take = np.floor(exact).astype(np.int64)
    short = count - int(take.sum())
    if short > 0:
        # Largest remainder first; ties broken by a seeded draw rather than by class order.
        tiebreak = rng.random(len(classes))
        order = np.lexsort((tiebreak, -(exact - take)))
        take[order[:short]] += 1
    picked = []
    for cls, k in zip(classes, take):
        members = np.flatnonzero(labels == cls)
        picked.append(rng.permutation(members)[:k])
    chosen = np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
    mask = np.ones(total, dtype=bool)
    mask[chosen] = False
    return chosen.astype(np.int64), np.flatnonzero(mask).astype(np.int64)


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of uint8 images [N,C,H,W], in [0,1] units."""
    means, stds = [], []
    values = np.arange(256, dtype=np.float64)
    for c in range(images.shape[1]):
        # A 256-bin histogram is exact and avoids a float copy of the whole split.
        hist = np.bincount(np.ascontiguousarray(images[:, c]).ravel(), minlength=256).astype(np.float64)
        n = hist.sum()
        if n == 0:
            means.append(0.0)
            stds.append(1.0)
            continue
        mean = float((hist * values).sum() / n)
        var = float((hist * values**2).sum() / n) - mean**2
        means.append(mean / 255.0)
        stds.append(max(float(np.sqrt(max(var, 0.0))) / 255.0, 1e-3))
    return tuple(means), tuple(stds)


def default_cache_dir() -> Path:
    """``$ANYTIME_CACHE`` if set, else ``~/.cache/anytime`` (read at call time)."""
    env = os.environ.get("ANYTIME_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "anytime"


def make_split(name: str, images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> Split:
    """Wrap numpy arrays as a :class:`Split` of contiguous CPU tensors."""
    return Split(
        name=name,
        images=torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        indices=torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)),
    )
