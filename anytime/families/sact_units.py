"""The pieces :class:`~anytime.families.sact.SACTResNet` is built from: the residual stages found in a backbone
(:func:`residual_stages`, each unit a :class:`Unit` whose branch is a tuple of :class:`Layer`), the
:class:`HaltingUnit` that scores the positions after each unit, and the sparse execution's machinery
(:class:`Padded`, the zero-bordered channels-last feature grid; :func:`dilate`; :func:`autocast_on`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.errors import AnytimeError

SUPPORTED = "the zoo's ResNets (resnet20, resnet32, resnet56, resnet18, resnet50, resnet29_bottleneck) or tv:resnet18/34/50/101/152"


@dataclass(frozen=True)
class Layer:
    """A convolution of a residual branch and its batch norm, by their names in ``owner`` (so that a form which
    folds the norm into the convolution, replacing it, is seen), and whether a ReLU follows."""

    owner: nn.Module
    conv_name: str
    norm_name: str
    relu: bool

    @property
    def conv(self) -> nn.Conv2d:
        return getattr(self.owner, self.conv_name)

    @property
    def radius(self) -> int:
        return self.conv.kernel_size[0] // 2

    def folded(self) -> tuple[Tensor, Tensor]:
        """Weights ``[k*k*Cin, Cout]`` (rows ordered by kernel row, column, input channel) and bias, with the
        batch norm's running statistics folded in."""
        conv, norm = self.conv, getattr(self.owner, self.norm_name)
        weight, bias = conv.weight, conv.bias if conv.bias is not None else conv.weight.new_zeros(conv.out_channels)
        if isinstance(norm, nn.BatchNorm2d):
            scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)  # type: ignore[operator]
            bias = (bias - norm.running_mean) * scale + norm.bias  # type: ignore[operator]
            weight = weight * scale[:, None, None, None]
        return weight.permute(2, 3, 1, 0).reshape(-1, conv.out_channels), bias


@dataclass(frozen=True)
class Unit:
    """A residual unit: ``relu(branch(x) + x)``, ``module`` its dense forward, ``layers`` its branch."""

    module: nn.Module
    layers: tuple[Layer, ...]


def _zoo_layers(block: nn.Module) -> tuple[Layer, ...] | None:
    layers = []
    for part in block.branch:  # type: ignore[attr-defined]
        mods = list(part.children()) if isinstance(part, nn.Sequential) else []
        if not (2 <= len(mods) <= 3 and isinstance(mods[0], nn.Conv2d) and isinstance(mods[1], nn.BatchNorm2d)):
            return None
        if len(mods) == 3 and not isinstance(mods[2], nn.ReLU):
            return None
        layers.append(Layer(part, "0", "1", len(mods) == 3))
    return tuple(layers)


def _torchvision_layers(block: nn.Module) -> tuple[Layer, ...]:
    names = ("1", "2", "3") if hasattr(block, "conv3") else ("1", "2")
    return tuple(Layer(block, f"conv{n}", f"bn{n}", n != names[-1]) for n in names)


