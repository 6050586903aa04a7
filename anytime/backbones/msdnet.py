"""MSDNet at CIFAR size: the multi-scale dense network built for anytime prediction (Huang et al., ICLR 2018).

The network keeps features at several scales at once (32x32, 16x16 and 8x8 for CIFAR). Every layer adds
new channels at every scale it keeps, concatenated to what was there (dense connectivity): at the finest scale
kept, from a 3x3 convolution of that scale; at the others, half from one of that scale and half from a strided
3x3 convolution of the next finer scale. The
finest scales are dropped as the network deepens, each drop followed by a 1x1 transition that halves the
channels. A block of layers ends at each classifier, which reads the coarsest scale, so every exit sees
coarse, high-level features from the first block on: what exits attached to a ResNet's early stages lack.

The stage contract passes one tensor between stages, indexable by sample, so the scales travel packed: each
scale's map in channels-last order, flattened and concatenated into ``[B, N]`` (:func:`pack`), and viewed back
by the next block (:func:`unpack`). Exits read the coarsest scale through :meth:`MSDNet.exit_view`, so any
exit head kind works on it; the paper's own classifier is the head kind ``msdnet`` (:func:`msd_classifier`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone
from anytime.backbones.registry import register_model
from anytime.errors import AnytimeError


def _side(side: int, scale: int) -> int:
    """The side of scale ``scale`` for a square input of ``side`` pixels (a strided 3x3 conv rounds up)."""
    for _ in range(scale):
        side = -(-side // 2)
    return side


@dataclass(frozen=True)
class Layout:
    """The scales alive at one point: the channels of each, finest first, and which scale of the network the
    finest one is (``first``: 0 is the input resolution). Their sides follow from the (square) input's, which the
    packed length gives back (:meth:`shapes`), so one network serves any input size."""

    channels: tuple[int, ...]
    first: int

    def packed(self, side: int) -> int:
        """Numbers per sample once packed, for a square input of ``side`` pixels."""
        return self._packed_from(_side(side, self.first))

    def _packed_from(self, finest: int) -> int:
        return sum(c * _side(finest, j) ** 2 for j, c in enumerate(self.channels))

    def shapes(self, packed: int) -> tuple[tuple[int, int, int], ...]:
        """``(C, H, W)`` of each scale of a packed sample of ``packed`` numbers."""
        if torch.compiler.is_compiling():  # tracing runs once: solve, rather than trace a cache
            return self._solve(packed)
        return self._cached(packed)

    @functools.lru_cache(maxsize=64)  # noqa: B019  layouts are few and live as long as their network
    def _cached(self, packed: int) -> tuple[tuple[int, int, int], ...]:
        return self._solve(packed)

    def _solve(self, packed: int) -> tuple[tuple[int, int, int], ...]:
        # Rounding up only adds numbers, so the finest side is at most sqrt(packed / sum(c_j / 4^j)).
        finest = max(1, math.isqrt(int(packed / sum(c / 4**j for j, c in enumerate(self.channels)))) + 1)
        while finest > 1 and self._packed_from(finest) > packed:
            finest -= 1
        if self._packed_from(finest) != packed:
            raise AnytimeError(f"{packed} numbers per sample are not MSDNet's scales {self.channels} of any square "
                               "image: hand a segment the tensor the segment before it answered")  # fmt: skip
        return tuple((c, _side(finest, j), _side(finest, j)) for j, c in enumerate(self.channels))


def pack(maps: list[Tensor]) -> Tensor:
    """Maps ``[B, C_s, H_s, W_s]`` as one ``[B, N]`` tensor, each in channels-last order."""
    return torch.cat([m.permute(0, 2, 3, 1).reshape(m.shape[0], -1) for m in maps], dim=1)


def unpack(x: Tensor, layout: Layout) -> list[Tensor]:
    """The maps of a packed ``[B, N]`` tensor (views, channels-last in memory)."""
    maps, offset = [], 0
    for c, h, w in layout.shapes(x.shape[1]):
        n = c * h * w
        maps.append(x[:, offset : offset + n].reshape(x.shape[0], h, w, c).permute(0, 3, 1, 2))
        offset += n
    return maps


class CoarsestScale(nn.Module):
    """The coarsest map ``[B, C, H, W]`` of a packed multi-scale tensor (what MSDNet's classifiers read)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: Tensor) -> Tensor:
        """The last scale of ``x``, as a view."""
        c, h, w = self.layout.shapes(x.shape[1])[-1]
        return x[:, x.shape[1] - c * h * w :].reshape(x.shape[0], h, w, c).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"channels={self.layout.channels[-1]}, scale={self.layout.first + len(self.layout.channels) - 1}"


def _conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )  # fmt: skip


