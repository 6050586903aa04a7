"""The layers a sliced network is made of (see :mod:`anytime.families.slicing`): :class:`Context`, the step
every sliced layer of one model is running, shared by reference; :class:`SlicedConv2d`, a convolution on the
leading slice of its weight; :class:`SlicedPadShortcut`, the small CIFAR ResNets' shortcut padded to the sliced
width; :class:`SwitchableBatchNorm2d` and :class:`SwitchableLinear`, one batch norm and one classifier per step;
and :func:`sliced_channels`, the channels a layer keeps at a ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.cifar_resnet import PadShortcut
from anytime.errors import AnytimeError


def sliced_channels(channels: int, ratio: float) -> int:
    """Channels a layer of ``channels`` keeps at ``ratio`` (rounded, at least 1)."""
    return max(1, int(channels * ratio + 0.5))


@dataclass
class Context:
    """The step every sliced layer of one model is running (shared by reference, not a module)."""

    ratio: float = 1.0
    step: int = 0
    probe: bool = False
    shape: tuple[int, int, int] = (3, 32, 32)  # one sample, for dry runs and FLOP counts


class SlicedConv2d(nn.Conv2d):
    """A convolution that runs on the leading slice of its weight: its input channels are whatever it is
    given, its output channels the context's ratio of its own when ``scale_out`` is set."""

    scale_out: bool
    _context: Context

    def forward(self, x: Tensor) -> Tensor:
        cin = x.shape[1]
        cout = sliced_channels(self.out_channels, self._context.ratio) if self.scale_out else self.out_channels
        if self.groups == 1:
            groups, per_group = 1, cin
        else:
            per_group = self.in_channels // self.groups
            groups = cin // per_group
            if groups * per_group != cin or cout % groups:
                raise AnytimeError(
                    f"a grouped convolution ({self.groups} groups of {per_group} channels) cannot take {cin} input "
                    "channels; this slice breaks the groups"
                )
        if cin > self.in_channels or (self.groups == 1 and cin < 1):
            raise AnytimeError(f"a sliced convolution of {self.in_channels} input channels got {cin}")
        weight = self._sliced(cout, per_group)
        bias = None if self.bias is None else self.bias[:cout]
        if self._context.probe:
            self._used = weight.numel() + (0 if bias is None else bias.numel())
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def _sliced(self, cout: int, cin: int) -> Tensor:
        full = self.weight
        if cout == full.shape[0] and cin == full.shape[1]:
            return full
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # traced (export, compile): no Python cache
            return full[:cout, :cin]
        # Inference: keep a contiguous copy per slice, so a narrow step does not copy weights on every call.
        key = (cout, cin)
        cache: dict[tuple[int, int], tuple[int, int, Tensor]] = self.__dict__.setdefault("_slice_cache", {})
        stamp = (full.data_ptr(), full._version)
        hit = cache.get(key)
        if hit is None or hit[:2] != stamp:
            hit = (*stamp, full.detach()[:cout, :cin].contiguous())
            cache[key] = hit
        return hit[2]

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.__dict__.pop("_slice_cache", None)
        super()._load_from_state_dict(*args, **kwargs)


class SlicedPadShortcut(PadShortcut):
    """The parameter-free shortcut of the small CIFAR ResNets, padding to the sliced output width.

    It pads both sides, as the dense shortcut does, so at a narrow width its input lands on other channel
    positions than at full width (at 0.5 in a 16 -> 32 block: channels 4-11, against 8-23). Aligning them with
    the full width would drop the shortcut altogether below width 0.5, so the slices train with this layout.
    """

    _context: Context
    out_full: int

    def forward(self, x: Tensor) -> Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        extra = sliced_channels(self.out_full, self._context.ratio) - x.shape[1]
        if extra:
            x = F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))
        return x


class SwitchableBatchNorm2d(nn.Module):
    """One batch norm per step, each sized to the channels the step feeds it."""

    def __init__(self, norms: Sequence[nn.BatchNorm2d], context: Context) -> None:
        super().__init__()
        self.norms = nn.ModuleList(norms)
        object.__setattr__(self, "_context", context)

    def forward(self, x: Tensor) -> Tensor:
        context = self._context
        if context.probe:
            self._seen = x.shape[1]
            return x
        norm = self.norms[context.step]
        if norm.num_features != x.shape[1]:
            raise AnytimeError(
                f"step {context.step}'s batch norm has {norm.num_features} channels but got {x.shape[1]}"
            )
        return norm(x)


class SwitchableLinear(nn.Module):
    """One classifier per step, reading the step's width of features."""

    def __init__(self, heads: Sequence[nn.Linear], context: Context) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)
        object.__setattr__(self, "_context", context)

    def forward(self, x: Tensor) -> Tensor:
        context = self._context
        if context.probe:
            self._seen = x.shape[-1]
            return x[..., :1].expand(*x.shape[:-1], self.heads[0].out_features)
        return self.heads[context.step](x)
