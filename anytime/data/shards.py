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

This module holds the format: the manifest types, and opening and verifying a shard folder;
:mod:`anytime.data.shard_writer` prepares the shards and :mod:`anytime.data.shard_reader` reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anytime.errors import AnytimeError

FORMAT = "anytime-shards"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS: tuple[str, ...] = ("train", "test")
CHANNELS = 3
RESAMPLE = "bilinear"  # PIL's Image.Resampling.BILINEAR, antialiased when shrinking


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


def shard_name(split: str, index: int) -> str:
    """The file name of shard ``index`` of ``split`` in a shard folder."""
    return f"{split}-{index:05d}.bin"


def file_sha1(path: Path) -> str:
    """The SHA-1 of the file at ``path``, read in 8 MiB blocks."""
    digest = hashlib.sha1()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(root: Path) -> ShardManifest | None:
    """The manifest of the folder ``root``, or None where it has none; an unreadable one is an :class:`AnytimeError`."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AnytimeError(f"{path} cannot be read as JSON ({exc}); {_prepare_hint(root)} into a new folder") from None
    return ShardManifest.from_dict(doc, root)


def open_shards(root: str | os.PathLike[str]) -> ShardManifest:
    """The manifest of the shard folder ``root``, checked against the files there (names, sizes, labels; not
    the checksums: see :func:`verify_shards`); anything wrong is a one-line :class:`AnytimeError`."""
    folder = Path(root).expanduser()
    if not folder.exists():
        raise AnytimeError(f"no shard folder at {folder}; {_prepare_hint(folder)}")
    if not folder.is_dir():
        raise AnytimeError(f"{folder} is a file, not a shard folder; {_prepare_hint(folder)}")
    manifest = read_manifest(folder)
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
            if shard.file != shard_name(name, index):
                raise AnytimeError(f"{folder / MANIFEST} lists {shard.file!r} where {shard_name(name, index)!r} "
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
        read_labels(manifest, name, redo)
    return manifest


def read_labels(manifest: ShardManifest, name: str, redo: str) -> np.ndarray:
    """The labels of split ``name``, checked against the manifest; ``redo`` ends an error's line."""
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
            if file_sha1(manifest.root / shard.file) != shard.sha1:
                raise AnytimeError(f"shard {manifest.root / shard.file} does not match its checksum; run "
                                   f"`anytime prepare-data {manifest.source} --image-size {manifest.image_size} "
                                   f"--out {manifest.root} --verify` to rewrite it")  # fmt: skip
    return manifest
