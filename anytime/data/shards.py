"""Image folders packed offline into fixed-size shards of raw uint8 images, read back one batch at a time.

``prepare_shards(SRC, OUT, image_size=S)`` decodes a ``train/<class>/*`` + ``test/<class>/*`` tree with PIL,
resizes every image to S x S (PIL's bilinear filter, antialiased when shrinking: what the folder dataset does),
and packs each split into files of ``shard_size`` images, raw uint8 [n,3,S,S] (NCHW, the layout of
:class:`~anytime.data.base.Split`), beside one ``SPLIT-labels.npy`` per split and ``manifest.json``:

- ``format``/``version``, ``complete``, the image size, channels (always 3: grey images are replicated, as
  PIL's ``convert("RGB")`` does), the shard size, the classes, the training images' per-channel mean and std
  (exact, from integer sums gathered while packing);
- per split: the image count, the labels file and the shards done, each with its count, bytes, SHA-1 and
  per-channel pixel sums;
- the source: its path, fingerprint (file names and sizes, as the folder dataset's), file count and bytes.

Every file is written under a temporary name and renamed, and the manifest is rewritten after each shard, so an
interrupted preparation re-run with the same arguments does only the shards still missing. A folder holding
shards made with other arguments, or of a source that has changed since, is refused, never overwritten.

:class:`ShardImages` reads the samples a batch asks for with positioned reads (``os.preadv``) into a fresh array:
nothing is mapped, so a training process's memory does not grow with the dataset (the OS page cache holds what
it can, outside the process). ``load_dataset("shards", OUT)`` returns splits over it that the batch loader
augments exactly as it does in-memory data.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.data.base import ImageStore, RawDataset
from anytime.errors import AnytimeError

FORMAT = "anytime-shards"
VERSION = 1
MANIFEST = "manifest.json"
KIND = "shard folder"  # the output-folder kind recorded in the folder's marker
SPLITS: tuple[str, ...] = ("train", "test")
CHANNELS = 3
RESAMPLE = "bilinear"  # PIL's Image.Resampling.BILINEAR, antialiased when shrinking
SHARD_BYTES = 64 * 2**20  # default shard size: as many images as fill this
_ENTRIES = (MANIFEST, "train-*.bin", "test-*.bin", "train-labels.npy", "test-labels.npy")
_MAX_OPEN = 256  # shard files a reader keeps open at once


def _prepare_hint(root: Path | str) -> str:
    return f"make them with `anytime prepare-data SRC --image-size S --out {root}`"


@dataclass(frozen=True)
class ShardFile:
    """One finished shard: its file name (in the shard folder), image count, size in bytes and SHA-1, and the
    per-channel sums of its pixel values and of their squares (integers, for the exact mean and std)."""

    file: str
    count: int
    bytes: int
    sha1: str
    sums: tuple[int, ...]
    squares: tuple[int, ...]


@dataclass(frozen=True)
class ShardSplit:
    """One split's shards: ``count`` images, their labels file and the shards finished so far (in order)."""

    name: str
    count: int
    labels: str
    shards: tuple[ShardFile, ...]


