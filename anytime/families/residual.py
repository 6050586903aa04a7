"""Residual-link cutting and block skipping in ResNets, and the block-drop ladder (the step contract).

A residual block computes ``branch(x) + shortcut(x)``. Two surgeries apply to any set of blocks:

- cut the **shortcut**: the block computes only its branch (Veit et al. 2016 measure how much a trained
  ResNet relies on its links);
- drop the **branch**: the block becomes its shortcut and its branch is not computed. Where the shortcut is
  the identity the block vanishes. Where it is a projection (a strided 1x1 convolution with batch norm, as in
  ResNet-18/50 at a stage's first block), the projection runs instead of the branch, so the shapes stay
  what the next block expects; the small CIFAR ResNets' parameter-free shortcut (subsample and zero-pad)
  costs nothing.

Blocks of the zoo (:class:`~anytime.backbones.resnet.ResidualBlock`, the pre-activation block) and
torchvision's ``BasicBlock`` / ``Bottleneck`` are found by :func:`residual_blocks`, in forward order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from anytime.backbones.preact_resnet import PreActBlock
from anytime.backbones.resnet import ResidualBlock, drop_path
from anytime.errors import AnytimeError
from anytime.families.exits import ExitInfo
from anytime.families.separate import SeparateSteps, count_flops

CUT_KINDS: tuple[str, ...] = ("shortcut", "branch")


def _torchvision_blocks() -> tuple[type[nn.Module], ...]:
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return BasicBlock, Bottleneck


class _CuttableTorchvisionBlock(nn.Module):
    """Forward of torchvision's BasicBlock and Bottleneck with ``cut`` and ``drop_prob`` (same modules, same
    weights; only the class of the instance changes)."""

    cut: str | None = None
    drop_prob: float = 0.0

    def _branch(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))  # type: ignore[operator]
        if hasattr(self, "conv3"):
            out = self.relu(self.bn2(self.conv2(out)))  # type: ignore[operator]
            return self.bn3(self.conv3(out))  # type: ignore[operator]
        return self.bn2(self.conv2(out))  # type: ignore[operator]

    def _shortcut(self, x: Tensor) -> Tensor:
        return x if self.downsample is None else self.downsample(x)  # type: ignore[operator]

    def forward(self, x: Tensor) -> Tensor:
        if self.cut == "branch":  # out of place: with an identity shortcut, x is saved for the backward
            return torch.relu(self._shortcut(x))
        if self.cut == "shortcut":
            return self.relu(self._branch(x))  # type: ignore[operator]
        out = self._branch(x)
        if self.training and self.drop_prob > 0:
            out = drop_path(out, self.drop_prob)
        return self.relu(out + self._shortcut(x))  # type: ignore[operator]


_CUTTABLE: dict[type, type] = {}


def residual_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every residual block of ``model`` in forward order, as (name, module); torchvision blocks are given
    the cuttable forward. Refuses a model without residual blocks."""
    blocks: list[tuple[str, nn.Module]] = []
    torchvision = _torchvision_blocks()
    for name, module in model.named_modules():
        if isinstance(module, (ResidualBlock, PreActBlock)):
            blocks.append((name, module))
        elif isinstance(module, torchvision):
            if not isinstance(module, _CuttableTorchvisionBlock):
                base = type(module)
                if base not in _CUTTABLE:
                    _CUTTABLE[base] = type(f"Cuttable{base.__name__}", (_CuttableTorchvisionBlock, base), {})
                module.__class__ = _CUTTABLE[base]
            blocks.append((name, module))
    if not blocks:
        raise AnytimeError(
            f"{type(model).__name__} has no residual blocks to cut; cutting applies to the ResNet family "
            "(resnet18/50, preact_resnet18, resnet20/32/56, resnet29_bottleneck, resnext29_*, tv:resnet*)"
        )
    return blocks


def set_stochastic_depth(model: nn.Module, p: float) -> None:
    """Stochastic depth (Huang et al. 2016): block l of L skips its branch in training with probability
    ``p * (l + 1) / L``, linear in depth up to ``p`` for the last block."""
    if not 0 <= p < 1:
        raise AnytimeError(f"a stochastic-depth probability is in [0, 1) (got {p})")
    blocks = residual_blocks(model)
    for index, (_, block) in enumerate(blocks):
        block.drop_prob = p * (index + 1) / len(blocks)  # type: ignore[assignment]