def msd_classifier(channels: int, num_classes: int, width: int = 128) -> nn.Sequential:
    """MSDNet's CIFAR classifier: two strided 3x3 conv-BN-ReLU of ``width`` channels, global average pooling
    and a linear layer."""
    return nn.Sequential(
        _conv_bn_relu(channels, width, 3, 2), _conv_bn_relu(width, width, 3, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(width, num_classes),
    )  # fmt: skip


def _conv(cin: int, cout: int, stride: int, bottleneck: int | None) -> nn.Sequential:
    """A 3x3 conv-BN-ReLU (strided to go one scale coarser), after a 1x1 bottleneck of at most
    ``bottleneck * cout`` channels."""
    if bottleneck is None:
        return _conv_bn_relu(cin, cout, 3, stride)
    inner = min(cin, bottleneck * cout)
    return nn.Sequential(*_conv_bn_relu(cin, inner, 1), *_conv_bn_relu(inner, cout, 3, stride))


class _ScaleGrowth(nn.Module):
    """New channels at one scale: a conv of the same scale and, where a finer one is alive, a strided conv of it."""

    def __init__(self, finer: int | None, same: int, grow: int, bottleneck: tuple[int | None, int | None]) -> None:
        super().__init__()
        half = grow // 2 if finer is not None else grow
        self.down = None if finer is None else _conv(finer, grow - half, 2, bottleneck[0])
        self.normal = _conv(same, half, 1, bottleneck[1])

    def forward(self, finer: Tensor | None, same: Tensor) -> Tensor:
        """``same`` with the new channels concatenated."""
        parts = [same] if self.down is None else [same, self.down(finer)]  # type: ignore[arg-type]
        return torch.cat([*parts, self.normal(same)], dim=1)


class MSDLayer(nn.Module):
    """One dense layer over the scales ``layout_in`` keeps; it may drop the finest (its features still feed
    the next scale's strided conv)."""

    def __init__(
        self, layout_in: Layout, keep: int, growth: tuple[int, ...], bottleneck: tuple[int, ...] | None
    ) -> None:
        super().__init__()
        drop = len(layout_in.channels) - keep
        self.drop = drop
        self.growths = nn.ModuleList()
        channels = []
        for j in range(drop, len(layout_in.channels)):
            scale = layout_in.first + j
            finer = layout_in.channels[j - 1] if j > 0 else None
            same = layout_in.channels[j]
            width = (
                (None, None) if bottleneck is None else (bottleneck[scale - 1] if j > 0 else None, bottleneck[scale])
            )
            self.growths.append(_ScaleGrowth(finer, same, growth[scale], width))
            channels.append(same + growth[scale])
        self.layout_out = Layout(tuple(channels), layout_in.first + drop)

    def forward(self, maps: list[Tensor]) -> list[Tensor]:
        """The maps of the scales kept, each grown."""
        out = []
        for j, grow in enumerate(self.growths, start=self.drop):
            out.append(grow(maps[j - 1] if j > 0 else None, maps[j]))
        return out


class Transition(nn.Module):
    """A 1x1 conv-BN-ReLU per scale, to ``reduction`` of the channels."""

    def __init__(self, layout_in: Layout, reduction: float) -> None:
        super().__init__()
        channels = tuple(max(1, math.floor(c * reduction)) for c in layout_in.channels)
        self.convs = nn.ModuleList(_conv_bn_relu(c, out, 1) for c, out in zip(layout_in.channels, channels))
        self.layout_out = Layout(channels, layout_in.first)

    def forward(self, maps: list[Tensor]) -> list[Tensor]:
        """Each map with fewer channels."""
        return [conv(m) for conv, m in zip(self.convs, maps)]


class FirstLayer(nn.Module):
    """The input at every scale: a 3x3 conv-BN-ReLU, then strided ones down the scales; returns them packed."""

    def __init__(self, in_channels: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        convs, cin = [], in_channels
        for s, width in enumerate(widths):
            convs.append(_conv_bn_relu(cin, width, 3, 1 if s == 0 else 2))
            cin = width
        self.convs = nn.ModuleList(convs)
        self.layout_out = Layout(widths, 0)

    def forward(self, x: Tensor) -> Tensor:
        """Packed maps of every scale."""
        if x.shape[-1] != x.shape[-2]:
            raise AnytimeError(f"msdnet takes square images (its packed scales give back their sides); got "
                               f"{x.shape[-2]}x{x.shape[-1]}: resize them with --image-size")  # fmt: skip
        maps = []
        for conv in self.convs:
            x = conv(x)
            maps.append(x)
        return pack(maps)


class MSDBlock(nn.Module):
    """The dense layers (and transitions) between two classifiers, reading and returning packed scales."""

    def __init__(self, layout_in: Layout, parts: list[nn.Module]) -> None:
        super().__init__()
        self.layout_in = layout_in
        self.layout_out = parts[-1].layout_out if parts else layout_in
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        """The block's packed output."""
        maps = unpack(x, self.layout_in)
        for part in self.parts:
            maps = part(maps)
        return pack(maps)


class MSDHead(nn.Module):
    """The classifier of the coarsest scale of a packed tensor."""

    def __init__(self, layout: Layout, num_classes: int) -> None:
        super().__init__()
        self.read = CoarsestScale(layout)
        self.classifier = msd_classifier(layout.channels[-1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes]``."""
        return self.classifier(self.read(x))


class MSDNet(StagedBackbone):
    """MSDNet for small images: one stage per block, one classifier after each (see the module's docstring).

    ``blocks`` blocks of layers, ``base`` in the first and ``step`` in each later one; ``channels`` at the
    first scale after the first layer, ``growth`` new channels per layer at the first scale. Scale ``s`` has
    ``growth_factors[s]`` times the channels and growth, and its bottlenecks at most ``bottleneck_factors[s]``
    times the growth. The finest scale is dropped evenly along the layers, each drop followed by a transition
    to ``reduction`` of the channels. Defaults: the CIFAR configuration of the authors' PyTorch code for anytime
    prediction. Convolutions keep PyTorch's default initialisation (the authors' code draws them He-normal).
    """

    width_sliceable = False  # channels are concatenated: a leading slice of every layer is not a narrower network

    def __init__(
        self, *, blocks: int = 7, base: int = 4, step: int = 2, channels: int = 16, growth: int = 6,
        growth_factors: tuple[int, ...] = (1, 2, 4), bottleneck_factors: tuple[int, ...] | None = (1, 2, 4),
        reduction: float = 0.5, num_classes: int = 10, in_channels: int = 3,
    ) -> None:  # fmt: skip
        super().__init__(num_classes=num_classes, in_channels=in_channels)
        scales = len(growth_factors)
        if bottleneck_factors is not None and len(bottleneck_factors) != scales:
            raise AnytimeError(f"one bottleneck factor per scale: {len(bottleneck_factors)} for {scales} scales")
        stem = FirstLayer(in_channels, tuple(channels * f for f in growth_factors))
        layers = base + step * (blocks - 1)
        interval = math.ceil(layers / scales)
        grow = tuple(growth * f for f in growth_factors)
        layout, done, stages, shapes = stem.layout_out, 0, [], []
        self.layouts: dict[str, Layout] = {"stem": layout}
        for b in range(blocks):
            block_in, parts = layout, []
            for _ in range(base if b == 0 else step):
                keep = scales - done // interval
                done += 1
                layer = MSDLayer(layout, keep, grow, bottleneck_factors)
                parts.append(layer)
                dropped = len(layer.layout_out.channels) < len(layout.channels)
                layout = layer.layout_out
                if dropped and reduction < 1:
                    parts.append(Transition(layout, reduction))
                    layout = parts[-1].layout_out
            stages.append(MSDBlock(block_in, parts))
            self.layouts[f"stages.{b}"] = layout
            shapes.append((layout.channels[-1], 2 ** (layout.first + len(layout.channels) - 1)))
        self._set_stages(stem, stages, MSDHead(layout, num_classes), shapes)

    def exit_view(self, name: str, shape: tuple[int, ...]) -> tuple[nn.Module, tuple[int, ...]]:
        """What an exit after ``name`` reads from a packed sample of ``shape``: the coarsest scale, and its
        ``(C, H, W)``."""
        layout = self.layouts[name]
        return CoarsestScale(layout), layout.shapes(shape[0])[-1]


@register_model("msdnet", family="msdnet",
                description="MSDNet, the anytime multi-scale dense net: 7 blocks at CIFAR size, 3 scales")  # fmt: skip
def msdnet(*, num_classes: int = 10, in_channels: int = 3) -> MSDNet:
    """The CIFAR network for anytime prediction of the authors' code: 7 blocks (4 layers, then 2 per block), 16
    channels, growth 6, scale factors 1-2-4, bottlenecks, reduction 0.5: 0.85M parameters and 0.10 GFLOPs to its
    last classifier (with a ``msdnet`` classifier after each of the other 6 blocks, 3.0M parameters)."""
    return MSDNet(num_classes=num_classes, in_channels=in_channels)
