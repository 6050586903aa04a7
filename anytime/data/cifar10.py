"""CIFAR-10 and CIFAR-100 from disk (never downloaded): torchvision's python batches or an image-folder tree."""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from anytime.data.base import RawDataset
from anytime.data.imagefolder import cached_arrays, is_image_folder, load_folder
from anytime.errors import AnytimeError

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
CIFAR10_MEAN: tuple[float, ...] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, ...] = (0.2470, 0.2435, 0.2616)
BATCH_DIR = "cifar-10-batches-py"
TRAIN_BATCHES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META_FILE = "batches.meta"
FORMATS = (
    f"torchvision's python batches ({BATCH_DIR}/ with {TRAIN_BATCHES[0]}..5 and {TEST_BATCH}, or its parent folder)"
    " or an image folder with train/<class>/* and test/<class>/*"
)

# Only what is needed to rebuild numpy arrays (and plain containers); anything else, such as
# os.system, is refused so that a malicious batch file cannot run code.
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
        ("builtins", "bytes"),
        ("builtins", "bytearray"),
        ("builtins", "dict"),
        ("builtins", "list"),
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}")
        return super().find_class(module, name)


def safe_unpickle(path: Path) -> Any:
    """Unpickle a CIFAR batch file, allowing only the globals that rebuild numpy arrays."""
    try:
        data = path.read_bytes()
        return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except pickle.UnpicklingError as error:
        raise AnytimeError(f"refusing to load {path}: {error}; it is not a genuine CIFAR batch file") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise AnytimeError(f"cannot read CIFAR batch {path} ({type(error).__name__}: {error})") from None


def _get(batch: Any, key: str, path: Path) -> Any:
    if isinstance(batch, dict):
        for k in (key.encode(), key):
            if k in batch:
                return batch[k]
    raise AnytimeError(f"{path} has no {key!r} entry; it is not a CIFAR python batch")


