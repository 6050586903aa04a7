"""Pre-activation ResNet-18 for CIFAR (He et al., "Identity Mappings in Deep Residual Networks")."""

from __future__ import annotations

from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone, classifier_head
from anytime.backbones.registry import register_model
from anytime.backbones.resnet import drop_path


class PreActBlock(nn.Module):
    """``branch(pre(x)) + shortcut(...)`` with ``pre`` = BN-ReLU; a projection shortcut reads the
    pre-activated input, an identity shortcut the raw input, as in the paper. ``cut`` and ``drop_prob`` as
    in :class:`~anytime.backbones.resnet.ResidualBlock`; a skipped branch with a projection still pays for
    the pre-activation and the 1x1 projection, which keep the shapes."""

    cut: str | None = None
    drop_prob: float = 0.0

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=False))
        self.branch = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        )  # fmt: skip
        self.projects = stride != 1 or cin != cout
        self.shortcut: nn.Module = (
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if self.projects else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.cut == "branch":
            return self.shortcut(self.pre(x)) if self.projects else x
        pre = self.pre(x)
        if self.cut == "shortcut":
            return self.branch(pre)
        out = self.branch(pre)
        if self.training and self.drop_prob > 0:
            out = drop_path(out, self.drop_prob)
        return out + self.shortcut(pre if self.projects else x)


class PreActResNet(StagedBackbone):
    """Stem conv, four stages of pre-activation blocks, and BN-ReLU before pooling in the head."""

    def __init__(self, blocks: tuple[int, ...], *, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        cin, stages, shapes = 64, [], []
        for i, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            layer = []
            for j in range(count):
                layer.append(PreActBlock(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = width
            stages.append(nn.Sequential(*layer))
            shapes.append((cin, 2**i))
        head = classifier_head(cin, num_classes, pre=nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True)))
        self._set_stages(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), stages, head, shapes)


@register_model("preact_resnet18", family="resnet", description="pre-activation ResNet-18 for CIFAR")
def preact_resnet18(*, num_classes: int = 10, in_channels: int = 3) -> PreActResNet:
    """Pre-activation ResNet-18 for CIFAR (11.2M parameters at 10 classes)."""
    return PreActResNet((2, 2, 2, 2), num_classes=num_classes, in_channels=in_channels)
