"""Input resolution as a knob: one network run at several input sizes, each size a step.

Step k resizes the input (bilinear, antialiased when shrinking) to ``sizes[k]`` pixels a side, or, for a
region-of-interest step (``c24``), keeps the central 24 x 24 pixels at full resolution; the same convolution weights
then run on it. Every batch norm keeps one set of statistics and affine parameters per step (as resolution-switchable
networks do: the statistics of a 16-pixel image are not those of a 32-pixel one), so the steps are trained together,
each batch through every step. Steps are cheapest first and not incremental: the runtime chooses one per request.
The backbone must pool globally before its classifier (the zoo's ResNets, VGG, MobileNetV2), so that any size works.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from anytime.errors import AnytimeError
from anytime.families.exits import ExitInfo
from anytime.families.separate import SeparateSteps, count_flops


@dataclass(frozen=True)
class Resolution:
    """One step's input: ``size`` pixels a side, by resizing the whole image or (``crop``) by keeping its centre."""

    size: int
    crop: bool = False

    @property
    def label(self) -> str:
        """``16px`` or ``crop24``."""
        return f"crop{self.size}" if self.crop else f"{self.size}px"

    def apply(self, x: Tensor) -> Tensor:
        """``x`` ``[B, C, H, W]`` as this step sees it."""
        height, width = x.shape[-2:]
        if self.crop:
            top, left = (height - self.size) // 2, (width - self.size) // 2
            return x[..., top : top + self.size, left : left + self.size]
        if (height, width) == (self.size, self.size):
            return x
        shrink = self.size < min(height, width)
        return F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=shrink)


def parse_resolutions(text: str | Sequence[str], image_size: tuple[int, int]) -> tuple[Resolution, ...]:
    """``"16,24,c24,32"``: sizes in pixels, ``cN`` a central N x N crop; at least two, none larger than the images
    (``image_size``), no size twice."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    steps = []
    for item in items:
        match = re.fullmatch(r"(c?)(\d+)", str(item))
        if match is None:
            raise AnytimeError(f"--resolutions takes sizes in pixels and cN crops, e.g. 16,24,c24,32 (got {item!r})")
        steps.append(Resolution(int(match.group(2)), crop=bool(match.group(1))))
    if len(steps) < 2 or len(set(steps)) != len(steps):
        raise AnytimeError(f"a resolution ladder needs at least two different steps (got {','.join(items) or 'none'})")
    largest = min(image_size)
    for step in steps:
        if not 4 <= step.size <= largest:
            raise AnytimeError(f"resolution {step.label}: the images are {image_size[0]}x{image_size[1]}; give sizes "
                               f"from 4 to {largest} pixels")  # fmt: skip
    return tuple(steps)


class ResolutionBatchNorm(nn.Module):
    """One batch norm per step; the ladder says which step runs."""

    def __init__(self, norm: nn.BatchNorm2d, steps: int, ladder: ResolutionLadder) -> None:
        super().__init__()
        self.norms = nn.ModuleList(copy.deepcopy(norm) for _ in range(steps))
        object.__setattr__(self, "_ladder", ladder)

    def forward(self, x: Tensor) -> Tensor:
        return self.norms[self._ladder.step](x)


class ResolutionLadder(SeparateSteps):
    """A backbone whose steps are input resolutions (see the module's docstring), cheapest first by FLOPs."""

    family = "resolution ladder"

    def __init__(self, backbone: nn.Module, resolutions: Sequence[Resolution], *,
                 input_shape: tuple[int, int, int]) -> None:  # fmt: skip
        super().__init__()
        self.backbone = backbone
        self.input_shape = input_shape
        self.step = len(resolutions) - 1
        norms = [(name, m) for name, m in backbone.named_modules() if isinstance(m, nn.BatchNorm2d)]
        if not norms:
            raise AnytimeError("a resolution ladder keeps batch-norm statistics per resolution, and this backbone has "
                               "no batch norm; use a ResNet, VGG or MobileNetV2 from the zoo")  # fmt: skip
        for name, norm in norms:
            parent, _, leaf = name.rpartition(".")
            setattr(backbone.get_submodule(parent) if parent else backbone, leaf,
                    ResolutionBatchNorm(norm, len(resolutions), self))  # fmt: skip
        self.resolutions = tuple(resolutions)
        flops = [
            count_flops(self, lambda x, k=k: self._run(x, k), input_shape)  # type: ignore[misc]
            for k in range(len(resolutions))
        ]
        if flops != sorted(flops):
            raise AnytimeError(f"give the resolutions cheapest first: {', '.join(r.label for r in resolutions)} cost "
                               f"{', '.join(f'{f / 1e6:.1f}' for f in flops)} MFLOPs")  # fmt: skip
        self.backbone_flops = flops[-1]
        params = sum(p.numel() for n, p in backbone.named_parameters() if ".norms." not in n)
        per_step_norm = sum(p.numel() for n, p in backbone.named_parameters() if ".norms.0." in n)
        self.exit_info = tuple(
            ExitInfo(index=k, name=r.label, shape=(), flops=f, cost_flops=sum(flops[: k + 1]), params=params + per_step_norm,
                     head_flops=0, head_params=0)
            for k, (r, f) in enumerate(zip(resolutions, flops))
        )  # fmt: skip

    @property
    def num_steps(self) -> int:
        """The number of resolutions."""
        return len(self.resolutions)

    def _run(self, x: Tensor, k: int) -> Tensor:
        self.step = k
        try:
            return self.backbone(self.resolutions[k].apply(x))
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AnytimeError(f"{self.backbone.__class__.__name__} cannot take {self.resolutions[k].label} inputs "
                               f"({first}); give larger sizes") from None  # fmt: skip
        finally:
            self.step = self.num_steps - 1

    def extra_repr(self) -> str:
        return f"resolutions={[r.label for r in self.resolutions]}"
