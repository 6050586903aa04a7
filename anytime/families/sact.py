"""Spatially adaptive computation time (Figurnov et al., CVPR 2017) over a ResNet's residual stages.

In every stage the first unit (which changes the resolution) runs everywhere; after each unit a halting unit
scores every spatial position in [0, 1] (``mode="spatial"``, SACT; ``"image"`` scores whole images, ACT). A
position stops at the first unit where its scores reach the halting threshold; there, the stage's output is the
units' outputs weighted by the scores, the last unit by the remainder (1 minus the scores before it). A stopped
position keeps its features, which later units still read as neighbours. The ponder cost (units used plus the
remainder) is averaged over positions and summed over stages; training adds ``ponder_cost`` times it to the loss
and halts at the largest threshold (the paper's ``1 - eps``). At inference each threshold is a step: a lower one
stops sooner, so the steps are cheapest first.

Two executions give the same outputs. ``sparse`` runs a unit only at the positions still active, each convolution
one matrix product over the gathered 3 x 3 neighbourhoods (channels last, batch norm folded in), the unit's first
convolution on the active positions dilated by the later kernels' reach. ``dense`` (the default, and what training
runs) runs every unit everywhere and keeps the active positions' values, stopping a stage once no position of the
batch is active. A step's FLOPs depend on the images: :meth:`SACTResNet.measure_cost` counts the sparse execution's
on real ones (the trainer does it on the validation split) and stores them with the weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError
from anytime.families.exits import ExitInfo
from anytime.families.sact_units import HaltingUnit, Layer, Padded, Unit, autocast_on, dilate, residual_stages
from anytime.families.separate import SeparateSteps, count_flops

SACT_MODES: tuple[str, ...] = ("spatial", "image")  # halting per position (SACT) or per image (ACT)
EXECUTIONS: tuple[str, ...] = ("sparse", "dense")


def parse_thresholds(text: str | Sequence[float | str]) -> tuple[float, ...]:
    """``"0.5,0.75,0.9,0.99"``: halting thresholds in (0, 1], at least two, rising; the last one is trained."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    values = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise AnytimeError(
                f"--sact takes halting thresholds in (0, 1], e.g. 0.5,0.75,0.9,0.99 (got {item!r})"
            ) from None
        if not (math.isfinite(value) and 0 < value <= 1):
            raise AnytimeError(f"halting threshold {item} is outside (0, 1]; give e.g. 0.5,0.75,0.9,0.99")
        values.append(value)
    if len(values) < 2 or any(b <= a for a, b in zip(values, values[1:])):
        raise AnytimeError(f"--sact needs at least two rising halting thresholds, the trained one last, e.g. "
                           f"0.5,0.75,0.9,0.99 (got {','.join(map(str, items)) or 'none'})")  # fmt: skip
    return tuple(values)


@dataclass(frozen=True)
class StageHalting:
    """What a stage did for a batch: ``units`` ``[B, H, W]`` run at each position (``[B, 1, 1]`` per image)
    and ``ponder``, the units plus the remainder."""

    units: Tensor
    ponder: Tensor


@dataclass(frozen=True)
class SACTCost:
    """A step's cost measured on images: mean FLOPs per image as executed (sparse), and the mean units run per
    position in each stage."""

    threshold: float
    flops: int
    units: tuple[float, ...]


