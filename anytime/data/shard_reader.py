"""The reader of a shard folder: :class:`ShardImages`, one split's images read on demand with positioned reads
(``os.preadv``) into a fresh array, nothing mapped, so a training process's memory does not grow with the dataset;
and :func:`shard_dataset`, a shard folder as a source for ``load_dataset`` (the manifest and its checks are in
:mod:`anytime.data.shards`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from anytime.data.base import ImageStore, RawDataset
from anytime.data.shards import ShardManifest, open_shards, read_labels
from anytime.errors import AnytimeError

_MAX_OPEN = 256  # shard files a reader keeps open at once


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
        train_labels=read_labels(manifest, "train", redo),
        test_images=ShardImages.of(manifest, "test"),
        test_labels=read_labels(manifest, "test", redo),
        hflip=hflip,
        source=str(manifest.root.resolve()),
        fingerprint=manifest.source_fingerprint,
        mean=manifest.mean,
        std=manifest.std,
    )
