"""Image-folder trees (``train/<class>/*``, ``test/<class>/*``): scan, fingerprint, decode once, cache as uint8.

The decoded arrays are stored in an ``.npz`` file in the cache folder, keyed by the resolved
source path and the requested image size. The file also records a fingerprint of the source
made from ``stat`` alone (relative path, size, mtime of every file), so a cached copy is
rebuilt when a file is added, removed or modified, without reading any image.

:func:`stream_folder` decodes nothing up front: its :class:`FolderImages` decode each batch's files when the
loader asks (in DataLoader workers when it has some), for data too large to hold and read only once.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from anytime.data.base import ImageStore, RawDataset, channel_stats, default_cache_dir
from anytime.errors import AnytimeError
from anytime.utils.io import atomic_path

IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)
CACHE_VERSION = 2  # 2: grey images saved as RGB or palette decode to one channel
STREAM_STATS_IMAGES = 1000  # training images decoded for a streamed folder's mean and std
# Below this many files a process pool costs more than it saves.
_POOL_MIN_FILES = 2000

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class FolderScan:
    """The image files of a tree, in a fixed order, with the classes and two fingerprints: ``fingerprint``
    names the data (file names and sizes, so a copy of the tree that changed only modification times is the
    same data and its runs' splits still hold), ``stamp`` adds the modification times (the decoded cache is
    rebuilt when a file may have been rewritten)."""

    root: Path
    classes: tuple[str, ...]
    train: tuple[tuple[str, int], ...]  # (relative path, class index)
    test: tuple[tuple[str, int], ...]
    fingerprint: str
    stamp: str


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _list_images(folder: str) -> list[tuple[str, os.stat_result]]:
    """Image files below ``folder`` (recursively), hidden entries skipped, sorted by path."""
    found: list[tuple[str, os.stat_result]] = []
    stack = [folder]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if not _visible(entry.name):
                    continue
                if entry.is_dir():
                    stack.append(entry.path)
                elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS and entry.is_file():
                    found.append((entry.path, entry.stat()))
    found.sort(key=lambda item: item[0])
    return found


def _class_dirs(split_dir: Path) -> list[str]:
    with os.scandir(split_dir) as entries:
        return sorted(e.name for e in entries if _visible(e.name) and e.is_dir())


def is_image_folder(root: str | os.PathLike[str]) -> bool:
    """True if ``root`` has ``train/`` and ``test/`` subfolders."""
    path = Path(root)
    return (path / "train").is_dir() and (path / "test").is_dir()


def scan_folder(root: str | os.PathLike[str]) -> FolderScan:
    """List a ``train/<class>/*`` + ``test/<class>/*`` tree and fingerprint it from ``stat`` alone."""
    base = Path(root).expanduser().resolve()
    if not is_image_folder(base):
        raise AnytimeError(
            f"{base} is not an image folder: expected {base}/train/<class>/<image> and {base}/test/<class>/<image>"
        )
    train_classes = _class_dirs(base / "train")
    test_classes = _class_dirs(base / "test")
    if train_classes != test_classes:
        only_train = sorted(set(train_classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(train_classes))
        raise AnytimeError(
            f"train and test in {base} must hold the same class folders; only in train: {only_train or 'none'}, "
            f"only in test: {only_test or 'none'}"
        )
    if len(train_classes) < 2:
        raise AnytimeError(f"{base}/train needs at least 2 class folders, found {len(train_classes)}")
    digest, stamp = hashlib.sha1(), hashlib.sha1()
    prefix = len(os.path.join(str(base), ""))  # slicing is much faster than os.path.relpath over 60,000 files
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "test": []}
    for split in ("train", "test"):
        for label, cls in enumerate(train_classes):
            files = _list_images(str(base / split / cls))
            if split == "train" and not files:
                kinds = ", ".join(sorted(IMAGE_EXTENSIONS))
                raise AnytimeError(f"{base / split / cls} holds no images; expected files ending in {kinds}")
            for path, st in files:
                rel = path[prefix:]
                splits[split].append((rel, label))
                digest.update(f"{rel}\0{st.st_size}\n".encode("utf-8", "surrogateescape"))
                stamp.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    if not splits["test"]:
        raise AnytimeError(f"{base}/test holds no images; put test images in {base}/test/<class>/")
    return FolderScan(
        root=base,
        classes=tuple(train_classes),
        train=tuple(splits["train"]),
        test=tuple(splits["test"]),
        fingerprint=digest.hexdigest(),
        stamp=stamp.hexdigest(),
    )


def decode_image_file(job: tuple[str, int | None]) -> tuple[str, np.ndarray | str]:
    """Decode one file to uint8 HxW (grey) or HxWx3 (colour); on failure return the error text."""
    from PIL import Image

    path, size = job
    try:
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            if mode in ("L", "1", "I", "I;16", "F", "LA"):
                img = img.convert("L")
            elif mode != "RGB":
                img = img.convert("RGB")
            if size is not None and img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            return path, np.asarray(img, dtype=np.uint8)
    except Exception as error:  # noqa: BLE001 - any decode failure becomes a user-facing message
        return path, f"{type(error).__name__}: {error}"


def _decode_all(paths: list[str], image_size: int | None, workers: int) -> list[np.ndarray]:
    jobs = [(p, image_size) for p in paths]
    if workers > 1 and len(jobs) >= _POOL_MIN_FILES:
        with multiprocessing.get_context().Pool(workers) as pool:
            results = pool.map(decode_image_file, jobs, chunksize=512)
    else:
        results = [decode_image_file(job) for job in jobs]
    arrays = []
    for path, result in results:
        if isinstance(result, str):
            raise AnytimeError(f"cannot decode image {path} ({result}); remove or replace the file")
        arrays.append(result)
    return arrays


def _equal_channels(rgb: np.ndarray) -> bool:
    return bool((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())


def decode_folder(scan: FolderScan, image_size: int | None = None) -> Arrays:
    """Decode every image of ``scan`` into uint8 [N,C,H,W] arrays (1 channel if all are grey, else RGB)."""
    paths = [str(scan.root / rel) for rel, _ in scan.train + scan.test]
    workers = min(2, os.cpu_count() or 1)
    arrays = _decode_all(paths, image_size, workers)
    sizes = {a.shape[:2] for a in arrays}
    if len(sizes) > 1:
        shown = ", ".join(f"{h}x{w}" for h, w in sorted(sizes)[:4])
        raise AnytimeError(
            f"images in {scan.root} differ in image size ({shown}{', ...' if len(sizes) > 4 else ''}); "
            "pass image_size (--image-size N) to resize them all to NxN"
        )
    # Grey pictures saved as RGB or as a palette (equal channels everywhere) stay one channel, as true grey files.
    grey = all(a.ndim == 2 or _equal_channels(a) for a in arrays)
    channels = 1 if grey else 3
    h, w = next(iter(sizes))
    out = np.empty((len(arrays), channels, h, w), dtype=np.uint8)
    for i, a in enumerate(arrays):
        # In a colour set, a grey file is replicated to RGB, as PIL's convert("RGB") does.
        out[i] = a[None] if a.ndim == 2 else (a[None, :, :, 0] if grey else a.transpose(2, 0, 1))
    n_train = len(scan.train)
    return {
        "train_images": out[:n_train],
        "train_labels": np.array([lab for _, lab in scan.train], dtype=np.int64),
        "test_images": out[n_train:],
        "test_labels": np.array([lab for _, lab in scan.test], dtype=np.int64),
    }


def cache_path_for(
    kind: str,
    root: str | os.PathLike[str],
    image_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Where the decoded arrays of source ``root`` (dataset ``kind``) at ``image_size`` are cached."""
    resolved = str(Path(root).expanduser().resolve())
    key = hashlib.sha1(f"{kind}\0{resolved}\0{image_size}\0v{CACHE_VERSION}".encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return folder / f"{kind}-{key}.npz"


def _read_cache(path: Path, fingerprint: str) -> Arrays | None:
    try:
        with np.load(path, allow_pickle=False) as npz:
            if str(npz["fingerprint"]) != fingerprint or int(npz["version"]) != CACHE_VERSION:
                return None
            return {k: npz[k] for k in npz.files}
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        # A missing, truncated or foreign file is simply rebuilt.
        return None


def cached_arrays(
    kind: str,
    root: Path,
    fingerprint: str,
    build: Callable[[], Arrays],
    *,
    image_size: int | None,
    cache_dir: str | os.PathLike[str] | None,
) -> Arrays:
    """The arrays for ``root`` from the cache if its fingerprint matches, else ``build()`` them and cache them."""
    path = cache_path_for(kind, root, image_size, cache_dir)
    cached = _read_cache(path, fingerprint)
    if cached is not None:
        return cached
    arrays = build()
    payload = dict(arrays, fingerprint=np.array(fingerprint), version=np.array(CACHE_VERSION),
                   source=np.array(str(root)))  # fmt: skip
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, **payload)
    except OSError as error:
        raise AnytimeError(
            f"cannot write the dataset cache {path} ({error}); set ANYTIME_CACHE to a writable folder"
        ) from None
    return arrays


def load_folder(
    root: str | os.PathLike[str],
    *,
    name: str = "folder",
    image_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    hflip: bool = False,
) -> RawDataset:
    """Scan, decode (or take from the cache) and describe an image-folder tree.

    ``hflip``: whether a mirrored image keeps its class. False unless the caller knows the data (a mirrored digit
    or letter is another symbol), so an unknown folder is never trained on mirror images by default."""
    scan = scan_folder(root)
    arrays = cached_arrays(
        name, scan.root, scan.stamp, functools.partial(decode_folder, scan, image_size),
        image_size=image_size, cache_dir=cache_dir,
    )  # fmt: skip
    return RawDataset(
        name=name,
        classes=scan.classes,
        train_images=arrays["train_images"],
        train_labels=arrays["train_labels"],
        test_images=arrays["test_images"],
        test_labels=arrays["test_labels"],
        hflip=hflip,
        source=str(scan.root),
        fingerprint=scan.fingerprint,
    )


class FolderImages(ImageStore):
    """Image files decoded when read: each is converted to RGB and resized to ``image_size`` x ``image_size``
    (PIL's bilinear filter, as the decoded folder dataset does); see :class:`~anytime.data.base.ImageStore`."""

    def __init__(self, paths: tuple[str, ...], image_size: int, positions: np.ndarray | None = None) -> None:
        self._paths = paths
        self._size = int(image_size)
        self._positions = None if positions is None else np.asarray(positions, dtype=np.int64)

    @property
    def shape(self) -> torch.Size:
        """``(N, 3, S, S)`` of this view."""
        count = len(self._paths) if self._positions is None else len(self._positions)
        return torch.Size((count, 3, self._size, self._size))

    def subset(self, positions: np.ndarray) -> FolderImages:
        """A view of ``positions`` of this view; nothing is decoded."""
        return FolderImages(self._paths, self._size, self._global(positions))

    def read(self, positions: np.ndarray) -> torch.Tensor:
        """Images ``positions`` of this view, decoded and resized now into a new tensor."""
        wanted = self._global(positions)
        out = np.empty((len(wanted), 3, self._size, self._size), dtype=np.uint8)
        for i, k in enumerate(wanted.tolist()):
            path, decoded = decode_image_file((self._paths[k], self._size))
            if isinstance(decoded, str):
                raise AnytimeError(f"cannot decode image {path} ({decoded}); remove or replace the file")
            out[i] = decoded[None] if decoded.ndim == 2 else decoded.transpose(2, 0, 1)
        return torch.from_numpy(out)

    def __repr__(self) -> str:
        return f"FolderImages({len(self)} images, decoded at {self._size}x{self._size})"


def stream_folder(
    root: str | os.PathLike[str], *, image_size: int | None, name: str = "folder-stream", hflip: bool = False,
    seed: int = 0,
) -> RawDataset:  # fmt: skip
    """An image-folder tree as a source whose images are decoded per batch (RGB, resized to ``image_size``); its
    mean and std are measured on a seeded sample of up to 1,000 training images."""
    if image_size is None:
        raise AnytimeError("the folder-stream dataset decodes images as batches need them, so it needs "
                           "--image-size N (every image is resized to NxN)")  # fmt: skip
    scan = scan_folder(root)
    train = FolderImages(tuple(str(scan.root / rel) for rel, _ in scan.train), image_size)
    test = FolderImages(tuple(str(scan.root / rel) for rel, _ in scan.test), image_size)
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.permutation(len(train))[:STREAM_STATS_IMAGES])
    mean, std = channel_stats(train.read(sample).numpy())
    return RawDataset(
        name=name,
        classes=scan.classes,
        train_images=train,
        train_labels=np.array([lab for _, lab in scan.train], dtype=np.int64),
        test_images=test,
        test_labels=np.array([lab for _, lab in scan.test], dtype=np.int64),
        hflip=hflip,
        source=str(scan.root),
        fingerprint=scan.fingerprint,
        mean=mean,
        std=std,
    )
