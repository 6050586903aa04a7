"""MobileNetV2 for CIFAR: stride 1 in the stem and in the 24-channel group, so 32x32 ends at 4x4."""

from __future__ import annotations

from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone, classifier_head, conv_bn
from anytime.backbones.registry import register_model

# (expansion, output channels, blocks, stride of the first block); one stage per row
CIFAR_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                  (6, 320, 1, 1))  # fmt: skip


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise, 1x1 linear projection; the identity shortcut only where shapes agree."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        layers: list[nn.Module] = [] if expansion == 1 else [conv_bn(cin, hidden, 1, act=nn.ReLU6)]
        layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6), conv_bn(hidden, cout, 1, act=None)]
        self.branch = nn.Sequential(*layers)
        self.shortcut: nn.Module | None = nn.Identity() if stride == 1 and cin == cout else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.branch(x)
        return out if self.shortcut is None else out + self.shortcut(x)


class MobileNetV2(StagedBackbone):
    """Seven stages of inverted residuals, then a 1x1 conv to 1280 channels in the head."""

    def __init__(self, *, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        cin, stride, stages, shapes = 32, 1, [], []
        for expansion, cout, count, first_stride in CIFAR_SETTINGS:
            stages.append(
                nn.Sequential(
                    *(
                        InvertedResidual(cin if j == 0 else cout, cout, first_stride if j == 0 else 1, expansion)
                        for j in range(count)
                    )
                )  # fmt: skip
            )
            cin, stride = cout, stride * first_stride
            shapes.append((cout, stride))
        head = classifier_head(1280, num_classes, pre=conv_bn(cin, 1280, 1, act=nn.ReLU6))
        self._set_stages(conv_bn(in_channels, 32, act=nn.ReLU6), stages, head, shapes)


@register_model("mobilenetv2", family="mobilenet", description="MobileNetV2 for CIFAR, 7 stages")
def mobilenetv2(*, num_classes: int = 10, in_channels: int = 3) -> MobileNetV2:
    """MobileNetV2 for CIFAR, 7 stages (2.2M parameters at 10 classes)."""
    return MobileNetV2(num_classes=num_classes, in_channels=in_channels)
