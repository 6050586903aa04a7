"""ResNeXt-29 for CIFAR (Xie et al. 2017): bottlenecks with a grouped 3x3 convolution."""

from __future__ import annotations

from torch import nn

from anytime.backbones.base import StagedBackbone, classifier_head, conv_bn
from anytime.backbones.registry import register_model
from anytime.backbones.resnet import ResidualBlock, projection


def resnext_block(cin: int, cardinality: int, width: int, stride: int) -> ResidualBlock:
    """1x1 to ``cardinality * width`` channels, a grouped 3x3 with ``cardinality`` groups, 1x1 to twice that."""
    inner = cardinality * width
    cout = 2 * inner
    branch = nn.Sequential(
        conv_bn(cin, inner, 1), conv_bn(inner, inner, 3, stride, groups=cardinality), conv_bn(inner, cout, 1, act=None)
    )
    return ResidualBlock(branch, projection(cin, cout, stride))


class ResNeXt(StagedBackbone):
    """Stem conv, three stages of ResNeXt blocks; the bottleneck width doubles at each stage."""

    def __init__(
        self, blocks: tuple[int, ...], *, cardinality: int, width: int, num_classes: int = 10, in_channels: int = 3
    ) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        self.cardinality = cardinality
        cin, stages, shapes = 64, [], []
        for i, count in enumerate(blocks):
            layer = []
            for j in range(count):
                layer.append(resnext_block(cin, cardinality, width, 2 if (i > 0 and j == 0) else 1))
                cin = 2 * cardinality * width
            stages.append(nn.Sequential(*layer))
            shapes.append((cin, 2**i))
            width *= 2
        self._set_stages(conv_bn(in_channels, 64), stages, classifier_head(cin, num_classes), shapes)


@register_model("resnext29_2x64d", family="resnext", description="ResNeXt-29, cardinality 2, width 64")
def resnext29_2x64d(*, num_classes: int = 10, in_channels: int = 3) -> ResNeXt:
    """ResNeXt-29 2x64d for CIFAR: cardinality 2, width 64, [3, 3, 3] (9.1M parameters)."""
    return ResNeXt((3, 3, 3), cardinality=2, width=64, num_classes=num_classes, in_channels=in_channels)


@register_model("resnext29_8x16d", family="resnext", description="ResNeXt-29, cardinality 8, width 16")
def resnext29_8x16d(*, num_classes: int = 10, in_channels: int = 3) -> ResNeXt:
    """ResNeXt-29 8x16d for CIFAR: cardinality 8, width 16, [3, 3, 3]; the same inner widths as 2x64d in 8
    groups, so cardinality slicing has 8 steps."""
    return ResNeXt((3, 3, 3), cardinality=8, width=16, num_classes=num_classes, in_channels=in_channels)