class SACTResNet(SeparateSteps):
    """A ResNet whose residual stages halt per position (see the module's docstring); one step per halting
    threshold, cheapest first."""

    family = "SACT ResNet"
    data_dependent_cost = True  # a step's FLOPs and time depend on the image: profile on real ones

    def __init__(self, backbone: nn.Module, thresholds: Sequence[float], *, input_shape: tuple[int, int, int],
                 ponder_cost: float = 0.01, mode: str = "spatial") -> None:  # fmt: skip
        super().__init__()
        if mode not in SACT_MODES:
            raise AnytimeError(f"unknown SACT mode {mode!r}; choose one of {', '.join(SACT_MODES)}")
        if not (math.isfinite(ponder_cost) and ponder_cost >= 0):
            raise AnytimeError(f"the ponder cost must be a number >= 0 (got {ponder_cost})")
        self.thresholds = parse_thresholds(list(thresholds))
        stem, stages, head = residual_stages(backbone)
        self.backbone = backbone
        self._stem, self._stages, self._head = stem, stages, head
        self.mode = mode
        self.ponder_cost = float(ponder_cost)
        self.input_shape = input_shape
        self._execution = "dense"  # the faster on this machine's CPU (docs/benchmarks-archive.md, sact_cifar10)
        channels = [self._out_channels(stage[0]) for stage in stages]
        self.halting = nn.ModuleList(
            nn.ModuleList(HaltingUnit(c, mode == "spatial") for _ in range(len(stage) - 1)) for c, stage in zip(channels, stages)
        )  # fmt: skip
        self.register_buffer("measured_flops", torch.zeros(len(self.thresholds), dtype=torch.int64))
        self.register_buffer("measured_units", torch.zeros(len(self.thresholds), len(stages)))
        self._ponder: list[Tensor] = []
        self._record: list[StageHalting] | None = None
        self._folded_cache: dict[int, tuple] = {}  # sparse execution's folded weights per convolution
        self.dense_flops = count_flops(self, lambda x: self._forward(x, 2.0, "dense"), input_shape)  # no unit halts
        self.backbone_flops = count_flops(backbone, backbone, input_shape)
        self.params = sum(p.numel() for p in self.parameters())

    @staticmethod
    def _out_channels(unit: Unit) -> int:
        return unit.layers[-1].conv.out_channels

    @property
    def num_steps(self) -> int:
        """The number of halting thresholds."""
        return len(self.thresholds)

    @property
    def execution(self) -> str:
        """``dense`` or ``sparse`` (see the module's docstring): how eval-mode forwards run; training runs dense."""
        return self._execution

    @execution.setter
    def execution(self, value: str) -> None:
        if value not in EXECUTIONS:
            raise AnytimeError(f"unknown SACT execution {value!r}; choose one of {', '.join(EXECUTIONS)}")
        self._execution = value

    @property
    def costs(self) -> tuple[SACTCost, ...] | None:
        """What :meth:`measure_cost` last measured (kept with the weights), or None before it has run."""
        if not self.cost_measured:
            return None
        return tuple(SACTCost(t, int(f), tuple(float(u) for u in units))
                     for t, f, units in zip(self.thresholds, self.measured_flops, self.measured_units))  # fmt: skip

    @property
    def units_per_stage(self) -> tuple[int, ...]:
        """Residual units in each stage."""
        return tuple(len(stage) for stage in self._stages)

    @property
    def cost_measured(self) -> bool:
        """Whether :meth:`measure_cost` has set the steps' FLOPs (else each is the dense network's)."""
        return bool(self.measured_flops.min() > 0)

    @property
    def step_flops(self) -> tuple[int, ...]:
        """Mean FLOPs per image of every step as executed, measured on images (the dense count until then)."""
        if self.cost_measured:
            return tuple(int(f) for f in self.measured_flops)
        return (self.dense_flops,) * self.num_steps

    @property
    def exit_info(self) -> tuple[ExitInfo, ...]:
        """One entry per threshold, named ``halt0.9``; FLOPs as :attr:`step_flops`."""
        flops = self.step_flops
        return tuple(
            ExitInfo(index=k, name=f"halt{t:g}", shape=(), flops=f, cost_flops=sum(flops[: k + 1]), params=self.params,
                     head_flops=0, head_params=0)
            for k, (t, f) in enumerate(zip(self.thresholds, flops))
        )  # fmt: skip

    def training_steps(self) -> list[int]:
        """Training halts at the largest threshold only (the paper's ``1 - eps``)."""
        return [self.num_steps - 1]

    def auxiliary_loss(self) -> Tensor:
        """``ponder_cost`` times the ponder cost of the last training forward (mean over positions, summed over
        stages); the trainer adds it to the cross-entropy."""
        if not self._ponder:
            raise AnytimeError("no training forward has run since the last ponder cost was taken")
        total = torch.stack([p.float().mean() for p in self._ponder]).sum()
        self._ponder = []
        return self.ponder_cost * total

    def _run(self, x: Tensor, k: int) -> Tensor:
        sparse = self.execution == "sparse" and not self.training and x.dtype == torch.float32
        sparse = sparse and not autocast_on(x.device.type)
        return self._forward(x, self.thresholds[k], "sparse" if sparse else "dense")

    def _forward(self, x: Tensor, threshold: float, execution: str) -> Tensor:
        for name in self._stem:
            x = getattr(self.backbone, name)(x)
        ponder = []
        for units, halts in zip(self._stages, self.halting):
            if execution == "sparse" and self.mode == "spatial":
                x, stats = self._stage_sparse(x, units, halts, threshold)
            else:
                x, stats = self._stage_dense(x, units, halts, threshold, sparse_images=execution == "sparse")
            ponder.append(stats.ponder)
            if self._record is not None:
                self._record.append(stats)
        if self.training:
            self._ponder = ponder
        for name in self._head:
            x = getattr(self.backbone, name)(x) if name else torch.flatten(x, 1)
        return x

    def _stage_dense(self, x: Tensor, units: list[Unit], halts: nn.ModuleList, threshold: float, *,
                     sparse_images: bool = False) -> tuple[Tensor, StageHalting]:  # fmt: skip
        """Every unit everywhere (or, per image, on the images still running), the active positions kept."""
        x = units[0].module(x)
        batch, _, height, width = x.shape
        shape = (batch, height, width) if self.mode == "spatial" else (batch, 1, 1)
        active = torch.ones(shape, dtype=torch.bool, device=x.device)
        total = x.new_zeros(shape, dtype=torch.float32)
        count = x.new_zeros(shape, dtype=torch.float32)
        remainder = x.new_zeros(shape, dtype=torch.float32)
        out = torch.zeros_like(x, dtype=torch.float32)
        last = len(units) - 1
        for index, unit in enumerate(units):
            if index > 0:
                if sparse_images:  # ACT at inference: only the images still running
                    running = active.view(-1).nonzero().squeeze(1)
                    x = x.index_copy(0, running, unit.module(x.index_select(0, running)))
                else:
                    x = torch.where(active[:, None], unit.module(x), x)
            count = count + active.float()
            if index < last:
                with torch.autocast(x.device.type, enabled=False):  # bf16 scores would move the halting decisions
                    score = halts[index](x.float()).expand(shape)
                halting = active & (total + score >= threshold)
            else:
                score = torch.ones(shape, device=x.device)
                halting = active
            weight = torch.where(halting, 1.0 - total, score) * active.float()
            remainder = torch.where(halting, 1.0 - total, remainder)
            out = out + weight[:, None] * x.float()
            total = total + score * active.float()
            active = active & ~halting
            if not self.training and not bool(active.any()):  # training runs every unit: DDP expects each gradient
                break
        return out.to(x.dtype), StageHalting(count, count + remainder)

    def _stage_sparse(self, x: Tensor, units: list[Unit], halts: nn.ModuleList,
                      threshold: float) -> tuple[Tensor, StageHalting]:  # fmt: skip
        """The later units at the active positions only (see the module's docstring)."""
        x = units[0].module(x)
        grid = Padded(x)
        batch, height, width = grid.shape
        positions = batch * height * width
        active = torch.arange(positions, device=x.device)  # positions still running, as b*H*W + i*W + j
        total = x.new_zeros(positions)
        count = x.new_zeros(positions)
        remainder = x.new_zeros(positions)
        out = x.new_zeros(positions, x.shape[1])
        last = len(units) - 1
        for index, unit in enumerate(units):
            rows = grid.rows.index_select(0, active)
            if index > 0:
                grid.data.index_copy_(0, rows, self._unit_sparse(grid, unit, active))
            count.index_fill_(0, active, float(index + 1))
            values = grid.data.index_select(0, rows)
            if index < last:
                score = self._halting_sparse(grid, halts[index], active, rows)
            else:
                score = torch.ones(active.numel(), device=x.device)
            before = total.index_select(0, active)
            halting = before + score >= threshold
            left = 1.0 - before
            out.index_add_(0, active, torch.where(halting, left, score)[:, None] * values)
            remainder.index_copy_(0, active, torch.where(halting, left, 0.0))
            total.index_copy_(0, active, before + score)
            active = active[~halting]
            if active.numel() == 0:
                break
        maps = count.view(batch, height, width)
        result = out.view(batch, height, width, -1).permute(0, 3, 1, 2)
        return result, StageHalting(maps, maps + remainder.view(batch, height, width))

    def _folded(self, layer: Layer) -> tuple[Tensor, Tensor]:
        """``layer.folded()``, kept while no tensor it reads changes (without gradients only)."""
        if torch.is_grad_enabled():
            return layer.folded()
        conv, norm = layer.conv, getattr(layer.owner, layer.norm_name)
        tensors = [*conv.parameters(), *norm.parameters(), *norm.buffers()]
        versions = [t._version for t in tensors]
        kept = self._folded_cache.get(id(conv))  # holds the tensors themselves, so no id is reused while kept
        if (
            kept is None
            or len(kept[0]) != len(tensors)
            or any(a is not b for a, b in zip(kept[0], tensors))
            or kept[1] != versions
        ):
            kept = (tensors, versions, *layer.folded())
            self._folded_cache[id(conv)] = kept
        return kept[2], kept[3]

    def _unit_sparse(self, grid: Padded, unit: Unit, active: Tensor) -> Tensor:
        """``relu(branch(x) + x)`` at ``active`` positions: each convolution on the positions the next needs."""
        batch, height, width = grid.shape
        mask = torch.zeros(batch * height * width, dtype=torch.bool, device=active.device)
        mask[active] = True
        sets = [mask.view(batch, height, width)]
        for layer in reversed(unit.layers[1:]):  # what each layer must compute, from the last back
            sets.append(dilate(sets[-1], layer.radius))
        sets.reverse()
        source = grid.data
        for i, layer in enumerate(unit.layers):
            where = sets[i].view(-1).nonzero().squeeze(1) if i < len(unit.layers) - 1 else active
            rows = grid.rows.index_select(0, where)
            weight, bias = self._folded(layer)
            y = torch.addmm(bias, grid.patches(source, rows, layer.radius), weight)
            if layer.relu:
                y = torch.relu_(y)
            if i < len(unit.layers) - 1:
                source = grid.empty(y.shape[1]).index_copy_(0, rows, y)
        return torch.relu_(y + grid.data.index_select(0, rows))

    @staticmethod
    def _halting_sparse(grid: Padded, halt: nn.Module, active: Tensor, rows: Tensor) -> Tensor:
        batch, height, width = grid.shape
        pooled = grid.data.view(batch, -1, grid.data.shape[1]).sum(dim=1) / (height * width)
        score = halt.fc(pooled)[:, 0].index_select(0, torch.div(active, height * width, rounding_mode="floor"))
        conv = halt.conv.weight.permute(2, 3, 1, 0).reshape(-1, 1)
        score = score + torch.addmm(halt.conv.bias, grid.patches(grid.data, rows, 1), conv)[:, 0]
        return torch.sigmoid(score)

    @torch.no_grad()
    def halting_maps(self, x: Tensor, k: int) -> list[StageHalting]:
        """What each stage did for images ``x`` at step ``k`` (eval mode)."""
        was_training = self.training
        self.eval()
        self._record = []
        try:
            self.forward_until(x, k)
            return self._record
        finally:
            self._record = None
            self.train(was_training)

    @torch.no_grad()
    def measure_cost(
        self, batches: Iterable[Tensor | Sequence[Tensor]], *, max_images: int = 1024
    ) -> tuple[SACTCost, ...]:
        """Count every step's FLOPs as executed (sparse) on up to ``max_images`` images from ``batches`` (tensors,
        or (images, labels) pairs) and store them with the weights: profiles, caches and the scheduler read them
        as :attr:`step_flops`."""
        from torch.utils.flop_counter import FlopCounterMode

        images = []
        seen = 0
        for batch in batches:
            x = batch if isinstance(batch, Tensor) else batch[0]
            images.append(x[: max_images - seen])
            seen += images[-1].shape[0]
            if seen >= max_images:
                break
        if not seen:
            raise AnytimeError("measuring SACT's cost needs images; the split given is empty")
        device = self.measured_flops.device
        was_training, execution = self.training, self.execution
        self.eval()
        self.execution = "sparse"
        costs = []
        try:
            for k, threshold in enumerate(self.thresholds):
                counter = FlopCounterMode(display=False)
                units = torch.zeros(len(self._stages), dtype=torch.float64)
                self._record = []
                with counter:
                    for x in images:
                        self.forward_until(x.to(device), k)
                for s, stats in enumerate(self._record):
                    units[s % len(self._stages)] += stats.units.double().sum().item() / stats.units[0].numel()
                flops = max(1, round(counter.get_total_flops() / seen))
                costs.append(SACTCost(threshold, flops, tuple(float(u) / seen for u in units)))
        finally:
            self._record = None
            self.execution = execution
            self.train(was_training)
        self.measured_flops.copy_(torch.tensor([c.flops for c in costs]))
        self.measured_units.copy_(torch.tensor([c.units for c in costs]))
        return tuple(costs)

    def extra_repr(self) -> str:
        return f"thresholds={list(self.thresholds)}, mode={self.mode}, ponder_cost={self.ponder_cost}, execution={self.execution}"