@dataclass(frozen=True)
class ShardManifest:
    """What ``manifest.json`` of a shard folder says; ``root`` is the folder it was read from."""

    root: Path
    image_size: int
    channels: int
    shard_size: int
    classes: tuple[str, ...]
    train: ShardSplit
    test: ShardSplit
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str
    source_fingerprint: str
    source_files: int
    source_bytes: int
    complete: bool
    resample: str = RESAMPLE

    @property
    def image_bytes(self) -> int:
        """Bytes of one packed image."""
        return self.channels * self.image_size * self.image_size

    def split(self, name: str) -> ShardSplit:
        """The ``train`` or ``test`` split."""
        if name not in SPLITS:
            raise AnytimeError(f"shard folders hold the splits {', '.join(SPLITS)}, not {name!r}")
        return getattr(self, name)

    def shard_count(self, name: str) -> int:
        """How many shards split ``name`` has when complete."""
        return -(-self.split(name).count // self.shard_size)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as written (``root`` left out: a shard folder may be moved)."""
        splits = {}
        for name in SPLITS:
            split = self.split(name)
            shards = [{"file": s.file, "count": s.count, "bytes": s.bytes, "sha1": s.sha1, "sums": list(s.sums),
                       "squares": list(s.squares)} for s in split.shards]  # fmt: skip
            splits[name] = {"count": split.count, "labels": split.labels, "shards": shards}
        return {
            "format": FORMAT, "version": VERSION, "complete": self.complete, "image_size": self.image_size,
            "channels": self.channels, "layout": "uint8 NCHW", "resample": self.resample, "shard_size": self.shard_size,
            "classes": list(self.classes), "mean": list(self.mean), "std": list(self.std),
            "source": {"path": self.source, "fingerprint": self.source_fingerprint, "files": self.source_files,
                       "bytes": self.source_bytes},
            "splits": splits,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, root: Path) -> ShardManifest:
        """Parse a manifest document; a wrong or missing field is a one-line :class:`AnytimeError`."""
        where = root / MANIFEST
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise AnytimeError(f"{where} is not an anytime shard manifest (format {found!r}); {_prepare_hint(root)}")
        if doc.get("version") != VERSION:
            raise AnytimeError(f"{where} is shard format version {doc.get('version')!r}, but this anytime reads version "
                               f"{VERSION}; prepare the shards again with this version")  # fmt: skip
        try:
            splits = {}
            for name in SPLITS:
                entry = doc["splits"][name]
                shards = tuple(
                    ShardFile(str(s["file"]), int(s["count"]), int(s["bytes"]), str(s["sha1"]),
                              tuple(int(v) for v in s["sums"]), tuple(int(v) for v in s["squares"]))
                    for s in entry["shards"]
                )  # fmt: skip
                splits[name] = ShardSplit(name, int(entry["count"]), str(entry["labels"]), shards)
            source = doc["source"]
            manifest = cls(
                root=root, image_size=int(doc["image_size"]), channels=int(doc["channels"]),
                shard_size=int(doc["shard_size"]), classes=tuple(str(c) for c in doc["classes"]),
                train=splits["train"], test=splits["test"], mean=tuple(float(m) for m in doc["mean"]),
                std=tuple(float(s) for s in doc["std"]), source=str(source["path"]),
                source_fingerprint=str(source["fingerprint"]), source_files=int(source["files"]),
                source_bytes=int(source["bytes"]), complete=bool(doc["complete"]), resample=str(doc["resample"]),
            )  # fmt: skip
        except KeyError as exc:
            raise AnytimeError(f"{where} lacks the field {exc.args[0]!r}; {_prepare_hint(root)} again") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise AnytimeError(f"{where} has a malformed field ({exc}); {_prepare_hint(root)} again") from None
        if manifest.image_size < 1 or manifest.channels < 1 or manifest.shard_size < 1:
            raise AnytimeError(f"{where} has a malformed field (sizes must be positive); {_prepare_hint(root)} again")
        return manifest


@dataclass(frozen=True)
class PreparedShards:
    """What :func:`prepare_shards` did: the finished manifest, the shards it wrote and those it found already
    done (an earlier run's), and the seconds it took."""

    manifest: ShardManifest
    written: int
    reused: int
    seconds: float


# ---- preparing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    split: str
    index: int
    target: str
    paths: tuple[str, ...] = field(repr=False)
    image_size: int


def _shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def _pixel_stats(images: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    values = np.arange(256, dtype=np.int64)
    sums, squares = [], []
    for c in range(images.shape[1]):
        # A 256-bin histogram gives exact integer sums without a wide copy of the shard.
        hist = np.bincount(images[:, c].ravel(), minlength=256).astype(np.int64)
        sums.append(int((hist * values).sum()))
        squares.append(int((hist * values * values).sum()))
    return tuple(sums), tuple(squares)


def _write_shard(job: _Job) -> ShardFile | tuple[str, str]:
    """Decode, resize and pack one shard (in a worker process); the shard, or (path, error) for a bad image."""
    from anytime.data.imagefolder import decode_image_file
    from anytime.utils.io import atomic_path

    size = job.image_size
    images = np.empty((len(job.paths), CHANNELS, size, size), dtype=np.uint8)
    for i, path in enumerate(job.paths):
        _, decoded = decode_image_file((path, size))
        if isinstance(decoded, str):
            return path, decoded
        images[i] = decoded[None] if decoded.ndim == 2 else decoded.transpose(2, 0, 1)
    sums, squares = _pixel_stats(images)
    payload = memoryview(images.reshape(-1))
    with atomic_path(job.target) as tmp, open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return ShardFile(os.path.basename(job.target), len(job.paths), images.nbytes, hashlib.sha1(payload).hexdigest(),
                     sums, squares)  # fmt: skip


def _file_sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _source_bytes(root: Path, relative: Sequence[str]) -> int:
    return sum(os.stat(root / rel).st_size for rel in relative)


def _describe(manifest: ShardManifest) -> str:
    return (f"shards of {manifest.source} at {manifest.image_size}x{manifest.image_size}, "
            f"{manifest.shard_size} images per shard")  # fmt: skip


def _read_manifest(root: Path) -> ShardManifest | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AnytimeError(f"{path} cannot be read as JSON ({exc}); {_prepare_hint(root)} into a new folder") from None
    return ShardManifest.from_dict(doc, root)


def _check_same_plan(old: ShardManifest, new: ShardManifest, out: Path) -> None:
    """Refuse to mix shards of different arguments or of a changed source in one folder."""
    differences = []
    if old.image_size != new.image_size:
        differences.append(f"--image-size {new.image_size}")
    if old.shard_size != new.shard_size:
        differences.append(f"--shard-size {new.shard_size}")
    if old.channels != new.channels or old.resample != new.resample:
        differences.append("another image layout")
    if (
        old.source_fingerprint != new.source_fingerprint
        or old.classes != new.classes
        or any(old.split(s).count != new.split(s).count for s in SPLITS)
    ):
        differences.append(f"a source that differs ({new.source_files:,} files in {new.source}; "
                           f"{old.source_files:,} then)")  # fmt: skip
    if differences:
        raise AnytimeError(
            f"--out {out} holds {_describe(old)}, not {' and '.join(differences)} as asked; anytime never overwrites "
            "them: choose another --out (or remove that folder yourself)"
        )


def _default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def prepare_shards(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    image_size: int,
    workers: int | None = None,
    shard_size: int | None = None,
    verify: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> PreparedShards:
    """Decode, resize to ``image_size`` x ``image_size`` and pack the image folder ``src`` into shards in ``out``.

    ``workers`` processes (default: the cores, at most 8) each write whole shards of ``shard_size`` images
    (default: as many as fill 64 MiB). ``out`` must be new, empty, or a shard folder of the same source and
    arguments: then only the shards not yet finished are written (``verify`` also re-checks the finished ones'
    SHA-1 and rewrites those that differ). ``on_progress`` receives one line per shard written.
    """
    from anytime.data.imagefolder import scan_folder
    from anytime.utils.io import atomic_path, write_json
    from anytime.utils.outputs import check_output_dir, output_lock, write_marker
    from anytime.utils.resources import check_disk

    started = time.perf_counter()
    if image_size < 1:
        raise AnytimeError(f"--image-size must be a positive number of pixels, got {image_size}")
    workers = _default_workers() if workers is None else workers
    if workers < 1:
        raise AnytimeError(f"--workers must be >= 1, got {workers}")
    image_bytes = CHANNELS * image_size * image_size
    shard_size = max(1, SHARD_BYTES // image_bytes) if shard_size is None else shard_size
    if shard_size < 1:
        raise AnytimeError(f"--shard-size must be >= 1 image, got {shard_size}")
    source = Path(src).expanduser()
    if not source.exists():
        raise AnytimeError(f"no image folder at {source}; give a folder holding train/<class>/* and test/<class>/*")
    if not source.is_dir():
        raise AnytimeError(f"{source} is a file, not an image folder; give a folder holding train/<class>/* and "
                           "test/<class>/*")  # fmt: skip
    target = Path(out).expanduser()
    check_output_dir(target, KIND, flag="--out")  # before the scan: a wrong --out is said at once
    scan = scan_folder(source)
    listed = {"train": scan.train, "test": scan.test}
    plan = ShardManifest(
        root=target, image_size=image_size, channels=CHANNELS, shard_size=shard_size, classes=scan.classes,
        train=ShardSplit("train", len(scan.train), "train-labels.npy", ()),
        test=ShardSplit("test", len(scan.test), "test-labels.npy", ()),
        mean=(), std=(), source=str(scan.root), source_fingerprint=scan.fingerprint,
        source_files=len(scan.train) + len(scan.test),
        source_bytes=_source_bytes(scan.root, [rel for rel, _ in scan.train + scan.test]), complete=False,
    )  # fmt: skip
    target.mkdir(parents=True, exist_ok=True)
    with output_lock(target, command="anytime prepare-data"):
        check_output_dir(target, KIND, flag="--out")  # again, under the lock
        old = _read_manifest(target)
        if old is not None:
            _check_same_plan(old, plan, target)
        write_marker(target, KIND, _ENTRIES)

        done: dict[str, dict[int, ShardFile]] = {name: {} for name in SPLITS}
        for name in SPLITS:
            names = {_shard_name(name, i): i for i in range(plan.shard_count(name))}
            for shard in old.split(name).shards if old is not None else ():
                index = names.get(shard.file)
                if index is None:
                    continue  # not a shard of this plan: left alone, and never read
                path = target / shard.file
                expected = min(shard_size, plan.split(name).count - index * shard_size) * image_bytes
                if shard.bytes != expected or not path.is_file() or path.stat().st_size != expected:
                    continue
                if verify and _file_sha1(path) != shard.sha1:
                    continue
                done[name][index] = shard
        reused = sum(len(d) for d in done.values())

        for name in SPLITS:
            labels = np.array([label for _, label in listed[name]], dtype=np.int64)
            with atomic_path(target / plan.split(name).labels) as tmp, open(tmp, "wb") as handle:
                np.save(handle, labels, allow_pickle=False)

        def manifest_now(complete: bool) -> ShardManifest:
            splits = {name: ShardSplit(name, plan.split(name).count, plan.split(name).labels,
                                       tuple(done[name][i] for i in sorted(done[name])))
                      for name in SPLITS}  # fmt: skip
            mean: tuple[float, ...] = ()
            std: tuple[float, ...] = ()
            if complete:
                mean, std = _mean_std(splits["train"], image_size)
            return dataclasses.replace(plan, train=splits["train"], test=splits["test"], mean=mean, std=std,
                                       complete=complete)  # fmt: skip

        jobs = []
        for name in SPLITS:
            files = listed[name]
            for index in range(plan.shard_count(name)):
                if index not in done[name]:
                    chunk = files[index * shard_size : (index + 1) * shard_size]
                    jobs.append(_Job(name, index, str(target / _shard_name(name, index)),
                                     tuple(str(scan.root / rel) for rel, _ in chunk), image_size))  # fmt: skip
        missing = sum(len(job.paths) for job in jobs) * image_bytes
        check_disk(target, missing, f"{len(jobs)} shards of {image_size}x{image_size} images",
                   "free some space or choose another --out")  # fmt: skip
        write_json(target / MANIFEST, manifest_now(False).to_dict())
        if reused and on_progress is not None:
            left = f"writing the {len(jobs)} left" if jobs else "nothing left to write"
            on_progress(f"{reused} shards already done in {target}; {left}")
        total = reused + len(jobs)

        def record(job: _Job, result: ShardFile | tuple[str, str]) -> None:
            if isinstance(result, tuple):
                raise AnytimeError(f"cannot decode image {result[0]} ({result[1]}); remove or replace the file, then "
                                   "run the same command again to finish")  # fmt: skip
            done[job.split][job.index] = result
            write_json(target / MANIFEST, manifest_now(False).to_dict())
            if on_progress is not None:
                finished = sum(len(d) for d in done.values())
                on_progress(f"{finished}/{total} shards: {result.file} ({result.count:,} images)")

        _run_jobs(jobs, workers, record)
        manifest = manifest_now(True)
        write_json(target / MANIFEST, manifest.to_dict())
    return PreparedShards(manifest, written=len(jobs), reused=reused, seconds=time.perf_counter() - started)


def _run_jobs(jobs: list[_Job], workers: int, record: Callable[[_Job, ShardFile | tuple[str, str]], None]) -> None:
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            record(job, _write_shard(job))
        return
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)))
    try:
        futures = {pool.submit(_write_shard, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            record(futures[future], future.result())
    except BaseException:
        # Interrupted or failed: queued shards are dropped; a shard being written leaves only a temporary file.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _mean_std(split: ShardSplit, image_size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std (in [0,1] units) from the shards' integer sums, as ``channel_stats``."""
    pixels = split.count * image_size * image_size
    means, stds = [], []
    for c in range(CHANNELS):
        if pixels == 0:
            means.append(0.0)
            stds.append(1.0)
            continue
        total = sum(s.sums[c] for s in split.shards)
        squares = sum(s.squares[c] for s in split.shards)
        mean = total / pixels
        var = squares / pixels - mean**2
        means.append(mean / 255.0)
        stds.append(max(float(np.sqrt(max(var, 0.0))) / 255.0, 1e-3))
    return tuple(means), tuple(stds)


# ---- reading ---------------------------------------------------------------------------------------------------


def open_shards(root: str | os.PathLike[str]) -> ShardManifest:
    """The manifest of the shard folder ``root``, checked against the files there (names, sizes, labels; not
    the checksums: see :func:`verify_shards`); anything wrong is a one-line :class:`AnytimeError`."""
    folder = Path(root).expanduser()
    if not folder.exists():
        raise AnytimeError(f"no shard folder at {folder}; {_prepare_hint(folder)}")
    if not folder.is_dir():
        raise AnytimeError(f"{folder} is a file, not a shard folder; {_prepare_hint(folder)}")
    manifest = _read_manifest(folder)
    if manifest is None:
        raise AnytimeError(f"{folder} holds no {MANIFEST}, so it is not a shard folder; {_prepare_hint(folder)}")
    if not manifest.complete:
        raise AnytimeError(f"the shards in {folder} are unfinished (their preparation was interrupted); run the same "
                           f"`anytime prepare-data SRC --image-size {manifest.image_size} --out {folder}` again to "
                           "finish them")  # fmt: skip
    if manifest.channels != CHANNELS:
        raise AnytimeError(f"{folder / MANIFEST} says {manifest.channels} channels; shards hold {CHANNELS}")
    redo = f"run `anytime prepare-data {manifest.source} --image-size {manifest.image_size} --out {folder}` to redo it"
    for name in SPLITS:
        split = manifest.split(name)
        if len(split.shards) != manifest.shard_count(name) or sum(s.count for s in split.shards) != split.count:
            raise AnytimeError(f"{folder / MANIFEST} lists shards that do not add up to its {split.count:,} {name} "
                               "images; prepare the shards again into a new folder")  # fmt: skip
        for index, shard in enumerate(split.shards):
            path = folder / shard.file
            if shard.file != _shard_name(name, index):
                raise AnytimeError(f"{folder / MANIFEST} lists {shard.file!r} where {_shard_name(name, index)!r} "
                                   "belongs; prepare the shards again into a new folder")  # fmt: skip
            expected = min(manifest.shard_size, split.count - index * manifest.shard_size) * manifest.image_bytes
            if shard.bytes != expected or shard.count * manifest.image_bytes != expected:
                raise AnytimeError(f"{folder / MANIFEST} gives {shard.file} {shard.bytes:,} bytes, but "
                                   f"{expected:,} are needed; prepare the shards again into a new folder")  # fmt: skip
            if not path.is_file():
                raise AnytimeError(f"shard {path} is missing; {redo}")
            if path.stat().st_size != expected:
                raise AnytimeError(f"shard {path} has {path.stat().st_size:,} bytes but its manifest says "
                                   f"{expected:,}; {redo}")  # fmt: skip
        _read_labels(manifest, name, redo)
    return manifest


def _read_labels(manifest: ShardManifest, name: str, redo: str) -> np.ndarray:
    split = manifest.split(name)
    path = manifest.root / split.labels
    try:
        labels = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise AnytimeError(f"the labels file {path} is missing; {redo}") from None
    except (OSError, ValueError) as exc:
        raise AnytimeError(f"the labels file {path} cannot be read ({exc}); {redo}") from None
    if labels.shape != (split.count,) or labels.dtype != np.int64:
        raise AnytimeError(f"the labels file {path} holds {labels.dtype} {labels.shape}, not {split.count:,} int64 "
                           f"labels as the manifest says; {redo}")  # fmt: skip
    if split.count and (labels.min() < 0 or labels.max() >= len(manifest.classes)):
        raise AnytimeError(f"the labels file {path} holds labels outside 0..{len(manifest.classes) - 1}; {redo}")
    return labels


def verify_shards(root: str | os.PathLike[str]) -> ShardManifest:
    """:func:`open_shards`, and every shard's SHA-1 checked against the manifest (reads every byte)."""
    manifest = open_shards(root)
    for name in SPLITS:
        for shard in manifest.split(name).shards:
            if _file_sha1(manifest.root / shard.file) != shard.sha1:
                raise AnytimeError(f"shard {manifest.root / shard.file} does not match its checksum; run "
                                   f"`anytime prepare-data {manifest.source} --image-size {manifest.image_size} "
                                   f"--out {manifest.root} --verify` to rewrite it")  # fmt: skip
    return manifest


class ShardImages(ImageStore):
    """The images of one split of a shard folder, read on demand with positioned reads; see :class:`ImageStore`.

    Only the samples asked for are read, into a new array; the files are opened lazily, once per process.
    """

    def __init__(
        self, files: Sequence[str | os.PathLike[str]], shard_size: int, count: int, image_shape: tuple[int, int, int],
        positions: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        self._files = tuple(os.fspath(f) for f in files)
        self._shard_size = int(shard_size)
        self._count = int(count)
        self._image_shape = tuple(int(v) for v in image_shape)
        self._image_bytes = int(np.prod(self._image_shape))
        self._positions = None if positions is None else np.asarray(positions, dtype=np.int64)
        self._handles: dict[int, int] = {}
        self._pid = os.getpid()

    @classmethod
    def of(cls, manifest: ShardManifest, split: str) -> ShardImages:
        """All the images of ``split`` (train or test) of an opened shard folder."""
        entry = manifest.split(split)
        size = manifest.image_size
        return cls([manifest.root / s.file for s in entry.shards], manifest.shard_size, entry.count,
                   (manifest.channels, size, size))  # fmt: skip

    @property
    def shape(self) -> torch.Size:
        """``(N, C, S, S)`` of this view."""
        count = self._count if self._positions is None else len(self._positions)
        return torch.Size((count, *self._image_shape))

    def subset(self, positions: np.ndarray) -> ShardImages:
        """A view of ``positions`` of this view; nothing is read."""
        return ShardImages(self._files, self._shard_size, self._count, self._image_shape, self._global(positions))

    def _handle(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked DataLoader worker: its own descriptors, not the parent's
            self._handles, self._pid = {}, os.getpid()
        fd = self._handles.get(shard)
        if fd is None:
            if len(self._handles) >= _MAX_OPEN:
                self.close()
            path = self._files[shard]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise AnytimeError(f"shard {path} is missing; run the same `anytime prepare-data` again to "
                                   "rebuild it") from None  # fmt: skip
            self._handles[shard] = fd
        return fd

    def read(self, positions: np.ndarray) -> torch.Tensor:
        """Images ``positions`` of this view, read from their shards with positioned reads into a new tensor."""
        wanted = self._global(positions)
        out = np.empty((len(wanted), *self._image_shape), dtype=np.uint8)
        if not len(wanted):
            return torch.from_numpy(out)
        flat = memoryview(out.reshape(-1))
        size = self._image_bytes
        shard, within = np.divmod(wanted, self._shard_size)
        # Runs of consecutive images in one shard (an evaluation batch) are one read each.
        breaks = np.flatnonzero((np.diff(wanted) != 1) | (np.diff(shard) != 0)) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [len(wanted)]))
        for run in np.argsort(wanted[starts], kind="stable").tolist():  # in file order, for read-ahead
            a, b = int(starts[run]), int(stops[run])
            self._pread(int(shard[a]), flat[a * size : b * size], int(within[a]) * size)
        return torch.from_numpy(out)

    def _pread(self, shard: int, buffer: memoryview, offset: int) -> None:
        fd = self._handle(shard)
        while len(buffer):
            got = os.preadv(fd, [buffer], offset)
            if got <= 0:
                raise AnytimeError(f"shard {self._files[shard]} is shorter than its manifest says; run the same "
                                   "`anytime prepare-data` again to rebuild it")  # fmt: skip
            buffer, offset = buffer[got:], offset + got

    def close(self) -> None:
        """Close the files this process opened (they reopen when read again)."""
        if self._pid == os.getpid():
            for fd in self._handles.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._handles = {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"ShardImages({len(self)} images of {'x'.join(map(str, self._image_shape))}, {len(self._files)} shards)"


def shard_dataset(root: str | os.PathLike[str], *, name: str = "shards", hflip: bool = False) -> RawDataset:
    """The shard folder ``root`` as a source for ``load_dataset``: image stores and labels, the classes, and the
    mean and std recorded at preparation (over every training image, before a validation split is carved)."""
    manifest = open_shards(root)
    redo = f"run `anytime prepare-data {manifest.source} --image-size {manifest.image_size} --out {manifest.root}`"
    return RawDataset(
        name=name,
        classes=manifest.classes,
        train_images=ShardImages.of(manifest, "train"),
        train_labels=_read_labels(manifest, "train", redo),
        test_images=ShardImages.of(manifest, "test"),
        test_labels=_read_labels(manifest, "test", redo),
        hflip=hflip,
        source=str(manifest.root.resolve()),
        fingerprint=manifest.source_fingerprint,
        mean=manifest.mean,
        std=manifest.std,
    )
