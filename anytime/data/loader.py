"""Batches of normalised (and, for training, augmented) images from an in-memory uint8 split."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from anytime.data.augment import Augment, apply_augment, default_augment, normalize
from anytime.data.base import DatasetInfo, Split, take_images
from anytime.errors import AnytimeError
from anytime.utils.seed import derive_seed

BUCKET_POOL = 50  # batches sorted by length together when text is bucketed


def share(count: int, part: tuple[int, int]) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``count`` that process ``rank`` of ``world`` takes: contiguous, in rank order,
    sizes differing by at most one."""
    rank, world = part
    return rank * count // world, (rank + 1) * count // world


@dataclass(frozen=True)
class Delivery:
    """How and where a loader's batches are delivered (:func:`make_loader`), never what they hold.

    ``workers`` DataLoader processes build the batches (0: this process builds them), each keeping
    ``prefetch_factor`` batches ready ahead; ``pin_memory`` puts them in page-locked memory (where CUDA is
    available) so that the copy to the GPU can overlap; ``device`` is where the batches are moved (None: they stay
    on the CPU). ``part=(rank, world)`` is this process's share when ``world`` processes train together
    (data-parallel): see :class:`BatchLoader`."""

    workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    device: torch.device | str | None = None
    part: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if not 0 <= self.part[0] < self.part[1]:
            raise ValueError(f"part must be (rank, world) with 0 <= rank < world, got {self.part}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")


