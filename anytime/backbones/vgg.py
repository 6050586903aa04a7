"""VGG with batch norm, CIFAR-sized: stages end at the max-pools."""

from __future__ import annotations

from torch import nn

from anytime.backbones.base import StagedBackbone, classifier_head, conv_bn
from anytime.backbones.registry import register_model

VGG11 = ((64,), (128,), (256, 256), (512, 512), (512, 512))


class VGG(StagedBackbone):
    """3x3 conv-BN-ReLU blocks; each stage is a group of convs followed by a 2x2 max-pool."""

    def __init__(self, config: tuple[tuple[int, ...], ...], *, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        stages, shapes, cin = [], [], in_channels
        for i, widths in enumerate(config):
            layers: list[nn.Module] = []
            for width in widths:
                layers.append(conv_bn(cin, width))
                cin = width
            layers.append(nn.MaxPool2d(2))
            stages.append(nn.Sequential(*layers))
            shapes.append((cin, 2 ** (i + 1)))
        self._set_stages(nn.Identity(), stages, classifier_head(cin, num_classes), shapes)


@register_model("vgg11", family="vgg", description="VGG-11 with batch norm, 5 stages")
def vgg11(*, num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-11 with batch norm, 5 stages (9.2M parameters at 10 classes)."""
    return VGG(VGG11, num_classes=num_classes, in_channels=in_channels)
