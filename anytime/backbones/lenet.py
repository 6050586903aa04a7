"""LeNet-5 style network for 32x32 inputs."""

from __future__ import annotations

from torch import nn

from anytime.backbones.base import StagedBackbone
from anytime.backbones.registry import register_model


class LeNet(StagedBackbone):
    """Two 5x5 conv + max-pool stages (6 and 16 channels), then fully connected 120-84-classes.

    Padding 2 keeps the stage strides integral (2 and 4); the head pools to 5x5 so that its first
    fully connected layer has LeNet-5's 400 inputs at any input size. No batch norm, as in the original:
    the edge-training studies time the network the field times.
    """

    def __init__(self, *, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        stage1 = nn.Sequential(nn.Conv2d(in_channels, 6, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        stage2 = nn.Sequential(nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        head = nn.Sequential(
            nn.AdaptiveAvgPool2d(5), nn.Flatten(),
            nn.Linear(400, 120), nn.ReLU(inplace=True), nn.Linear(120, 84), nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )  # fmt: skip
        self._set_stages(nn.Identity(), [stage1, stage2], head, [(6, 2), (16, 4)])


@register_model("lenet", family="lenet", description="LeNet-5 style, 2 conv stages, 62k parameters")
def lenet(*, num_classes: int = 10, in_channels: int = 3) -> LeNet:
    """LeNet-5 style network (62k parameters at 10 classes)."""
    return LeNet(num_classes=num_classes, in_channels=in_channels)
