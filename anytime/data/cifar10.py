"""CIFAR-10 from disk (never downloaded): torchvision's python batches or an image-folder tree."""

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
        raise AnytimeError(f"refusing to load {path}: {error}; it is not a genuine CIFAR-10 batch file") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise AnytimeError(f"cannot read CIFAR-10 batch {path} ({type(error).__name__}: {error})") from None


def _get(batch: Any, key: str, path: Path) -> Any:
    if isinstance(batch, dict):
        for k in (key.encode(), key):
            if k in batch:
                return batch[k]
    raise AnytimeError(f"{path} has no {key!r} entry; it is not a CIFAR-10 python batch")


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = safe_unpickle(path)
    data = np.asarray(_get(batch, "data", path))
    labels = np.asarray(_get(batch, "labels", path), dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise AnytimeError(f"{path} does not hold uint8 [N, 3072] data with N labels; it is not a CIFAR-10 batch")
    if len(labels) and (labels.min() < 0 or labels.max() >= 10):
        raise AnytimeError(f"{path} has labels outside 0..9; it is not a CIFAR-10 batch")
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
