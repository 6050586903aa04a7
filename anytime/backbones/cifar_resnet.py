"""The small CIFAR ResNets of He et al. (2016): ResNet-20/32/56, 16-32-64 channels, 0.27M-0.85M parameters."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone, classifier_head, conv_bn
from anytime.backbones.registry import register_model
from anytime.backbones.resnet import ResidualBlock, bottleneck_block


class PadShortcut(nn.Module):
    """The paper's parameter-free "option A" shortcut: subsample by the stride, zero-pad the new channels."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.extra = cout - cin

    def forward(self, x: Tensor) -> Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra:
            x = F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return x


def cifar_block(cin: int, cout: int, stride: int) -> ResidualBlock:
    """Two 3x3 convolutions; an option-A shortcut where the shape changes."""
    branch = nn.Sequential(conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, act=None))
    shortcut = nn.Identity() if stride == 1 and cin == cout else PadShortcut(cin, cout, stride)
    return ResidualBlock(branch, shortcut)


class CifarResNet(StagedBackbone):
    """3x3 stem to 16 channels, then three stages of ``n`` blocks (16, 32, 64 channels): basic blocks
    (depth 6n+2), or bottlenecks whose output is 4x wider, with projection shortcuts (depth 9n+2)."""

    def __init__(self, n: int, *, bottleneck: bool = False, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        cin, stages, shapes = 16, [], []
        for i, width in enumerate((16, 32, 64)):
            layer = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                if bottleneck:
                    layer.append(bottleneck_block(cin, width, stride))
                    cin = 4 * width
                else:
                    layer.append(cifar_block(cin, width, stride))
                    cin = width
            stages.append(nn.Sequential(*layer))
            shapes.append((cin, 2**i))
        self._set_stages(conv_bn(in_channels, 16), stages, classifier_head(cin, num_classes), shapes)


@register_model("resnet8", family="cifar-resnet", description="ResNet-8 (He et al. 2016), 3 stages x 1 block")
def resnet8(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-8: 1 block per stage (0.08M parameters), for small devices and quick checks."""
    return CifarResNet(1, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet20", family="cifar-resnet", description="ResNet-20 (He et al. 2016), 3 stages x 3 blocks")
def resnet20(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-20: 3 blocks per stage (0.27M parameters)."""
    return CifarResNet(3, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet32", family="cifar-resnet", description="ResNet-32 (He et al. 2016), 3 stages x 5 blocks")
def resnet32(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-32: 5 blocks per stage (0.46M parameters)."""
    return CifarResNet(5, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet56", family="cifar-resnet", description="ResNet-56 (He et al. 2016), 3 stages x 9 blocks")
def resnet56(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-56: 9 blocks per stage (0.85M parameters)."""
    return CifarResNet(9, num_classes=num_classes, in_channels=in_channels)


@register_model(
    "resnet29_bottleneck", family="cifar-resnet",
    description="CIFAR ResNet-29 of bottlenecks (ResNet-50's block), 3 stages x 3 blocks",
)  # fmt: skip
def resnet29_bottleneck(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-29 of bottleneck blocks (1x1, 3x3, 1x1 to 4x the width; projection shortcuts): the CIFAR-sized
    counterpart of ResNet-50's block design, as ResNet-20 is of ResNet-18's (0.31M parameters)."""
    return CifarResNet(3, bottleneck=True, num_classes=num_classes, in_channels=in_channels)
