"""The customary torchvision input pipeline, kept as the baseline our cached-tensor pipeline is measured against.

ImageFolder decodes every image with PIL on every epoch and augments it one image at a time
(RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize), in DataLoader workers.
"""

from __future__ import annotations

import os

from torch.utils.data import DataLoader

from anytime.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD
from anytime.errors import AnytimeError


def torchvision_loader(
    root: str | os.PathLike[str],
    *,
    batch_size: int = 128,
    workers: int = 4,
    prefetch_factor: int = 2,
    crop: int = 32,
    seed: int = 0,
) -> DataLoader:
    """A shuffled, augmented training DataLoader over ``root`` (a folder of class folders)."""
    import torch
    from torchvision import datasets, transforms

    if not os.path.isdir(root):
        raise AnytimeError(f"no image folder at {root}; expected <root>/<class>/<image>")
    transform = transforms.Compose(
        [
            transforms.RandomCrop(crop, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )
    dataset = datasets.ImageFolder(os.fspath(root), transform=transform)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        persistent_workers=False,
        generator=generator,
    )
