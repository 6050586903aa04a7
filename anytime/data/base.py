"""Dataset containers and the seeded, stratified splitting shared by every dataset."""

from __future__ import annotations

import abc
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
    # Text datasets (``modality="text"``): samples are token ids; see :mod:`anytime.data.text`.
    modality: str = "image"
    vocab_size: int = 0
    max_length: int = 0
    tokenizer: str = ""  # SHA-1 of the tokenizer's JSON
    truncated: tuple[tuple[str, int], ...] = ()  # sentences cut to max_length, per split
    empty_lines: tuple[tuple[str, int], ...] = ()  # blank lines and empty sentences skipped, per split

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: ``(C, H, W)`` for images, ``(max_length,)`` for token ids."""
        return (self.max_length,) if self.modality == "text" else (self.in_channels, *self.image_size)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (tuples become lists); the text fields only for text."""
        out = asdict(self)
        if self.modality != "text":
            for key in ("modality", "vocab_size", "max_length", "tokenizer", "truncated", "empty_lines"):
                del out[key]
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = [list(v) if isinstance(v, tuple) else v for v in value]
        return out


class ImageStore(abc.ABC):
    """Images read on demand instead of held in memory: a uint8 [N,C,H,W] array that reads only the samples asked
    for (shards on disk, an image folder decoded per batch).

    It answers what :class:`Split` and the batch loader ask of an images tensor: ``shape``, ``dtype``, ``dim()``,
    ``len()``, ``index_select(0, idx)`` and indexing with an int, a slice or an index tensor, each of which reads
    those samples into a new tensor. :meth:`subset` is a view that reads nothing. Stores are picklable (for
    DataLoader workers) and open their files anew in each process.
    """

    dtype: torch.dtype = torch.uint8

    @property
    @abc.abstractmethod
    def shape(self) -> torch.Size:
        """``(N, C, H, W)``."""

    @abc.abstractmethod
    def read(self, positions: np.ndarray) -> torch.Tensor:
        """Samples ``positions`` (int64 [K], each in ``[0, N)``) as a new uint8 [K,C,H,W] tensor."""

    @abc.abstractmethod
    def subset(self, positions: np.ndarray) -> ImageStore:
        """A view of samples ``positions`` (int64 [K]) in that order; nothing is read."""

    _positions: np.ndarray | None = None  # a view's samples, as positions in the whole store

    def _global(self, positions: np.ndarray) -> np.ndarray:
        """The whole store's positions of this view's ``positions`` (checked to be in range)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"image index out of range for {len(self)} images")
        return positions if self._positions is None else self._positions[positions]

    def dim(self) -> int:
        """Always 4."""
        return 4

    def __len__(self) -> int:
        return int(self.shape[0])

    def _index_positions(self, index: Any) -> np.ndarray:
        count = len(self)
        if isinstance(index, slice):
            return np.arange(*index.indices(count), dtype=np.int64)
        picked = np.asarray(index.cpu().numpy() if isinstance(index, torch.Tensor) else index)
        if picked.dtype == np.bool_:
            if picked.shape != (count,):
                raise IndexError(f"a boolean index of {picked.shape} does not match {count} images")
            return np.flatnonzero(picked).astype(np.int64)
        picked = picked.astype(np.int64, copy=False).reshape(-1)
        if picked.size and (picked.min() < -count or picked.max() >= count):
            raise IndexError(f"image index out of range for {count} images")
        return np.where(picked < 0, picked + count, picked)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Samples ``index`` (dim 0 only) as a new tensor, like ``torch.Tensor.index_select``."""
        if dim != 0:
            raise ValueError(f"an image store selects along dimension 0 only, not {dim}")
        return self.read(self._index_positions(index))

    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, tuple):
            return self[key[0]][(slice(None), *key[1:]) if not isinstance(key[0], int) else key[1:]]
        if isinstance(key, (int, np.integer)) or (isinstance(key, torch.Tensor) and key.dim() == 0):
            position = int(key)
            if not -len(self) <= position < len(self):
                raise IndexError(f"image {position} out of range for {len(self)} images")
            return self.read(np.array([position % len(self)], dtype=np.int64))[0]
        return self.read(self._index_positions(key))


def take_images(images: torch.Tensor | ImageStore, positions: np.ndarray | torch.Tensor) -> torch.Tensor | ImageStore:
    """Samples ``positions`` of ``images``: a tensor's are copied, a store's are a view (nothing is read)."""
    if isinstance(images, ImageStore):
        return images.subset(np.asarray(positions.numpy() if isinstance(positions, torch.Tensor) else positions,
                                        dtype=np.int64))  # fmt: skip
    index = (
        positions if isinstance(positions, torch.Tensor) else torch.from_numpy(np.asarray(positions, dtype=np.int64))
    )
    return images[index]


@dataclass(frozen=True)
class Split:
    """One split: uint8 images [N,C,H,W] (or, for text, int64 token ids [N,L]) and int64 labels.

    ``images`` is a tensor held in memory, or an :class:`ImageStore` that reads each batch's samples when asked
    (data larger than memory). ``indices`` (optional) are the positions of the samples in the source's original
    training set (train/val) or test set (test); for digits, in the whole 1,797-image set.
    """

    name: str
    images: torch.Tensor | ImageStore
    labels: torch.Tensor
    indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = self.images.dtype == torch.int64 and self.images.dim() == 2
        if not tokens and (self.images.dtype != torch.uint8 or self.images.dim() != 4):
            raise ValueError(f"split {self.name}: images must be uint8 [N,C,H,W] or token ids int64 [N,L], got "
                             f"{self.images.dtype} {tuple(self.images.shape)}")  # fmt: skip
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
        return Split(self.name, take_images(self.images, chosen), self.labels[chosen], indices)


@dataclass(frozen=True)
class DatasetSplits:
    """The train, validation and test splits of one dataset, with its description; a text dataset may have a
    ``dev`` split too (held out, never trained on) and carries its tokenizer's JSON."""

    info: DatasetInfo
    train: Split
    val: Split
    test: Split
    dev: Split | None = None
    tokenizer: str | None = None

    def split(self, name: str) -> Split:
        """The split called ``name`` ("train", "val", "test", or "dev" where the dataset has one)."""
        if name == "dev" and self.dev is not None:
            return self.dev
        if name not in SPLIT_NAMES:
            extra = ", dev" if self.dev is not None else ""
            raise AnytimeError(f"unknown split {name!r}; choose one of {', '.join(SPLIT_NAMES)}{extra}")
        return getattr(self, name)


@dataclass(frozen=True)
class RawDataset:
    """A decoded source before splitting: numpy uint8 [N,C,H,W] images and int64 labels.

    ``test_images`` is None for sources without an official test split (a test split is carved).
    ``mean``/``std`` None means: compute them from the final training split. Sources read on demand give
    :class:`ImageStore` images (and their ``mean``/``std``).
    """

    name: str
    classes: tuple[str, ...]
    train_images: np.ndarray | ImageStore
    train_labels: np.ndarray
    test_images: np.ndarray | ImageStore | None
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


def make_split(name: str, images: np.ndarray | ImageStore, labels: np.ndarray, indices: np.ndarray) -> Split:
    """Wrap numpy arrays as a :class:`Split` of contiguous CPU tensors (an :class:`ImageStore` is kept as it is);
    2-D ``images`` are token ids."""
    return Split(
        name=name,
        images=images
        if isinstance(images, ImageStore)
        else torch.from_numpy(
            np.ascontiguousarray(images, dtype=np.int64 if images.ndim == 2 else np.uint8)
        ),  # 2-D: token ids
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        indices=torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)),
    )