def _read_batch(path: Path, label_key: str = "labels", classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    batch = safe_unpickle(path)
    data = np.asarray(_get(batch, "data", path))
    labels = np.asarray(_get(batch, label_key, path), dtype=np.int64)
    what = f"CIFAR-{classes}"
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise AnytimeError(f"{path} does not hold uint8 [N, 3072] data with N labels; it is not a {what} batch")
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise AnytimeError(f"{path} has labels outside 0..{classes - 1}; it is not a {what} batch")
    return data.reshape(-1, 3, 32, 32), labels


def _batch_dir(path: Path) -> Path | None:
    for candidate in (path, path / BATCH_DIR):
        if (candidate / TRAIN_BATCHES[0]).is_file() and (candidate / TEST_BATCH).is_file():
            return candidate
    return None


def _batch_fingerprint(folder: Path) -> str:
    digest = hashlib.sha1()
    with os.scandir(folder) as entries:
        stats = sorted((e.name, e.stat()) for e in entries if e.is_file() and not e.name.startswith("."))
    for name, st in stats:
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _load_batches(folder: Path) -> dict[str, np.ndarray]:
    missing = [name for name in (*TRAIN_BATCHES, TEST_BATCH) if not (folder / name).is_file()]
    if missing:
        raise AnytimeError(f"{folder} lacks {', '.join(missing)}; a complete {BATCH_DIR} folder is needed")
    parts = [_read_batch(folder / name) for name in TRAIN_BATCHES]
    test_images, test_labels = _read_batch(folder / TEST_BATCH)
    return {
        "train_images": np.concatenate([p[0] for p in parts]),
        "train_labels": np.concatenate([p[1] for p in parts]),
        "test_images": test_images,
        "test_labels": test_labels,
    }


def _class_names(folder: Path) -> tuple[str, ...]:
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        return CIFAR10_CLASSES
    names = _get(safe_unpickle(meta_path), "label_names", meta_path)
    decoded = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return decoded if len(decoded) == 10 else CIFAR10_CLASSES


def candidate_roots(root: str | os.PathLike[str] | None) -> list[Path]:
    """The paths tried for CIFAR-10: ``root`` if given, else ``$ANYTIME_CIFAR10`` (if set), ``./data/cifar10``
    and ``../shared/data/cifar10``, relative to the current directory."""
    if root is not None:
        return [Path(root).expanduser()]
    candidates = []
    env = os.environ.get("ANYTIME_CIFAR10")
    if env:
        candidates.append(Path(env).expanduser())
    candidates += [Path("data") / "cifar10", Path("..") / "shared" / "data" / "cifar10"]
    return candidates


def load_cifar10(
    root: str | os.PathLike[str] | None,
    *,
    image_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> RawDataset:
    """Find CIFAR-10 on disk (see :func:`candidate_roots`) and decode it, through the uint8 cache."""
    tried = []
    for candidate in candidate_roots(root):
        resolved = candidate.resolve()
        tried.append(str(resolved))
        batches = _batch_dir(resolved)
        if batches is not None:
            fingerprint = _batch_fingerprint(batches)
            arrays = cached_arrays(
                "cifar10-py", batches, fingerprint, functools.partial(_load_batches, batches),
                image_size=None, cache_dir=cache_dir,
            )  # fmt: skip
            return RawDataset(
                name="cifar10", classes=_class_names(batches),
                train_images=arrays["train_images"], train_labels=arrays["train_labels"],
                test_images=arrays["test_images"], test_labels=arrays["test_labels"],
                hflip=True, source=str(batches), fingerprint=fingerprint,
                mean=CIFAR10_MEAN, std=CIFAR10_STD,
            )  # fmt: skip
        if is_image_folder(resolved):
            raw = load_folder(resolved, name="cifar10", image_size=image_size, cache_dir=cache_dir, hflip=True)
            if len(raw.classes) != 10:
                raise AnytimeError(
                    f"{resolved} holds {len(raw.classes)} classes, CIFAR-10 has 10; load it with the 'folder' dataset"
                )
            return RawDataset(**{**raw.__dict__, "mean": CIFAR10_MEAN, "std": CIFAR10_STD})
    raise AnytimeError(
        f"no CIFAR-10 found (tried {'; '.join(tried)}); expected {FORMATS}; "
        "pass the path with --data-root or set ANYTIME_CIFAR10 (nothing is downloaded)"
    )


CIFAR100_MEAN: tuple[float, ...] = (0.5071, 0.4865, 0.4409)
CIFAR100_STD: tuple[float, ...] = (0.2673, 0.2564, 0.2762)
CIFAR100_DIR = "cifar-100-python"
CIFAR100_FORMATS = (
    f"torchvision's {CIFAR100_DIR}/ folder (files train, test and meta) or its parent, or an image folder with "
    "train/<class>/* and test/<class>/* of 100 classes"
)


def _cifar100_dir(path: Path) -> Path | None:
    for candidate in (path, path / CIFAR100_DIR):
        if (candidate / "train").is_file() and (candidate / "test").is_file():
            return candidate
    return None


def _load_cifar100(folder: Path) -> dict[str, np.ndarray]:
    train_images, train_labels = _read_batch(folder / "train", "fine_labels", 100)
    test_images, test_labels = _read_batch(folder / "test", "fine_labels", 100)
    return {"train_images": train_images, "train_labels": train_labels, "test_images": test_images,
            "test_labels": test_labels}  # fmt: skip


def _cifar100_names(folder: Path) -> tuple[str, ...]:
    meta_path = folder / "meta"
    if meta_path.is_file():
        names = _get(safe_unpickle(meta_path), "fine_label_names", meta_path)
        decoded = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
        if len(decoded) == 100:
            return decoded
    return tuple(f"class{i}" for i in range(100))


def load_cifar100(
    root: str | os.PathLike[str] | None,
    *,
    image_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> RawDataset:
    """Find CIFAR-100 (its 100 fine labels) on disk: ``root`` if given, else ``$ANYTIME_CIFAR100``,
    ``./data/cifar100`` and ``../shared/data/cifar100``; decoded through the uint8 cache."""
    candidates = [Path(root).expanduser()] if root is not None else [
        *([Path(os.environ["ANYTIME_CIFAR100"]).expanduser()] if os.environ.get("ANYTIME_CIFAR100") else []),
        Path("data") / "cifar100", Path("..") / "shared" / "data" / "cifar100",
    ]  # fmt: skip
    tried = []
    for candidate in candidates:
        resolved = candidate.resolve()
        tried.append(str(resolved))
        folder = _cifar100_dir(resolved)
        if folder is not None:
            fingerprint = _batch_fingerprint(folder)
            arrays = cached_arrays("cifar100-py", folder, fingerprint, functools.partial(_load_cifar100, folder),
                                   image_size=None, cache_dir=cache_dir)  # fmt: skip
            return RawDataset(
                name="cifar100", classes=_cifar100_names(folder),
                train_images=arrays["train_images"], train_labels=arrays["train_labels"],
                test_images=arrays["test_images"], test_labels=arrays["test_labels"],
                hflip=True, source=str(folder), fingerprint=fingerprint, mean=CIFAR100_MEAN, std=CIFAR100_STD,
            )  # fmt: skip
        if is_image_folder(resolved):
            raw = load_folder(resolved, name="cifar100", image_size=image_size, cache_dir=cache_dir, hflip=True)
            if len(raw.classes) != 100:
                raise AnytimeError(f"{resolved} holds {len(raw.classes)} classes, CIFAR-100 has 100; load it with "
                                   "the 'folder' dataset")  # fmt: skip
            return RawDataset(**{**raw.__dict__, "mean": CIFAR100_MEAN, "std": CIFAR100_STD})
    raise AnytimeError(
        f"no CIFAR-100 found (tried {'; '.join(tried)}); put {CIFAR100_FORMATS} at ../shared/data/cifar100 or "
        "./data/cifar100, or pass --data-root PATH or set ANYTIME_CIFAR100 (nothing is downloaded)"
    )
