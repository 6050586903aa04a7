"""Batched augmentation and normalisation on uint8 tensors (no PIL, no per-image Python loop)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anytime.errors import AnytimeError

AUGMENT_POLICIES: tuple[str, ...] = ("none", "crop", "flip", "crop+flip")
DEFAULT_PADDING = 4  # pixels of zero padding around a random crop, as the CIFAR ResNet recipes use


@dataclass(frozen=True)
class Augment:
    """The training augmentation of a recipe: random crops of a zero-padded image and/or horizontal flips, then
    optionally cutout.

    ``policy`` is one of :data:`AUGMENT_POLICIES`; ``padding`` (pixels) applies to the crop policies only.
    ``cutout`` (pixels, 0 for none) hides a square of that side in every training image, centred on a random pixel
    and clipped at the borders, filled with the dataset's mean colour (DeVries and Taylor's cutout; it combines
    with any policy). Evaluation images are never augmented.
    """

    policy: str
    padding: int = DEFAULT_PADDING
    cutout: int = 0

    def __post_init__(self) -> None:
        if self.policy not in AUGMENT_POLICIES:
            raise AnytimeError(f"unknown augmentation '{self.policy}'; choose one of {', '.join(AUGMENT_POLICIES)}")
        if self.padding < 0:
            raise AnytimeError(f"augmentation padding is a number of pixels >= 0 (got {self.padding})")
        if self.cutout < 0:
            raise AnytimeError(f"cutout is the side of a square in pixels, >= 0 (got {self.cutout})")

    @property
    def crop(self) -> bool:
        """Whether images are randomly cropped (shifted by up to ``padding`` pixels)."""
        return "crop" in self.policy and self.padding > 0

    @property
    def hflip(self) -> bool:
        """Whether images are flipped left-right at random."""
        return "flip" in self.policy

    def describe(self) -> str:
        """E.g. ``crop+flip (padding 4)``, ``crop+flip (padding 2), cutout 12`` or ``none``."""
        text = f"{self.policy} (padding {self.padding})" if "crop" in self.policy else self.policy
        return f"{text}, cutout {self.cutout}" if self.cutout else text


def default_augment(hflip: bool) -> Augment:
    """A dataset's default: crops with 4 pixels of padding, plus flips where a mirrored image keeps its class
    (natural photos such as CIFAR-10; not digits or text)."""
    return Augment("crop+flip" if hflip else "crop")


def apply_augment(
    images_uint8: torch.Tensor,
    augment: Augment,
    generator: torch.Generator,
    within: tuple[int, int] | None = None,
    fill: Sequence[int] | None = None,
) -> torch.Tensor:
    """``images_uint8`` augmented by ``augment`` (uint8 [N,C,H,W] in and out); no draws for ``none`` without cutout.
    ``within``: as :func:`random_crop_flip` takes it. ``fill``: cutout's colour, one uint8 value per channel (the
    dataset's mean; black when None)."""
    if augment.policy != "none":
        images_uint8 = random_crop_flip(images_uint8, padding=augment.padding if augment.crop else 0,
                                        hflip=augment.hflip, generator=generator, within=within)  # fmt: skip
    if augment.cutout:
        images_uint8 = random_cutout(images_uint8, augment.cutout, generator=generator, fill=fill, within=within)
    return images_uint8


def _rows_of_mine(images_uint8: torch.Tensor, within: tuple[int, int] | None) -> tuple[slice, int]:
    """The rows of a whole batch's draws that ``images_uint8`` (checked to be [N,C,H,W]) take, and that batch's size;
    ``within`` as :func:`random_crop_flip` takes it."""
    if images_uint8.dim() != 4:
        raise ValueError(f"expected [N,C,H,W] images, got shape {tuple(images_uint8.shape)}")
    n = images_uint8.shape[0]
    start, total = within if within is not None else (0, n)
    if start < 0 or start + n > total:
        raise ValueError(f"rows {start}..{start + n} are not within a batch of {total}")
    return slice(start, start + n), total