def _sparse_ready(unit: Unit) -> bool:
    """Whether a later unit of a stage can run at scattered positions: stride 1, no groups, 1x1 or 3x3 kernels
    that keep the size, an identity shortcut."""
    convs = [layer.conv for layer in unit.layers]
    shortcut = getattr(unit.module, "shortcut", None) or getattr(unit.module, "downsample", None)
    return (
        bool(convs)
        and (shortcut is None or isinstance(shortcut, nn.Identity))
        and all(c.stride == (1, 1) and c.groups == 1 and c.dilation == (1, 1) and c.kernel_size in ((1, 1), (3, 3))
                and c.padding == (c.kernel_size[0] // 2,) * 2 for c in convs)
    )  # fmt: skip


def residual_stages(backbone: nn.Module) -> tuple[tuple[str, ...], list[list[Unit]], tuple[str, ...]]:
    """The names of the stem's modules in ``backbone``, each stage's residual units and the names of the head's
    modules (``""``: flatten), in forward order. Refuses a backbone without residual stages of at least two units
    (naming what works)."""
    from torchvision.models import ResNet as TorchvisionResNet
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from anytime.backbones.base import StagedBackbone
    from anytime.backbones.resnet import ResidualBlock

    stages: list[list[Unit]] = []
    if isinstance(backbone, StagedBackbone):
        for stage in backbone.stages:
            blocks = list(stage.children()) if isinstance(stage, nn.Sequential) else []
            layers = [_zoo_layers(b) if isinstance(b, ResidualBlock) else None for b in blocks]
            if not blocks or any(found is None for found in layers):
                stages = []
                break
            stages.append([Unit(b, found) for b, found in zip(blocks, layers)])  # type: ignore[arg-type]
        stem, head = ("stem",), ("head",)  # type: tuple[str, ...], tuple[str, ...]
    elif isinstance(backbone, TorchvisionResNet):
        for name in ("layer1", "layer2", "layer3", "layer4"):
            blocks = list(getattr(backbone, name).children())
            if not all(isinstance(b, (BasicBlock, Bottleneck)) for b in blocks):
                stages = []
                break
            stages.append([Unit(b, _torchvision_layers(b)) for b in blocks])
        stem, head = ("conv1", "bn1", "relu", "maxpool"), ("avgpool", "", "fc")
    what = type(backbone).__name__
    if not stages:
        raise AnytimeError(f"SACT halts inside residual stages and {what} has none; use {SUPPORTED}")
    if any(len(stage) < 2 for stage in stages):
        raise AnytimeError(
            f"SACT needs stages of at least two residual units, and {what} has a stage of one; use {SUPPORTED}"
        )
    if not all(_sparse_ready(unit) for stage in stages for unit in stage[1:]):
        raise AnytimeError(f"{what}'s later residual units have strided, grouped or projected branches, which SACT "
                           f"does not run position by position; use {SUPPORTED}")  # fmt: skip
    return stem, stages, head


class HaltingUnit(nn.Module):
    """``sigmoid(conv3x3(x) + w . avgpool(x) + b)`` per position (``spatial``), or without the convolution per
    image; the bias starts at -3, so every unit runs at first (as in the paper)."""

    def __init__(self, channels: int, spatial: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 1, 3, padding=1) if spatial else None
        self.fc = nn.Linear(channels, 1)
        nn.init.zeros_(self.fc.weight)
        nn.init.constant_(self.fc.bias, -3.0)
        if self.conv is not None:
            nn.init.zeros_(self.conv.weight)
            nn.init.zeros_(self.conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Scores ``[B, H, W]`` (``[B, 1, 1]`` per image)."""
        score = self.fc(x.mean(dim=(2, 3)))[:, :, None]
        if self.conv is not None:
            score = score + self.conv(x)[:, 0]
        return torch.sigmoid(score)


class Padded:
    """A feature map ``[B, C, H, W]`` as rows of a zero-bordered, channels-last matrix ``[B*(H+2)*(W+2), C]``,
    and the row of every position (``rows[b*H*W + i*W + j]``)."""

    def __init__(self, x: Tensor) -> None:
        batch, channels, height, width = x.shape
        self.shape = (batch, height, width)
        self.width = width + 2
        padded = x.new_zeros(batch, height + 2, width + 2, channels)
        padded[:, 1:-1, 1:-1] = x.permute(0, 2, 3, 1)
        self.data = padded.view(-1, channels)
        b, i, j = torch.meshgrid(torch.arange(batch, device=x.device), torch.arange(height, device=x.device),
                                 torch.arange(width, device=x.device), indexing="ij")  # fmt: skip
        self.rows = (b * (height + 2) * self.width + (i + 1) * self.width + (j + 1)).reshape(-1)
        self.offsets = torch.tensor([di * self.width + dj for di in (-1, 0, 1) for dj in (-1, 0, 1)], device=x.device)

    def empty(self, channels: int) -> Tensor:
        return self.data.new_zeros(self.data.shape[0], channels)

    def patches(self, data: Tensor, rows: Tensor, radius: int) -> Tensor:
        """``[n, k*k*C]``: the neighbourhoods of ``rows`` in ``data`` (a matrix laid out like this one)."""
        if radius == 0:
            return data.index_select(0, rows)
        return data.index_select(0, (rows[:, None] + self.offsets[None, :]).view(-1)).view(rows.numel(), -1)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (the sparse execution runs in float32 only)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def dilate(mask: Tensor, radius: int) -> Tensor:
    """The positions within ``radius`` (a square neighbourhood) of those set in ``mask`` ``[B, H, W]``."""
    if radius == 0:
        return mask
    return F.max_pool2d(mask[:, None].float(), 2 * radius + 1, stride=1, padding=radius)[:, 0] > 0