class _BatchMaker:
    """Computes batch ``b`` of epoch ``e`` from (seed, epoch, b) alone, in any process.

    With ``part=(rank, world)`` a training batch is the same global batch in every process, each taking its
    own rows of it (augmented as the whole batch would be); an evaluation split is cut into ``world``
    contiguous pieces instead.
    """

    def __init__(
        self, split: Split, info: DatasetInfo, *, batch_size: int, train: bool, seed: int, augment: Augment,
        drop_last: bool, part: tuple[int, int] = (0, 1),
    ) -> None:  # fmt: skip
        self.part = part
        images, labels = split.images, split.labels
        if not train and part[1] > 1:
            start, stop = share(int(labels.shape[0]), part)
            images, labels = take_images(images, torch.arange(start, stop)), labels[start:stop]
        self.images = images
        self.labels = labels
        self.mean = info.mean
        self.std = info.std
        self.fill = [round(255 * m) for m in info.mean]  # cutout's colour: the mean, as uint8
        self.augment = augment
        self.batch_size = batch_size
        self.train = train
        self.seed = seed
        self.drop_last = drop_last
        self.text = info.modality == "text"
        self.lengths = images.ne(0).sum(1) if self.text else None

    def num_batches(self) -> int:
        n = int(self.labels.shape[0])
        if self.drop_last:
            return n // self.batch_size
        count = -(-n // self.batch_size)
        if self.train and 0 < n % self.batch_size < self.part[1]:
            count -= 1  # a last batch with fewer images than processes would leave one with none
        return count

    def total(self, index: int) -> int:
        """The images in global batch ``index``, all processes together."""
        return min(self.batch_size, int(self.labels.shape[0]) - index * self.batch_size)

    def order(self, epoch: int) -> torch.Tensor | None:
        if not self.train:
            return None
        generator = torch.Generator().manual_seed(derive_seed("order", self.seed, epoch))
        order = torch.randperm(int(self.labels.shape[0]), generator=generator)
        if self.lengths is None:
            return order
        return self._bucketed(order, generator)

    def _bucketed(self, order: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``order`` regrouped so that each batch holds sentences of similar length (less padding): every pool
        of ``BUCKET_POOL`` batches is sorted by length and cut into batches, whose order is then shuffled."""
        assert self.lengths is not None
        pool = self.batch_size * BUCKET_POOL
        batches: list[torch.Tensor] = []
        for start in range(0, len(order), pool):
            chunk = order[start : start + pool]
            chunk = chunk[torch.argsort(self.lengths[chunk], stable=True)]
            batches += list(chunk.split(self.batch_size))
        full = [b for b in batches if len(b) == self.batch_size]
        short = [b for b in batches if len(b) < self.batch_size]  # at most one per pool: they go last, merged
        shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        return torch.cat(shuffled + short) if shuffled or short else order

    def batch(self, order: torch.Tensor | None, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = index * self.batch_size, (index + 1) * self.batch_size
        if self.text:
            picked = torch.arange(start, min(stop, int(self.labels.shape[0]))) if order is None else order[start:stop]
            if order is not None:
                mine = share(len(picked), self.part)
                picked = picked[mine[0] : mine[1]]
            ids = self.images.index_select(0, picked)
            longest = max(int(ids.ne(0).sum(1).max()), 1) if len(ids) else 1
            return ids[:, :longest].contiguous(), self.labels.index_select(0, picked)
        if order is None:
            images, labels = self.images[start:stop], self.labels[start:stop]
        else:
            picked = order[start:stop]
            mine = share(len(picked), self.part)
            picked = picked[mine[0] : mine[1]]
            images, labels = self.images.index_select(0, picked), self.labels.index_select(0, picked)
            generator = torch.Generator().manual_seed(derive_seed("augment", self.seed, epoch, index))
            images = apply_augment(images, self.augment, generator, within=(mine[0], self.total(index)),
                                   fill=self.fill)  # fmt: skip
        return normalize(images, self.mean, self.std), labels.clone()


class _EpochBatches(Dataset):
    """Item ``b`` is the whole batch ``b`` of one epoch (for a DataLoader with ``batch_size=None``)."""

    def __init__(self, maker: _BatchMaker, order: torch.Tensor | None, epoch: int) -> None:
        self.maker = maker
        self.order = order
        self.epoch = epoch

    def __len__(self) -> int:
        return self.maker.num_batches()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.maker.batch(self.order, self.epoch, index)


class BatchLoader:
    """Iterates ``(images float32 [B,C,H,W] normalised, labels int64 [B])``, or for text ``(token ids int64
    [B,T], labels)`` with ``T`` the batch's longest sentence (training batches grouped by length).

    ``train=True``: shuffled each epoch and augmented by ``augment`` (default: the dataset's, random
    crops with 4 pixels of zero padding plus horizontal flips where ``info.hflip``) with batched tensor ops.
    ``train=False``: fixed order, normalised only. Shuffling and augmentation depend only on
    ``(seed, epoch)`` (set with :meth:`set_epoch`), never on the number of workers or on
    earlier iteration, so a resumed run sees the same batches.

    ``delivery`` (default :class:`Delivery`) says how and where the batches are delivered. Its ``part=(rank,
    world)`` is this process's share when ``world`` processes train together (data-parallel): each training
    batch is a global batch of ``batch_size`` whose rows are shared out (the epoch's last batch is dropped when it
    holds fewer images than processes); an evaluation split is shared out as whole pieces.
    """

    def __init__(
        self, split: Split, info: DatasetInfo, *, batch_size: int, train: bool, seed: int = 0, drop_last: bool = False,
        augment: Augment | None = None, delivery: Delivery | None = None,
    ) -> None:  # fmt: skip
        delivery = delivery or Delivery()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.augment = augment if augment is not None else default_augment(info.hflip)
        self._maker = _BatchMaker(split, info, batch_size=batch_size, train=train, seed=seed, augment=self.augment,
                                  drop_last=drop_last, part=delivery.part)  # fmt: skip
        self.num_samples: int = len(split)
        self.batch_size: int = batch_size
        self.train = train
        self.seed = seed
        self.delivery = delivery
        self.device = torch.device(delivery.device) if delivery.device is not None else None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order and augmentation the next iteration yields."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self._maker.num_batches()

    def batch_total(self, index: int) -> int:
        """The images in training batch ``index``, all processes' shares together."""
        return self._maker.total(index)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        order = self._maker.order(epoch)
        delivery = self.delivery
        if delivery.workers == 0:
            for index in range(len(self)):
                images, labels = self._maker.batch(order, epoch, index)
                if delivery.pin_memory and torch.cuda.is_available():
                    images, labels = images.pin_memory(), labels.pin_memory()
                yield images, labels
            return
        loader = DataLoader(
            _EpochBatches(self._maker, order, epoch), batch_size=None, shuffle=False, num_workers=delivery.workers,
            prefetch_factor=delivery.prefetch_factor, pin_memory=delivery.pin_memory and torch.cuda.is_available(),
        )  # fmt: skip
        try:
            yield from loader
        except AnytimeError as exc:
            # A worker's error comes back wrapped with its traceback: the user gets its own line only.
            raise AnytimeError(str(exc).strip().splitlines()[-1].split("AnytimeError: ", 1)[-1]) from None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self._batches():
            if self.device is not None:
                non_blocking = self.delivery.pin_memory and images.is_pinned()
                images = images.to(self.device, non_blocking=non_blocking)
                labels = labels.to(self.device, non_blocking=non_blocking)
            yield images, labels


def make_loader(
    split: Split, info: DatasetInfo, *, batch_size: int, train: bool, seed: int = 0, drop_last: bool = False,
    augment: Augment | None = None, delivery: Delivery | None = None,
) -> BatchLoader:  # fmt: skip
    """A :class:`BatchLoader` over ``split``, its batches delivered as ``delivery`` says (default
    :class:`Delivery`: built in this process, left on the CPU); see its docstring for what the batches are."""
    return BatchLoader(split, info, batch_size=batch_size, train=train, seed=seed, drop_last=drop_last,
                       augment=augment, delivery=delivery)  # fmt: skip
