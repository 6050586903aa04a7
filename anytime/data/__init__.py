"""Datasets held in memory as uint8 tensors (or read per batch), seeded stratified splits, and a fast batched loader.

``load_dataset(name, root)`` returns train/val/test :class:`Split` objects; ``make_loader``
turns a split into batches of normalised float images (augmented for training). Data larger than memory:
``shards`` (a folder packed by ``prepare_shards``, ``anytime prepare-data``) and ``folder-stream`` (an image
folder decoded per batch) read only each batch's images.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from anytime.data.augment import AUGMENT_POLICIES, Augment, default_augment, normalize, random_crop_flip
from anytime.data.base import (
    DatasetInfo,
    DatasetSplits,
    ImageStore,
    RawDataset,
    Split,
    channel_stats,
    default_cache_dir,
    make_split,
    stratified_pick,
)
from anytime.data.cifar10 import load_cifar10, load_cifar100
from anytime.data.digits import load_digits_raw
from anytime.data.imagefolder import cache_path_for, load_folder, scan_folder, stream_folder
from anytime.data.loader import BatchLoader, Delivery, make_loader
from anytime.data.synthetic import SYNTHETIC_TEST, SYNTHETIC_TRAIN, load_synthetic_raw
from anytime.data.text import TEXT_DATASETS, TextOptions, load_text_dataset
from anytime.errors import AnytimeError
from anytime.utils.resources import check_memory
from anytime.utils.seed import derive_seed

DATASETS: tuple[str, ...] = (
    "digits",
    "cifar10",
    "cifar100",
    "folder",
    "synthetic",
    "shards",
    "folder-stream",
    "sst2",
    "textfolder",
)
# Read per batch, never decoded whole: no memory check, and --image-size must match (shards) or is required.
_ON_DEMAND: tuple[str, ...] = ("shards", "folder-stream")
DIGITS_TEST_FRACTION = 0.2
DIGITS_COUNT = 1797  # scikit-learn's bundled handwritten digits
CIFAR10_COUNT = 60_000
_RESIZE_CHUNK = 4096  # images resized at once (float32)

__all__ = [
    "AUGMENT_POLICIES",
    "DATASETS",
    "Augment",
    "BatchLoader",
    "DatasetInfo",
    "DatasetSplits",
    "Delivery",
    "ImageStore",
    "Split",
    "TextOptions",
    "cache_path_for",
    "default_augment",
    "default_cache_dir",
    "load_dataset",
    "make_loader",
    "normalize",
    "random_crop_flip",
]


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear (antialiased) resize of uint8 [N,C,H,W] to ``size`` x ``size``, in chunks to bound memory."""
    out = np.empty((images.shape[0], images.shape[1], size, size), dtype=np.uint8)
    for start in range(0, images.shape[0], _RESIZE_CHUNK):
        chunk = torch.from_numpy(images[start : start + _RESIZE_CHUNK]).float()
        resized = F.interpolate(chunk, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out[start : start + _RESIZE_CHUNK] = resized.round_().clamp_(0, 255).to(torch.uint8).numpy()
    return out


def _pick(images: np.ndarray | ImageStore, positions: np.ndarray) -> np.ndarray | ImageStore:
    """Samples ``positions``: copied from an array, a view of a store (nothing read)."""
    return images.subset(positions) if isinstance(images, ImageStore) else images[positions]


def _check_image_memory(name: str, root: str | os.PathLike[str] | None, image_size: int) -> None:
    """Refuse an image size whose decoded dataset cannot fit in memory, before any image is decoded: the uint8
    arrays (source, resized, splits) and the float chunks of the resize, or the float arrays a generated
    dataset is drawn in."""
    if name in _ON_DEMAND:
        return
    float_bytes = {"digits": 4, "synthetic": 16}.get(name, 0)  # whole-dataset float arrays while generating
    channels = 1 if name == "digits" else 3
    if name == "digits":
        count = DIGITS_COUNT
    elif name == "synthetic":
        count = SYNTHETIC_TRAIN + SYNTHETIC_TEST
    elif name in ("cifar10", "cifar100"):
        count = CIFAR10_COUNT  # both: 50,000 + 10,000 images
    elif root is not None and Path(root).is_dir():
        scan = scan_folder(root)
        count = len(scan.train) + len(scan.test)
    else:
        return  # the loader says what is missing
    pixels = channels * image_size * image_size
    need = count * pixels * (3 + float_bytes) + min(count, _RESIZE_CHUNK) * pixels * 8
    check_memory(need, f"{count:,} {name} images at {image_size}x{image_size}", "choose a smaller --image-size")


def _load_raw(
    name: str, root: str | os.PathLike[str] | None, *, seed: int, cache_dir: str | os.PathLike[str] | None,
    image_size: int | None,
) -> RawDataset:  # fmt: skip
    if name in ("digits", "synthetic") and root is not None:
        raise AnytimeError(f"the {name} dataset takes no data root (got {root}); leave --data-root out")
    if name == "digits":
        return load_digits_raw(image_size)
    if name == "synthetic":
        return load_synthetic_raw(seed, image_size)
    if name == "cifar10":
        return load_cifar10(root, image_size=image_size, cache_dir=cache_dir)
    if name == "cifar100":
        return load_cifar100(root, image_size=image_size, cache_dir=cache_dir)
    if name == "shards":
        from anytime.data.shard_reader import shard_dataset

        if root is None:
            raise AnytimeError("the shards dataset needs a root: pass --data-root SHARDS, a folder made by "
                               "`anytime prepare-data SRC --image-size S --out SHARDS`")  # fmt: skip
        return shard_dataset(root)
    if name == "folder-stream":
        if root is None:
            raise AnytimeError("the folder-stream dataset needs a root: pass --data-root PATH holding "
                               "train/<class>/* and test/<class>/*")  # fmt: skip
        return stream_folder(root, image_size=image_size, seed=seed)
    if root is None:
        raise AnytimeError(
            "the folder dataset needs a root: pass --data-root PATH holding train/<class>/* and test/<class>/*"
        )
    return load_folder(root, name="folder", image_size=image_size, cache_dir=cache_dir)


def _check_request(name: str, val_fraction: float, image_size: int | None, limit_train: int | None) -> None:
    """One-line errors for a dataset name or split options :func:`load_dataset` cannot take, before any reading."""
    if name not in DATASETS:
        raise AnytimeError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not 0.0 <= val_fraction < 1.0:
        raise AnytimeError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if image_size is not None and image_size < 1:
        raise AnytimeError(f"image_size must be a positive number of pixels, got {image_size}")
    if limit_train is not None and limit_train < 1:
        raise AnytimeError(f"limit_train must be >= 1, got {limit_train}")


def _sized_images(
    name: str, root: str | os.PathLike[str] | None, *, seed: int, cache_dir: str | os.PathLike[str] | None,
    image_size: int | None,
) -> RawDataset:  # fmt: skip
    """The raw dataset, its images resized to ``image_size`` where they are another size (refused for shards,
    which are read as prepared)."""
    if image_size is not None:
        _check_image_memory(name, root, image_size)
    raw = _load_raw(name, root, seed=seed, cache_dir=cache_dir, image_size=image_size)
    train_x = raw.train_images
    if image_size is None or tuple(train_x.shape[2:]) == (image_size, image_size):
        return raw
    if isinstance(train_x, ImageStore):
        size = "x".join(str(v) for v in train_x.shape[2:])
        raise AnytimeError(f"the shards in {root} hold {size} images, not {image_size}x{image_size}; leave "
                           f"--image-size out, or prepare shards at {image_size} into another folder")  # fmt: skip
    test_x = raw.test_images
    return replace(raw, train_images=_resize(train_x, image_size),
                   test_images=None if test_x is None else _resize(test_x, image_size))  # fmt: skip


def _carve(
    name: str, raw: RawDataset, *, val_fraction: float, seed: int, limit_train: int | None
) -> tuple[Split, Split, Split]:
    """The train, validation and test splits of ``raw``: its test split (for digits, a fixed stratified share of
    the training data), a seeded stratified validation carve of the rest, and ``limit_train`` of what is left."""
    train_x, train_y = raw.train_images, raw.train_labels
    test_x, test_y = raw.test_images, raw.test_labels
    if test_x is None or test_y is None:
        count = round(DIGITS_TEST_FRACTION * len(train_y))
        test_idx, pool_idx = stratified_pick(train_y, count, derive_seed("test", name))
        test = make_split("test", _pick(train_x, test_idx), train_y[test_idx], test_idx)
    else:
        pool_idx = np.arange(len(train_y), dtype=np.int64)
        test = make_split("test", test_x, test_y, np.arange(len(test_y), dtype=np.int64))
    pool_y = train_y[pool_idx]
    val_rel, train_rel = stratified_pick(pool_y, round(val_fraction * len(pool_idx)), derive_seed("val", seed))
    val_idx, train_idx = pool_idx[val_rel], pool_idx[train_rel]
    if limit_train is not None and limit_train < len(train_idx):
        keep_rel, _ = stratified_pick(train_y[train_idx], limit_train, derive_seed("limit", seed))
        train_idx = train_idx[keep_rel]
    train = make_split("train", _pick(train_x, train_idx), train_y[train_idx], train_idx)
    val = make_split("val", _pick(train_x, val_idx), train_y[val_idx], val_idx)
    return train, val, test


def _image_info(raw: RawDataset, train: Split) -> DatasetInfo:
    """What an image dataset is: its classes, input shape, and the mean and std that normalise it (from
    preparation where the raw dataset has them, else from the training split)."""
    if raw.mean is not None and raw.std is not None:
        mean, std = raw.mean, raw.std
    else:
        mean, std = channel_stats(train.images.numpy())
    train_x = raw.train_images
    return DatasetInfo(
        name=raw.name,
        num_classes=len(raw.classes),
        in_channels=int(train_x.shape[1]),
        image_size=(int(train_x.shape[2]), int(train_x.shape[3])),
        classes=tuple(raw.classes),
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
        hflip=raw.hflip,
        source=raw.source,
        fingerprint=raw.fingerprint,
    )


def load_dataset(
    name: str,
    root: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    limit_train: int | None = None,
    text: TextOptions | None = None,
) -> DatasetSplits:
    """Load dataset ``name`` into train/val/test splits of uint8 tensors.

    The validation split is carved from the training data (stratified, drawn with ``seed``) and
    is disjoint from train. ``limit_train`` keeps a seeded, stratified subset of that many
    training samples (after the carve). For digits, which has no official test split, a fixed
    stratified 20% test split is carved first; it does not depend on ``seed``, so every run is
    tested on the same images. ``cache_dir`` (cifar10 and folder) defaults to ``$ANYTIME_CACHE``
    or ``~/.cache/anytime``.

    ``shards`` and ``folder-stream`` splits hold an :class:`ImageStore` that reads each batch's images when
    asked; their splits are carved by index, nothing is read, and their mean and std come from preparation
    (shards: every training image) or a seeded sample of training images (folder-stream).

    ``sst2`` and ``textfolder`` are text (:func:`anytime.data.text.load_text_dataset`), encoded as ``text`` says
    (:class:`TextOptions`: the tokenizer's size or the tokenizer itself, and the length of the token ids); image
    datasets take no ``text`` options.
    """
    _check_request(name, val_fraction, image_size, limit_train)
    text = text or TextOptions()
    if name in TEXT_DATASETS:
        if image_size is not None:
            raise AnytimeError(f"{name} is text: it takes --max-length (tokens), not --image-size")
        return load_text_dataset(name, root, val_fraction=val_fraction, seed=seed, cache_dir=cache_dir,
                                 limit_train=limit_train, text=text)  # fmt: skip
    if text != TextOptions():
        raise AnytimeError(f"--vocab-size, --max-length and --tokenizer are for text data; {name} holds images")
    raw = _sized_images(name, root, seed=seed, cache_dir=cache_dir, image_size=image_size)
    train, val, test = _carve(name, raw, val_fraction=val_fraction, seed=seed, limit_train=limit_train)
    return DatasetSplits(info=_image_info(raw, train), train=train, val=val, test=test)
