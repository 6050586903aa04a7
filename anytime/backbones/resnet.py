"""ResNet-18/50 for CIFAR (3x3 stem, no max-pool), with blocks that expose branch and shortcut."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone, classifier_head, conv_bn
from anytime.backbones.registry import register_model


def projection(cin: int, cout: int, stride: int) -> nn.Module:
    """The shortcut: identity when shapes agree, else a strided 1x1 conv with batch norm."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


def drop_path(x: Tensor, p: float) -> Tensor:
    """Stochastic depth for a batch of residual branches: zero each sample's branch with probability ``p``
    and scale the kept ones by ``1 / (1 - p)``, so the full network needs no rescaling at test time."""
    keep = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device, dtype=x.dtype).bernoulli_(1 - p)
    return x * keep / (1 - p)


class ResidualBlock(nn.Module):
    """``relu(branch(x) + shortcut(x))``: the residual branch and the shortcut are separate modules
    so that a block's link can be cut or its branch dropped.

    ``cut``: ``None`` (the whole block), ``"shortcut"`` (``relu(branch(x))``: the link is cut) or
    ``"branch"`` (``relu(shortcut(x))``: the branch is skipped, and so is its computation). ``drop_prob``:
    stochastic depth, the chance that a training sample skips the branch.
    """

    cut: str | None = None
    drop_prob: float = 0.0

    def __init__(self, branch: nn.Module, shortcut: nn.Module) -> None:
        super().__init__()
        self.branch = branch
        self.shortcut = shortcut
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.cut == "branch":  # out of place: with an identity shortcut, x is saved for the backward
            return torch.relu(self.shortcut(x))
        if self.cut == "shortcut":
            return self.act(self.branch(x))
        out = self.branch(x)
        if self.training and self.drop_prob > 0:
            out = drop_path(out, self.drop_prob)
        return self.act(out + self.shortcut(x))


def basic_block(cin: int, cout: int, stride: int) -> ResidualBlock:
    """Two 3x3 convolutions (ResNet-18/34)."""
    branch = nn.Sequential(conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, act=None))
    return ResidualBlock(branch, projection(cin, cout, stride))


def bottleneck_block(cin: int, width: int, stride: int, expansion: int = 4) -> ResidualBlock:
    """1x1 reduce, 3x3, 1x1 expand (ResNet-50 and up); the stride sits on the 3x3 conv."""
    cout = width * expansion
    branch = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3, stride), conv_bn(width, cout, 1, act=None))
    return ResidualBlock(branch, projection(cin, cout, stride))


class ResNet(StagedBackbone):
    """CIFAR ResNet: 3x3 stem at stride 1 and four stages of residual blocks (64-512 wide)."""

    def __init__(
        self, blocks: tuple[int, ...], *, bottleneck: bool, num_classes: int = 10, in_channels: int = 3
    ) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        expansion = 4 if bottleneck else 1
        cin, stages, shapes = 64, [], []
        for i, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stride = 1 if i == 0 else 2
            layer = []
            for j in range(count):
                s = stride if j == 0 else 1
                layer.append(bottleneck_block(cin, width, s) if bottleneck else basic_block(cin, width, s))
                cin = width * expansion
            stages.append(nn.Sequential(*layer))
            shapes.append((cin, 2**i))
        self._set_stages(conv_bn(in_channels, 64), stages, classifier_head(cin, num_classes), shapes)


@register_model("resnet18", family="resnet", description="ResNet-18 for CIFAR, 4 stages of basic blocks")
def resnet18(*, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-18: basic blocks [2, 2, 2, 2] (11.2M parameters at 10 classes)."""
    return ResNet((2, 2, 2, 2), bottleneck=False, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet50", family="resnet", description="ResNet-50 for CIFAR, 4 stages of bottlenecks")
def resnet50(*, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-50: bottlenecks [3, 4, 6, 3] (23.5M parameters at 10 classes)."""
    return ResNet((3, 4, 6, 3), bottleneck=True, num_classes=num_classes, in_channels=in_channels)
