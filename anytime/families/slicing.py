"""Sliced networks: one set of weights, a ladder of narrower sub-networks (the step contract).

``slice_model(backbone, ratios, kind)`` converts a dense convolutional backbone in place:

- ``width`` (slimmable networks): step k keeps the first ``ratio_k`` of the channels of every layer. The
  narrower network is a real smaller computation: convolutions run on the leading slice of the shared
  weight tensor (``weight[:out, :in]``), never on a mask of the full one.
- ``cardinality`` (IResNeXt): step k keeps the first ``ratio_k * G`` of the G groups of every ResNeXt
  block. Only the grouped layers and the 1x1 that feeds them are sliced; each block's output keeps its full
  width, and a narrower step does not pay for the groups it leaves out.

Batch norm is switchable (each step has its own statistics and affine parameters, sized to it) and so is the
classifier (each step has its own). A width that was not trained gets a step with :meth:`SlicedModel.add_step`,
which recomputes its batch-norm statistics on data you pass: without that, a narrower slice of a wider
step's statistics is silently wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from anytime.backbones.cifar_resnet import PadShortcut
from anytime.errors import AnytimeError
from anytime.families.batchnorm import recompute_bn_statistics
from anytime.families.exits import ExitInfo
from anytime.families.separate import SeparateSteps, count_flops
from anytime.families.sliced_layers import (
    Context,
    SlicedConv2d,
    SlicedPadShortcut,
    SwitchableBatchNorm2d,
    SwitchableLinear,
)

SLICE_KINDS: tuple[str, ...] = ("width", "cardinality")


def parse_ratios(text: str | Sequence[float]) -> tuple[float, ...]:
    """``"0.25,0.5,1.0"`` (or a list) as sorted, distinct ratios in (0, 1]."""
    try:
        values = [float(v) for v in (text.split(",") if isinstance(text, str) else text) if str(v).strip()]
    except ValueError:
        raise AnytimeError(
            f"slices must be numbers in (0, 1] separated by commas, e.g. 0.25,0.5,1.0 (got {text!r})"
        ) from None
    if not values:
        raise AnytimeError("no slices given; use e.g. --slices 0.25,0.5,0.75,1.0")
    if not all(0 < v <= 1 for v in values):
        raise AnytimeError(f"slices are fractions of the full network in (0, 1] (got {values})")
    if len(set(values)) != len(values):
        raise AnytimeError(f"slices {values} name the same fraction twice")
    if len(values) < 2:
        raise AnytimeError(f"a sliced network needs at least two slices (got {values}); e.g. 0.5,1.0")
    return tuple(sorted(values))


def _slice_norm(norm: nn.BatchNorm2d, channels: int) -> nn.BatchNorm2d:
    out = nn.BatchNorm2d(channels, eps=norm.eps, momentum=norm.momentum, affine=norm.affine,
                         track_running_stats=norm.track_running_stats)  # fmt: skip
    with torch.no_grad():
        if norm.affine:
            out.weight.copy_(norm.weight[:channels])
            out.bias.copy_(norm.bias[:channels])
        if norm.track_running_stats:
            out.running_mean.copy_(norm.running_mean[:channels])  # type: ignore[index]
            out.running_var.copy_(norm.running_var[:channels])  # type: ignore[index]
            out.num_batches_tracked.copy_(norm.num_batches_tracked)  # type: ignore[arg-type]
    return out.to(*_place(norm))


def _slice_linear(linear: nn.Linear, features: int) -> nn.Linear:
    out = nn.Linear(features, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, :features])
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
    return out.to(*_place(linear))


def _place(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of a module's first tensor (CPU, float32 if it has none)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.float32


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in ``root`` as its submodule ``name`` (a dotted path), in place of what was there."""
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class SlicedModel(SeparateSteps):
    """A backbone whose steps are nested slices of it: step k runs the ``ratios[k]`` slice, cheapest first.

    Obeys the step contract like :class:`~anytime.families.MultiExitModel`: ``forward_until(x, k)`` runs step
    k alone, ``forward_all(x)`` gives ``[K, B, C]``, ``exit_info`` describes each step. Steps are not
    incremental (step k+1 does not reuse step k's work), so the runtime chooses one step per request.
    With ``sandwich``, :meth:`training_steps` picks the widest, the narrowest and one other at random each
    mini-batch instead of all of them.
    """

    family = "sliced model"

    def __init__(self, backbone: nn.Module, ratios: tuple[float, ...], kind: str, context: Context,
                 info: tuple[ExitInfo, ...], backbone_flops: int, *, sandwich: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.backbone = backbone
        object.__setattr__(self, "_context", context)
        self.training = backbone.training
        self.ratios = ratios
        self.kind = kind
        self.exit_info = info
        self.backbone_flops = backbone_flops
        self.sandwich = sandwich

    @property
    def num_steps(self) -> int:
        """The number of slices."""
        return len(self.ratios)

    def _run(self, x: Tensor, k: int) -> Tensor:
        context = self._context
        context.step, context.ratio = k, self.ratios[k]
        try:
            return self.backbone(x)
        finally:  # the bare backbone computes the widest slice, whatever ran last
            context.step, context.ratio = self.num_steps - 1, self.ratios[-1]

    def step_for(self, ratio: float) -> int:
        """The step of slice ``ratio``; a clear error for a slice that has no statistics of its own."""
        for k, r in enumerate(self.ratios):
            if abs(r - float(ratio)) < 1e-9:
                return k
        trained = ", ".join(f"{r:g}" for r in self.ratios)
        raise AnytimeError(
            f"slice {ratio:g} was not trained (this model has {trained}); its batch-norm statistics would be wrong, "
            f"so add it with add_step({ratio:g}, batches), which recomputes them on the images given"
        )

    def training_steps(self) -> list[int]:
        """The steps one mini-batch trains, widest last (it is the distillation teacher): all of them, or
        under the sandwich rule the narrowest, one random other and the widest."""
        if not self.sandwich or self.num_steps <= 3:
            return list(range(self.num_steps))
        middle = 1 + int(torch.randint(self.num_steps - 2, ()).item())
        return [0, middle, self.num_steps - 1]

    @torch.no_grad()
    def add_step(self, ratio: float, batches: Iterable[Tensor | tuple[Tensor, ...]], *, max_batches: int = 100) -> int:
        """Add a slice narrower than the widest one, which was not trained, and return its step index.

        Its batch-norm affine parameters and classifier are sliced from the nearest wider step, and its
        batch-norm statistics are recomputed over ``batches`` (images, or (images, labels) pairs, at most
        ``max_batches``), since a slice of another width's statistics does not match this width's activations.
        The new step lives in this model object: save it with ``torch.save(model.state_dict())`` beside its
        ratios, since a run's recipe rebuilds only the slices it was trained with. If the batches fail, the
        model is left as it was.
        """
        ratio = float(ratio)
        if ratio in self.ratios:
            return self.ratios.index(ratio)
        if not 0 < ratio < self.ratios[-1]:
            raise AnytimeError(
                f"a new slice must be narrower than the widest one ({self.ratios[-1]:g}) and above 0 (got {ratio:g}); "
                "nothing wider was trained to take it from"
            )
        _check_kind_ratio(self.kind, ratio, self.backbone)
        pending = iter(batches)
        first = next(pending, None)
        if first is None:
            raise AnytimeError(f"no batches given to recompute the batch-norm statistics of slice {ratio}")
        source = next(k for k, r in enumerate(self.ratios) if r > ratio)
        new_ratios = tuple(sorted((*self.ratios, ratio)))
        position = new_ratios.index(ratio)
        sizes = _probe_sizes(self.backbone, self._context, ratio)
        switchable = [(name, m) for name, m in self.backbone.named_modules()
                      if isinstance(m, (SwitchableBatchNorm2d, SwitchableLinear))]  # fmt: skip
        saved = [(m, list(m.norms if isinstance(m, SwitchableBatchNorm2d) else m.heads)) for _, m in switchable]
        saved_ratios, saved_info = self.ratios, self.exit_info
        try:
            for name, module in switchable:
                if isinstance(module, SwitchableBatchNorm2d):
                    norms = list(module.norms)
                    norms.insert(position, _slice_norm(norms[source], sizes[name]))
                    module.norms = nn.ModuleList(norms)
                else:
                    heads = list(module.heads)
                    heads.insert(position, _slice_linear(heads[source], sizes[name]))
                    module.heads = nn.ModuleList(heads)
            self.ratios = new_ratios
            new_norms = [m.norms[position] for _, m in switchable if isinstance(m, SwitchableBatchNorm2d)]
            recompute_bn_statistics(self, itertools.chain([first], pending), norms=new_norms,
                                    forward=lambda x: self.forward_until(x, position), max_batches=max_batches)  # fmt: skip
            self.exit_info = _step_info(self, self.backbone_flops)
        except BaseException as exc:
            for module, parts in saved:
                if isinstance(module, SwitchableBatchNorm2d):
                    module.norms = nn.ModuleList(parts)
                else:
                    module.heads = nn.ModuleList(parts)
            self.ratios, self.exit_info = saved_ratios, saved_info
            if isinstance(exc, RuntimeError) and not isinstance(exc, AnytimeError):
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise AnytimeError(f"the batches given to slice {ratio:g} do not fit this model ({detail})") from None
            raise
        return position

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, ratios={list(self.ratios)}, sandwich={self.sandwich}"


def _check_kind_ratio(kind: str, ratio: float, backbone: nn.Module) -> None:
    if kind == "cardinality":
        groups = int(backbone.cardinality)  # type: ignore[arg-type]
        if abs(ratio * groups - round(ratio * groups)) > 1e-6:
            valid = ",".join(f"{k / groups:g}" for k in range(1, groups + 1))
            raise AnytimeError(
                f"cardinality slice {ratio} is not a whole number of the {groups} groups; choose among {valid}"
            )


def _probe_sizes(backbone: nn.Module, context: Context, ratio: float) -> dict[str, int]:
    """Channels every switchable layer receives at ``ratio`` (one dry run, no statistics touched)."""
    saved = (context.ratio, context.probe)
    context.ratio, context.probe = ratio, True
    try:
        device = next(backbone.parameters()).device
        with torch.no_grad():
            backbone(torch.zeros(1, *context.shape, device=device))
    finally:
        context.ratio, context.probe = saved
    return {name: int(m._seen) for name, m in backbone.named_modules()
            if isinstance(m, (SwitchableBatchNorm2d, SwitchableLinear))}  # fmt: skip


def _width_sliceable(backbone: nn.Module) -> bool:
    """Networks whose channels line up across layers (no concatenation or shuffle), so a leading slice of
    every layer is a narrower network: the zoo's models but MSDNet, and torchvision's ResNets and MobileNetV2."""
    from torchvision.models import MobileNetV2 as TorchvisionMobileNetV2
    from torchvision.models import ResNet as TorchvisionResNet

    from anytime.backbones.base import StagedBackbone

    if isinstance(backbone, StagedBackbone):
        return backbone.width_sliceable
    return isinstance(backbone, (TorchvisionResNet, TorchvisionMobileNetV2))


def _check_sliceable(backbone: nn.Module, kind: str) -> nn.Linear:
    if kind == "width" and not _width_sliceable(backbone):
        raise AnytimeError(
            f"width slicing supports the zoo's models but MSDNet, and torchvision's ResNet and MobileNetV2, not "
            f"{type(backbone).__name__}: where channels are concatenated or shuffled, a leading slice of each layer "
            "is not a narrower network"
        )
    linears = [(n, m) for n, m in backbone.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        raise AnytimeError(
            f"slicing needs a convolutional network with a single linear classifier; {type(backbone).__name__} has "
            f"{len(linears)} linear layers (slice the zoo's ResNets, MobileNetV2, VGG or ResNeXt)"
        )
    allowed = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)
    for name, module in backbone.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and not isinstance(module, allowed):
            raise AnytimeError(
                f"slicing does not know how to slice {name} ({type(module).__name__}); it slices convolutions, "
                "batch norms and the classifier"
            )
        if kind == "width" and isinstance(module, nn.Conv2d) and 1 < module.groups != module.in_channels:
            raise AnytimeError(
                f"{name} is a grouped convolution ({module.groups} groups); width slicing would mix its groups, "
                "so slice a ResNeXt with --slice-kind cardinality"
            )
    if kind == "cardinality" and not hasattr(backbone, "cardinality"):
        raise AnytimeError(
            f"cardinality slicing needs a ResNeXt (resnext29_2x64d, resnext29_8x16d), not {type(backbone).__name__}; "
            "use --slice-kind width"
        )
    return linears[0][1]


def _cardinality_layers(backbone: nn.Module) -> set[int]:
    """The convolutions whose outputs are split in groups: each grouped 3x3 and the 1x1 that feeds it."""
    chosen: set[int] = set()
    for module in backbone.modules():
        branch = getattr(module, "branch", None)
        if isinstance(branch, nn.Sequential) and len(branch) == 3:
            convs = [next(m for m in part.modules() if isinstance(m, nn.Conv2d)) for part in branch]
            if convs[1].groups > 1:
                chosen.update({id(convs[0]), id(convs[1])})
    return chosen


def slice_model(
    backbone: nn.Module, ratios: str | Sequence[float] = (0.25, 0.5, 0.75, 1.0), *, kind: str = "width",
    sandwich: bool = False, input_shape: tuple[int, int, int] | None = None,
) -> SlicedModel:  # fmt: skip
    """Turn ``backbone`` (modified in place) into a :class:`SlicedModel` with one step per ratio.

    Every step starts from the dense weights (a narrower step from their leading slice), so slicing a
    trained backbone and asking for ratio 1.0 computes exactly what the backbone computed. ``input_shape``
    (one sample's ``(C, H, W)``, by default the backbone's ``in_channels`` at 32x32) is where FLOPs are counted.
    """
    if kind not in SLICE_KINDS:
        raise AnytimeError(f"unknown slice kind '{kind}'; choose one of {', '.join(SLICE_KINDS)}")
    values = parse_ratios(ratios)
    classifier = _check_sliceable(backbone, kind)
    for ratio in values:
        _check_kind_ratio(kind, ratio, backbone)
    context = Context(ratio=values[-1], step=len(values) - 1, shape=_input_shape(backbone, input_shape))
    dense_flops = count_flops(backbone, backbone, context.shape)
    scaled = _cardinality_layers(backbone) if kind == "cardinality" else None
    norms: dict[str, nn.BatchNorm2d] = {}
    for name, module in list(backbone.named_modules()):
        if isinstance(module, nn.Conv2d):
            module.__class__ = SlicedConv2d
            module.scale_out = scaled is None or id(module) in scaled  # type: ignore[attr-defined, assignment]
            object.__setattr__(module, "_context", context)
        elif isinstance(module, PadShortcut):
            module.__class__ = SlicedPadShortcut
            module.out_full = module.extra + _pad_input(backbone, name)  # type: ignore[attr-defined, assignment]
            object.__setattr__(module, "_context", context)
        elif isinstance(module, nn.BatchNorm2d):
            norms[name] = module
            set_module(backbone, name, SwitchableBatchNorm2d([module], context))
        elif module is classifier:
            set_module(backbone, name, SwitchableLinear([module], context))
    sizes = {ratio: _probe_sizes(backbone, context, ratio) for ratio in values}
    for name, module in backbone.named_modules():
        if isinstance(module, SwitchableBatchNorm2d):
            dense = norms[name]
            module.norms = nn.ModuleList([_slice_norm(dense, sizes[r][name]) for r in values])
        elif isinstance(module, SwitchableLinear):
            module.heads = nn.ModuleList([_slice_linear(classifier, sizes[r][name]) for r in values])
    model = SlicedModel(backbone, values, kind, context, (), dense_flops, sandwich=sandwich)
    model.exit_info = _step_info(model, dense_flops)
    return model


def _pad_input(backbone: nn.Module, name: str) -> int:
    """Input channels of the option-A shortcut ``name``: its block's first convolution's."""
    block = backbone.get_submodule(name.rpartition(".")[0])
    return next(m for m in block.modules() if isinstance(m, nn.Conv2d)).in_channels


def _input_shape(backbone: nn.Module, shape: tuple[int, int, int] | None) -> tuple[int, int, int]:
    return tuple(shape) if shape is not None else (int(getattr(backbone, "in_channels", 3)), 32, 32)  # type: ignore[return-value]


def _step_info(model: SlicedModel, dense_flops: int) -> tuple[ExitInfo, ...]:
    """Each slice's FLOPs and the parameters it reads (one sample at 32x32)."""
    info: list[ExitInfo] = []
    cumulative = 0
    context = model._context
    for k, ratio in enumerate(model.ratios):
        flops = count_flops(model, lambda x, k=k: model.forward_until(x, k), context.shape)  # type: ignore[misc]
        cumulative += flops
        context.step, context.ratio, context.probe = k, ratio, True
        try:
            with torch.no_grad():
                device = next(model.parameters()).device
                model.backbone(torch.zeros(1, *context.shape, device=device))  # type: ignore[misc]
        finally:
            context.probe = False
        params = 0
        head_params = 0
        for module in model.backbone.modules():
            if isinstance(module, SlicedConv2d):
                params += int(module._used)
            elif isinstance(module, SwitchableBatchNorm2d):
                params += _params(module.norms[k])
            elif isinstance(module, SwitchableLinear):
                head_params = _params(module.heads[k])
        label = f"x{ratio:g}" if model.kind == "width" else f"{round(ratio * model.backbone.cardinality)}g"  # type: ignore[attr-defined]
        info.append(ExitInfo(index=k, name=label, shape=(), flops=flops, cost_flops=cumulative,
                             params=params + head_params, head_flops=0, head_params=head_params))  # fmt: skip
    return tuple(info)
