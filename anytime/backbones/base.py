"""The stage contract every zoo backbone obeys: stem -> stages -> head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Token ids of example sentences: past the special tokens, inside any vocabulary a text model accepts (>= 100).
_EXAMPLE_TOKEN = 4
_EXAMPLE_TOKENS = 100


@dataclass(frozen=True)
class StageInfo:
    """One stage of a backbone: where it is, and the shape of what it outputs."""

    name: str  # module name inside the model, e.g. "stages.0"
    channels: int  # channels of the stage's output feature map
    stride: int  # spatial reduction of the stage's output relative to the model input


class StagedBackbone(nn.Module):
    """A network split as ``stem -> stages[0], ..., stages[S-1] -> head``.

    Exits, slicing and block skipping attach to the stage boundaries, so every zoo model is built
    this way. Subclasses set ``stem``, ``stages`` (an ``nn.ModuleList``), ``head`` (pooling, flatten
    and classifier) and ``stage_info`` (one :class:`StageInfo` per stage).
    """

    stem: nn.Module
    stages: nn.ModuleList
    head: nn.Module
    stage_info: tuple[StageInfo, ...]
    num_classes: int
    in_channels: int
    width_sliceable: bool = True  # a leading slice of every layer's channels is a narrower network of the same kind

    def __init__(self, *, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.in_channels = in_channels

    def _set_stages(
        self, stem: nn.Module, stages: list[nn.Module], head: nn.Module, shapes: list[tuple[int, int]]
    ) -> None:
        """Install the parts; ``shapes`` is (channels, stride) of each stage's output."""
        self.stem = stem
        self.stages = nn.ModuleList(stages)
        self.head = head
        self.stage_info = tuple(StageInfo(f"stages.{i}", c, s) for i, (c, s) in enumerate(shapes))

    def forward_stages(self, x: Tensor) -> list[Tensor]:
        """The output of every stage, in order."""
        outputs = []
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
            outputs.append(x)
        return outputs

    def forward_features(self, x: Tensor) -> Tensor:
        """The output of the last stage."""
        return self.forward_stages(x)[-1]

    def forward_head(self, features: Tensor) -> Tensor:
        """Logits from the last stage's output."""
        return self.head(features)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes]``."""
        return self.head(self.forward_features(x))


def takes_tokens(model: nn.Module) -> bool:
    """Whether ``model`` (or the backbone it wraps) is a text encoder reading token ids."""
    return "text" in (getattr(model, "modality", None), getattr(getattr(model, "backbone", None), "modality", None))


def example_input(
    shape: tuple[int, ...], batch: int = 1, *, tokens: bool = False, device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:  # fmt: skip
    """A batch of model inputs of one sample's ``shape``: zeros (random normal values with a ``generator``), or with
    ``tokens`` the token ids of a ``(T,)`` sentence with no padding (a fixed real token, or random ones with a
    ``generator``), as a sentence of ``T`` tokens costs whatever its words."""
    if tokens:
        if len(shape) != 1:
            raise ValueError(f"token ids have one dimension per sample (T,), not {shape}")
        if generator is None:
            return torch.full((batch, shape[0]), _EXAMPLE_TOKEN, dtype=torch.int64, device=device)
        return torch.randint(_EXAMPLE_TOKEN, _EXAMPLE_TOKENS, (batch, shape[0]), generator=generator).to(device)
    if generator is None:
        return torch.zeros(batch, *shape, device=device)
    return torch.randn(batch, *shape, generator=generator).to(device)


def classifier_head(channels: int, num_classes: int, *, pre: nn.Module | None = None) -> nn.Sequential:
    """Global average pooling, flatten and a linear classifier (optionally after ``pre``, e.g. BN-ReLU)."""
    layers: list[nn.Module] = [] if pre is None else [pre]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class Scale(nn.Module):
    """Multiply by a fixed number (the classifier's temperature)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        """``x`` times the factor."""
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def conv_bn(
    cin: int, cout: int, kernel: int = 3, stride: int = 1, *, groups: int = 1, act: type[nn.Module] | None = nn.ReLU
) -> nn.Sequential:
    """Convolution (no bias), batch norm and an optional activation."""
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)
