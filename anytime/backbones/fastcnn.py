"""A fast CIFAR network after the ideas of airbench (Keller Jordan's speed-run recipe for CIFAR-10).

A frozen whitening stem initialised from the training images, then three stages of
``conv -> max-pool -> BN -> GELU -> conv -> BN -> GELU`` (batch-norm scales fixed at 1, only shifts learnt),
and a max-pooled head with a down-scaled linear classifier. Few layers, wide convolutions: cheap per
image and quick to train, which is what a 2-core budget needs. Stages end after their second
activation, so exits attach there (or after any layer inside a stage).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from anytime.backbones.base import Scale, StagedBackbone
from anytime.backbones.registry import register_model

_PATCHES = 100_000  # image patches whose covariance sets the whitening filters: plenty for 12 dimensions
_EPS = 5e-4  # added to the covariance's eigenvalues, so near-constant directions are not blown up


class WhiteningStem(nn.Module):
    """A ``kernel`` x ``kernel`` convolution whose filters whiten the image patches (ZCA-like), then GELU.

    :meth:`init_from_data` sets the filters to the eigenvectors of the patch covariance divided by the
    square root of their eigenvalues, each filter also negated so that GELU keeps both signs; the filters
    then stay fixed (only the bias trains). Until initialised it is an ordinary random convolution.
    """

    def __init__(self, in_channels: int, kernel: int = 2) -> None:
        super().__init__()
        self.kernel = kernel
        dims = in_channels * kernel * kernel
        self.conv = nn.Conv2d(in_channels, 2 * dims, kernel, padding=0, bias=True)
        self.conv.weight.requires_grad_(False)
        self.act = nn.GELU()

    @torch.no_grad()
    def init_from_data(self, images: Tensor) -> None:
        """Set the filters from normalised training images ``[N, C, H, W]``."""
        k = self.kernel
        patches = images.unfold(2, k, 1).unfold(3, k, 1)  # N, C, H', W', k, k
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, self.conv.in_channels * k * k).double()
        if patches.shape[0] > _PATCHES:
            generator = torch.Generator().manual_seed(0)
            patches = patches[torch.randperm(patches.shape[0], generator=generator)[:_PATCHES].to(patches.device)]
        eigenvalues, eigenvectors = torch.linalg.eigh(torch.cov(patches.T))
        filters = eigenvectors.T / torch.sqrt(eigenvalues.clamp(min=0) + _EPS)[:, None]
        weight = torch.cat([filters, -filters]).reshape_as(self.conv.weight)
        self.conv.weight.copy_(weight.to(self.conv.weight.dtype))

    def forward(self, x: Tensor) -> Tensor:
        """Whitened patches, through GELU."""
        return self.act(self.conv(x))


def _bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels, momentum=0.4)  # short runs: running statistics that follow the weights
    bn.weight.requires_grad_(False)
    return bn


def _conv(cin: int, cout: int) -> nn.Conv2d:
    """A 3x3 convolution whose first ``min(cin, cout)`` filters start as the identity (dirac), the rest random:
    a deep-ish stack of them starts close to passing its input through, which trains faster."""
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: min(cin, cout)])
    return conv


def conv_group(cin: int, cout: int, convs: int = 2) -> nn.Sequential:
    """Blocks ``conv -> max-pool -> BN -> GELU``, then ``convs - 1`` times ``conv -> BN -> GELU`` (exits may
    attach after any block)."""
    blocks = [nn.Sequential(_conv(cin, cout), nn.MaxPool2d(2), _bn(cout), nn.GELU())]
    for _ in range(convs - 1):
        blocks.append(nn.Sequential(_conv(cout, cout), _bn(cout), nn.GELU()))
    return nn.Sequential(*blocks)


class FastCNN(StagedBackbone):
    """Whitening stem, three conv groups of ``widths``, max-pool head (see the module's docstring)."""

    def __init__(
        self, widths: tuple[int, int, int], *, convs: int = 2, num_classes: int = 10, in_channels: int = 3
    ) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        stem = WhiteningStem(in_channels)
        stages, cin = [], stem.conv.out_channels
        for width in widths:
            stages.append(conv_group(cin, width, convs))
            cin = width
        head = nn.Sequential(
            nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes, bias=False), Scale(1 / 9)
        )
        self._set_stages(stem, stages, head, [(w, 2 ** (i + 1)) for i, w in enumerate(widths)])


@register_model(
    "fastcnn", family="fastcnn", description="airbench-style CIFAR net: whitening stem, 3 conv groups 64-256-256"
)
def fastcnn(*, num_classes: int = 10, in_channels: int = 3) -> FastCNN:
    """The airbench-style network at widths 64, 256, 256 (about 2M parameters, 0.24 GFLOPs per 32x32 image)."""
    return FastCNN((64, 256, 256), num_classes=num_classes, in_channels=in_channels)


@register_model("fastcnn-wide", family="fastcnn",
                description="airbench-style CIFAR net, wider and deeper: 3 convs per group, 128-384-512")  # fmt: skip
def fastcnn_wide(*, num_classes: int = 10, in_channels: int = 3) -> FastCNN:
    """Three convolutions per group at widths 128, 384, 512: several times the cost of ``fastcnn``, for more accuracy."""
    return FastCNN((128, 384, 512), convs=3, num_classes=num_classes, in_channels=in_channels)
