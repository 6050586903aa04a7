"""The inference form of a model: what a deployment runs instead of the training graph.

Three independent changes, none of which alters a result beyond float rounding:

- ``fold``: every batch norm that directly follows a convolution is folded into it (the convolution gets the
  norm's scale and shift, the norm becomes the identity). A max-pool between the two is folded across when
  every channel's scale is positive, since a max commutes with a positive affine map (airbench-style
  ``conv -> max-pool -> BN`` groups). Pairs are found structurally, so the model keeps its own forward code
  (exits, cutting and block-skipping flags go on working): adjacent modules in an ``nn.Sequential`` and
  torchvision's ResNets and their blocks (``conv1 -> bn1``...), whose forward applies each norm to its convolution.
  Adaptive average pooling, flattening and a linear layer adjacent in an ``nn.Sequential`` (the pooled exit
  heads, and classifiers such as LeNet's) become one module: at batch 1 each of the three costs a few
  microseconds of module call and operator, as much as a head computes (four ResNet-32 heads: 74 us as
  modules, 33-39 us as one).
- ``channels-last``: the weights in NHWC layout, which oneDNN and cuDNN run faster for most convolutions.
- ``compile``: ``torch.compile`` of every part (stage and exit head) on its own, so early exit still stops
  after the part it needs.

:func:`inference_form` returns a converted copy, checked against the original on a probe batch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.errors import AnytimeError

FORM_PARTS: tuple[str, ...] = ("fold", "channels-last", "compile")
_TOLERANCE = 1e-3  # of the logits, relative to their scale: float32 rounding of a folded net stays far below it


@dataclass(frozen=True)
class InferenceForm:
    """Which inference changes a model runs with (see the module's docstring); ``eager`` is none of them."""

    fold: bool = False
    channels_last: bool = False
    compile: bool = False

    @property
    def name(self) -> str:
        """``eager`` or the parts joined by ``+``, e.g. ``fold+channels-last``."""
        parts = [p for p, on in zip(FORM_PARTS, (self.fold, self.channels_last, self.compile)) if on]
        return "+".join(parts) or "eager"

    @classmethod
    def parse(cls, text: str) -> InferenceForm:
        """From :attr:`name` (``eager``, ``fold``, ``fold+channels-last+compile``...); a wrong one is a one-line error."""
        parts = [p.strip() for p in str(text).split("+") if p.strip()]
        if parts == ["eager"]:
            return cls()
        unknown = [p for p in parts if p not in FORM_PARTS]
        if unknown or not parts:
            raise AnytimeError(f"unknown inference form '{text}': use 'eager' or any of {', '.join(FORM_PARTS)} "
                               "joined by '+', e.g. fold+channels-last")  # fmt: skip
        return cls("fold" in parts, "channels-last" in parts, "compile" in parts)


def _pairs(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Conv2d, nn.BatchNorm2d, bool]]:
    """``(parent, norm's name in parent, conv, norm, across_pool)`` for every foldable pair."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    blocks = (BasicBlock, Bottleneck, ResNet)
    for parent in model.modules():
        if type(parent) is nn.Sequential:
            children = list(parent.named_children())
            for i, (name, child) in enumerate(children):
                if type(child) is not nn.BatchNorm2d:
                    continue
                j, across_pool = i - 1, False
                while j >= 0 and type(children[j][1]) is nn.MaxPool2d:
                    j, across_pool = j - 1, True
                if j >= 0 and type(children[j][1]) is nn.Conv2d:
                    yield parent, name, children[j][1], child, across_pool  # type: ignore[misc]
        elif isinstance(parent, blocks):
            for k in (1, 2, 3):
                conv, norm = getattr(parent, f"conv{k}", None), getattr(parent, f"bn{k}", None)
                if type(conv) is nn.Conv2d and type(norm) is nn.BatchNorm2d:
                    yield parent, f"bn{k}", conv, norm, False  # type: ignore[misc]


@torch.no_grad()
def fold_batchnorm(model: nn.Module) -> int:
    """Fold, in place, every batch norm that follows a convolution (module docstring); the number folded.

    The model must be in eval mode (the running statistics are what is folded)."""
    if model.training:
        raise AnytimeError("batch norm folds only in eval mode: call model.eval() first")
    folded = 0
    for parent, name, conv, norm, across_pool in list(_pairs(model)):
        if not norm.track_running_stats or norm.running_mean is None or norm.running_var is None:
            continue
        scale = torch.rsqrt(norm.running_var + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight
        if across_pool and not bool((scale > 0).all()):
            continue
        shift = -norm.running_mean * scale
        if norm.bias is not None:
            shift = shift + norm.bias
        conv.weight.copy_(conv.weight * scale.reshape(-1, 1, 1, 1).to(conv.weight.dtype))
        bias = shift if conv.bias is None else conv.bias * scale + shift
        conv.bias = nn.Parameter(bias.to(conv.weight.dtype), requires_grad=False)
        setattr(parent, name, nn.Identity())
        folded += 1
    return folded


WHOLE_MAP_MACS = (
    16384  # a pooled head whose whole-map linear map costs at most this many MACs per call skips the pooling
)
MATRIX_POOL_MACS = 262144  # one map that the size does not divide, pooled by a product of at most this many MACs
_PLANS = 16  # map shapes and layouts a PooledLinear keeps its plans for


@dataclass(frozen=True)
class _Plan:
    """How a :class:`PooledLinear` answers maps of one shape and memory layout, decided on the first such map.
    ``pool`` says what averages the map first: ``none`` (the whole map goes to the linear map, whose weight has the
    average folded in), ``window`` (a plain average pooling over ``window``), ``sum`` (a sum over rows and columns,
    the weight divided by their number), ``adaptive`` (the adaptive pooling operator, where the head's size does not
    divide the map) or ``matrix`` (one sample's adaptive pooling as one product with ``matrix``, the windows'
    weights, in the map's memory order). ``weight_t`` is the linear map's weight, transposed, for the averaged
    values as they lie in memory, which ``flat`` (batch, values) reads without a copy."""

    shape: torch.Size
    stride: tuple[int, ...]
    pool: str
    window: tuple[int, int]
    matrix: Tensor | None
    nchw: bool
    flat: tuple[int, int]
    weight_t: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        pool = self.pool
        if pool == "sum":
            values = x.sum((2, 3))
        elif pool == "matrix":
            channels, pixels = self.shape[1], self.shape[2] * self.shape[3]
            if self.nchw:  # (channels, pixels) @ (pixels, windows)
                values = torch.mm(x.as_strided((channels, pixels), (pixels, 1)), self.matrix).view(self.flat)
            else:  # (windows, pixels) @ (pixels, channels)
                values = torch.mm(self.matrix, x.as_strided((pixels, channels), (channels, 1))).view(self.flat)
        else:
            if pool == "window":
                x = F.avg_pool2d(x, self.window)
            elif pool == "adaptive":
                x = F.adaptive_avg_pool2d(x, self.window)
            values = x.as_strided(self.flat, (self.flat[1], 1))
        return torch.mm(values, self.weight_t) if self.bias is None else torch.addmm(self.bias, values, self.weight_t)


class PooledLinear(nn.Module):
    """``AdaptiveAvgPool2d(size) -> Flatten -> Linear`` as one module (the fold form of a pooled exit head). The
    pooling is a plain average pooling where ``size`` divides the map; a channels-last map is read in its memory
    order by the linear map's weight permuted once, so nothing is copied. A small call (a linear map over the whole
    input of at most :data:`WHOLE_MAP_MACS` multiply-adds, e.g. a LeNet's first exit at batch 1: 1,536 values, 10
    classes) skips the pooling: the average is folded into that map's weight, since there the pooling's own
    operator costs more than the arithmetic it saves (LeNet's first exit between its stages: 12.2 -> 9.8 us).
    Larger maps keep the pooling, whose weight is smaller by the window's area; a map pooled to 1x1 (a
    backbone's classifier, a ``linear`` exit head) is summed over its rows and columns, with the average's division
    folded into the weight (float16 maps keep the pooling: their sum can overflow). Timed on a Xeon VM on maps
    of ResNet-32's three stage shapes (one and two threads, two runs, channels-last), the head took 7-14 us at
    batch 1 against 8-15 us with the pooling operator, and 16-106 us at batch 32 against 20-116 us with a mean; in
    none of the 24 pairs was the sum slower by more than 1 us. On NCHW maps (one run, two threads): 6-10 us
    against 9-18 with the pooling operator at batch 1, 24-31 us against 28-35 with a mean at batch 32.

    Where ``size`` does not divide the map (fastcnn's exits pool 15x15 and 7x7 maps to 4x4), one sample's map is
    pooled by one product with the windows' weights while that costs at most :data:`MATRIX_POOL_MACS`
    multiply-adds (53-56 -> 45-50 us per head between its stages); larger ones by the adaptive pooling operator.

    Which of these a map gets, and the weight it needs, is decided once per map shape and layout (a :class:`_Plan`)
    and reused while the maps keep them: between a small network's stages the checks and reshapes around one
    matrix product cost more than the product (LeNet's first exit at batch 1, timed after its stage: 35 -> 21 us)."""

    def __init__(self, size: int, linear: nn.Linear) -> None:
        super().__init__()
        self.size = size
        weight = linear.weight.detach().clone()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_nhwc", self._nhwc(weight), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.classes = int(weight.shape[0])
        self._plan: _Plan | None = None  # the last one used
        self._plans: dict[tuple[torch.Size, tuple[int, ...]], _Plan] = {}
        self.register_load_state_dict_post_hook(PooledLinear._derive_again)

    def _nhwc(self, weight: Tensor) -> Tensor:
        channels = weight.shape[1] // (self.size * self.size)
        return (
            weight.reshape(-1, channels, self.size, self.size)
            .permute(0, 2, 3, 1)
            .reshape(weight.shape[0], -1)
            .contiguous()
        )

    def _derive_again(self, incompatible: object) -> None:
        """After new weights are loaded, the weights derived from them are made again."""
        with torch.no_grad():
            self.weight_nhwc = self._nhwc(self.weight)
        self._forget_plans()

    def _forget_plans(self) -> None:
        self._plan, self._plans = None, {}

    def forward(self, x: Tensor) -> Tensor:
        """The head's logits for feature maps ``x`` ``[N, C, H, W]`` in any memory layout."""
        plan = self._plan
        if plan is not None and x.shape == plan.shape and x.stride() == plan.stride:
            return plan(x)
        key = (x.shape, x.stride())
        plan = self._plans.get(key) or self._plan_for(x)
        if plan is None:
            return self._any_layout(x)
        if not torch.compiler.is_compiling():
            if key not in self._plans and len(self._plans) >= _PLANS:
                self._plans.clear()  # e.g. every length of a text model's sentences: start again
            self._plan = self._plans[key] = plan
        return plan(x)

    def _plan_for(self, x: Tensor) -> _Plan | None:
        """The plan for maps like ``x``; ``None`` where the map is neither NCHW nor NHWC in memory."""
        size, (batch, channels, height, width) = self.size, x.shape
        nchw = x.is_contiguous()
        if not nchw and not x.is_contiguous(memory_format=torch.channels_last):
            return None
        weight = self.weight if nchw else self.weight_nhwc  # a pooling keeps the map's layout
        pool, window, matrix, values = "window", (height // size, width // size), None, channels * size * size
        if height % size or width % size:
            pool, window = "adaptive", (size, size)
            if batch == 1 and x.numel() * size * size <= MATRIX_POOL_MACS:
                pool, matrix = "matrix", self._window_matrix(height, width, nchw)
        elif x.numel() * self.classes <= WHOLE_MAP_MACS:
            pool, weight, values = (
                "none",
                self._whole_map_weight(channels, height, width, nchw),
                channels * height * width,
            )
        elif size == 1 and x.dtype != torch.float16:  # a half-precision sum of a large map can overflow
            pool, weight = "sum", weight / (height * width)  # type: ignore[assignment]
        return _Plan(
            x.shape, x.stride(), pool, window, matrix, nchw, (batch, values), weight.t().contiguous(), self.bias
        )

    def _window_matrix(self, height: int, width: int, nchw: bool) -> Tensor:
        """The adaptive pooling of a ``height x width`` map to ``size x size`` as a matrix over its pixels: rows are
        the windows (row-major), columns the pixels; transposed for an NCHW map, which multiplies it from the left."""

        def windows(length: int) -> Tensor:
            matrix = torch.zeros(self.size, length, dtype=torch.float64)
            for i in range(self.size):  # PyTorch's adaptive windows: floor(i * n / s) to ceil((i + 1) * n / s)
                start, end = i * length // self.size, -(-(i + 1) * length // self.size)
                matrix[i, start:end] = 1.0 / (end - start)
            return matrix

        matrix = torch.kron(windows(height), windows(width)).to(self.weight.dtype).to(self.weight.device)
        return matrix.t().contiguous() if nchw else matrix

    def _whole_map_weight(self, channels: int, height: int, width: int, nchw: bool) -> Tensor:
        """The linear map's weight over a whole ``channels x height x width`` map with the average folded in, its
        columns in the map's memory order."""
        rows, cols = height // self.size, width // self.size
        expanded = (self.weight.reshape(-1, channels, self.size, self.size).repeat_interleave(rows, 2)
                    .repeat_interleave(cols, 3) / (rows * cols))  # fmt: skip
        return (expanded if nchw else expanded.permute(0, 2, 3, 1)).flatten(1)

    def _any_layout(self, x: Tensor) -> Tensor:
        size, (height, width) = self.size, x.shape[-2:]
        if height % size == 0 and width % size == 0:
            pooled = F.avg_pool2d(x, (height // size, width // size))
        else:
            pooled = F.adaptive_avg_pool2d(x, size)
        if pooled.is_contiguous():
            return F.linear(pooled.flatten(1), self.weight, self.bias)
        return F.linear(pooled.permute(0, 2, 3, 1).reshape(pooled.shape[0], -1), self.weight_nhwc, self.bias)

    def _apply(self, fn: Any, recurse: bool = True) -> PooledLinear:  # .to(), .half()...: the weights move
        self._forget_plans()
        return super()._apply(fn, recurse)

    def unfused(self) -> nn.Sequential:
        """The three modules this one stands for, with its weights (for exporters that rewrite the pooling)."""
        linear = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return nn.Sequential(nn.AdaptiveAvgPool2d(self.size), nn.Flatten(), linear.to(self.weight.device))


def fuse_pooled_heads(model: nn.Module) -> int:
    """Replace, in place, every ``AdaptiveAvgPool2d -> Flatten -> Linear`` run of an ``nn.Sequential`` by one
    :class:`PooledLinear` under the pooling's name (the other modules keep theirs); the number replaced. Only a
    plain ``nn.Linear`` with plain weights is fused: a quantized weight (torchao's) or a subclass computes
    something else."""
    fused = 0
    for sequential in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(sequential._modules)
        i = 0
        while i + 2 < len(names):
            pool, flatten, linear = (sequential._modules[n] for n in names[i : i + 3])
            if (isinstance(pool, nn.AdaptiveAvgPool2d) and isinstance(pool.output_size, int)
                    and isinstance(flatten, nn.Flatten) and flatten.start_dim == 1 and flatten.end_dim == -1
                    and type(linear) is nn.Linear and type(linear.weight) in (Tensor, nn.Parameter)):  # fmt: skip
                sequential._modules[names[i]] = PooledLinear(pool.output_size, linear)
                del sequential._modules[names[i + 1]], sequential._modules[names[i + 2]]
                fused += 1
                i += 3
            else:
                i += 1
    return fused


def _unwrap_fused_heads(model: nn.Module) -> None:
    """Put each :class:`PooledLinear` that is alone in an ``nn.Sequential`` in that container's place: a head is
    called once per exit, and the container's own call costs about 2 us at batch 1."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Sequential) and len(child) == 1 and isinstance(child[0], PooledLinear):
                setattr(parent, name, child[0])


def inference_form(model: nn.Module, form: InferenceForm, probe: Tensor | None = None) -> nn.Module:
    """A copy of ``model`` (in eval mode) in ``form``. With a ``probe`` batch, the copy's outputs are checked
    against the original's, and a difference beyond float rounding is refused (a one-line error)."""
    if form == InferenceForm():
        model.inference_form = form.name  # type: ignore[assignment]
        return model
    original = model.eval()
    converted = copy.deepcopy(original).eval()
    if form.fold:
        fold_batchnorm(converted)
        fuse_pooled_heads(converted)
        _unwrap_fused_heads(converted)
    if form.channels_last:
        converted = converted.to(memory_format=torch.channels_last)
    if form.compile:  # each segment and head apart, so early exit still stops after the part it needs
        from anytime.precision.parts import float_parts, layout_of, room_for_compiled_parts

        parts = float_parts(converted) if layout_of(converted) == "exits" else [converted]
        room_for_compiled_parts(len(parts))
        for part in parts:
            part.compile(dynamic=False)
    if probe is not None:
        _check(original, converted, probe, form)
    converted.inference_form = form.name  # type: ignore[assignment]
    return converted


@torch.inference_mode()
def _check(original: nn.Module, converted: nn.Module, probe: Tensor, form: InferenceForm) -> None:
    expected, got = original(probe), converted(probe)
    scale = float(expected.abs().max().clamp(min=1.0))
    error = float((expected - got).abs().max()) / scale
    if not error <= _TOLERANCE:
        raise AnytimeError(f"the {form.name} form of this model differs from it by {error:.2g} (relative) on a probe "
                           "batch; run it with --form eager and report the model")  # fmt: skip