def check_cuts(blocks: Sequence[tuple[str, nn.Module]], cuts: Mapping[int, str]) -> dict[int, str]:
    """Validate ``{block index: kind}`` against a model's blocks."""
    for index, kind in cuts.items():
        if kind not in CUT_KINDS:
            raise AnytimeError(f"unknown cut '{kind}'; choose one of {', '.join(CUT_KINDS)}")
        if not isinstance(index, int) or not 0 <= index < len(blocks):
            raise AnytimeError(f"block {index} does not exist; this model has blocks 0..{len(blocks) - 1}")
    return dict(cuts)


def apply_cuts(model: nn.Module, cuts: Mapping[int, str]) -> None:
    """Set the cuts of ``model``'s blocks: ``{index: "shortcut" | "branch"}``; every other block is whole."""
    blocks = residual_blocks(model)
    valid = check_cuts(blocks, cuts)
    for index, (_, block) in enumerate(blocks):
        block.cut = valid.get(index)  # type: ignore[assignment]


def top_down_ladder(num_blocks: int) -> list[frozenset[int]]:
    """The cumulative ladder, cheapest first: step k keeps blocks 0..k-1 and drops the branches of the rest,
    from all blocks dropped (step 0) to none (step ``num_blocks``)."""
    return [frozenset(range(k, num_blocks)) for k in range(num_blocks + 1)]


class BlockDropLadder(SeparateSteps):
    """A ResNet whose steps are configurations of dropped residual branches, cheapest first.

    Step k of the default ladder keeps the first k blocks whole and skips the branches of the others (cut from
    the top block down); the last step is the whole network. All steps share one set of weights. Steps are not
    incremental, so the runtime chooses one per request. Obeys the step contract (``forward_until``,
    ``forward_all``, ``exit_info``).
    """

    family = "ladder"

    def __init__(
        self, backbone: nn.Module, configs: Sequence[frozenset[int]] | None = None,
        *, input_shape: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.backbone = backbone
        self.input_shape = input_shape or (int(getattr(backbone, "in_channels", 3)), 32, 32)
        self.training = backbone.training
        blocks = residual_blocks(backbone)
        self.block_names = tuple(name for name, _ in blocks)
        self._blocks = tuple(block for _, block in blocks)
        chosen = list(configs) if configs is not None else top_down_ladder(len(blocks))
        if not chosen:
            raise AnytimeError("a block-drop ladder needs at least one configuration")
        for config in chosen:
            check_cuts(blocks, {i: "branch" for i in config})
        self.configs = tuple(frozenset(c) for c in chosen)
        self.backbone_flops = count_flops(self, self.backbone, self.input_shape)
        self.exit_info = self._info()
        order = [e.flops for e in self.exit_info]
        if order != sorted(order):
            raise AnytimeError("the ladder's configurations must be ordered by cost, cheapest first")

    @property
    def num_steps(self) -> int:
        """The number of configurations."""
        return len(self.configs)

    def _set(self, dropped: frozenset[int] | None) -> None:
        for index, block in enumerate(self._blocks):
            block.cut = "branch" if dropped is not None and index in dropped else None  # type: ignore[assignment]

    def _run(self, x: Tensor, k: int) -> Tensor:
        before = [block.cut for block in self._blocks]
        self._set(self.configs[k])
        try:
            return self.backbone(x)
        finally:
            for block, cut in zip(self._blocks, before):
                block.cut = cut  # type: ignore[assignment]

    def _info(self) -> tuple[ExitInfo, ...]:
        total = sum(p.numel() for p in self.backbone.parameters())
        info: list[ExitInfo] = []
        cumulative = 0
        for k, dropped in enumerate(self.configs):
            flops = count_flops(self, lambda x, k=k: self.forward_until(x, k), self.input_shape)  # type: ignore[misc]
            cumulative += flops
            skipped = sum(p.numel() for i in dropped for p in _branch_parameters(self._blocks[i]))
            kept = len(self._blocks) - len(dropped)
            info.append(ExitInfo(index=k, name=f"{kept}/{len(self._blocks)} blocks", shape=(), flops=flops,
                                 cost_flops=cumulative, params=total - skipped, head_flops=0, head_params=0))  # fmt: skip
        return tuple(info)

    def extra_repr(self) -> str:
        return f"blocks={len(self._blocks)}, steps={self.num_steps}"


def _branch_parameters(block: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters a skipped branch does not use."""
    if isinstance(block, ResidualBlock):
        yield from block.branch.parameters()
    elif isinstance(block, PreActBlock):
        yield from block.branch.parameters()
        if not block.projects:
            yield from block.pre.parameters()
    else:
        for name, module in block.named_children():
            if name != "downsample":
                yield from module.parameters()