def random_cutout(
    images_uint8: torch.Tensor,
    size: int,
    *,
    generator: torch.Generator,
    fill: Sequence[int] | None = None,
    within: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A ``size`` x ``size`` square of each image (uint8 [N,C,H,W], a new tensor) set to ``fill`` (one value per
    channel; 0 when None), centred on a pixel drawn uniformly and clipped at the borders, so a square near an edge
    hides less. Draws, in order: centre rows, centre columns, from ``generator``; ``within`` as
    :func:`random_crop_flip` takes it."""
    mine, total = _rows_of_mine(images_uint8, within)
    n, c, h, w = images_uint8.shape
    top = torch.randint(0, h, (total,), generator=generator)[mine] - size // 2
    left = torch.randint(0, w, (total,), generator=generator)[mine] - size // 2
    rows = torch.arange(h) - top[:, None]  # [N, H]: inside the square where 0 <= row < size
    cols = torch.arange(w) - left[:, None]
    hidden = ((rows >= 0) & (rows < size))[:, :, None] & ((cols >= 0) & (cols < size))[:, None, :]
    colour = torch.zeros(c, dtype=torch.uint8) if fill is None else torch.as_tensor(list(fill), dtype=torch.uint8)
    if colour.numel() != c:
        raise ValueError(f"cutout's fill has {colour.numel()} values for images of {c} channels")
    return torch.where(hidden[:, None], colour.reshape(1, c, 1, 1), images_uint8)


def random_crop_flip(
    images_uint8: torch.Tensor,
    *,
    padding: int,
    hflip: bool,
    generator: torch.Generator,
    within: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Random crops of a zero-padded batch, plus random horizontal flips when ``hflip``; uint8 [N,C,H,W] in and out.

    The batch is padded once, then rows and columns are gathered with per-sample offsets;
    a flip just reverses that sample's column index. Draws, in order: row
    offsets, column offsets, then (if ``hflip``) flip coins, all from ``generator``.

    ``within=(start, total)`` says the images are rows ``start..start+N`` of a batch of ``total``: the draws are made
    for the whole batch and these rows take theirs, so processes that share a batch augment it as one process would.
    """
    rows_of_mine, total = _rows_of_mine(images_uint8, within)
    n, c, h, w = images_uint8.shape
    p = int(padding)
    if p < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    dy = torch.randint(0, 2 * p + 1, (total,), generator=generator)[rows_of_mine]
    dx = torch.randint(0, 2 * p + 1, (total,), generator=generator)[rows_of_mine]
    flip = (torch.rand(total, generator=generator) < 0.5)[rows_of_mine] if hflip else None
    if p:
        padded = images_uint8.new_zeros((n, c, h + 2 * p, w + 2 * p))
        padded[:, :, p : p + h, p : p + w] = images_uint8
    else:
        padded = images_uint8
    cols = torch.arange(w).expand(n, w)
    if flip is not None:
        cols = torch.where(flip[:, None], (w - 1) - cols, cols)
    rows = dy[:, None] + torch.arange(h)  # [N, H]
    cols = dx[:, None] + cols  # [N, W]
    # Two gathers with per-sample offsets: rows first (keeping the padded width), then columns.
    picked_rows = padded.gather(2, rows[:, None, :, None].expand(n, c, h, padded.shape[3]))
    return picked_rows.gather(3, cols[:, None, None, :].expand(n, c, h, w))


def normalize(images_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(x/255 - mean)/std`` per channel, as float32 [N,C,H,W]."""
    c = images_uint8.shape[1]
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(1, c, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(1, c, 1, 1)
    # One single-operation kernel per step (no fused multiply-add), so results are bit-identical
    # whatever the thread count or vector width of the process computing them.
    out = images_uint8.to(torch.float32)
    out.sub_(mean_t * 255.0)
    out.div_(std_t * 255.0)
    return out
