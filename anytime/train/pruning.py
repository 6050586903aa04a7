"""Lottery tickets with late resetting: magnitude pruning, masks kept through training, rewinding to epoch k.

A ticket is an ordinary run whose recipe names ``prune_from`` (a finished run: the dense network, or the ticket of
the round before, for iterative pruning), a total ``sparsity`` and a ``reset_epoch`` k. Its mask keeps the
largest-magnitude weights of ``prune_from``'s final weights among those its own mask kept (over all layers at
once, or layer by layer); the surviving weights are then rewound to the dense run's values after k epochs (its
``checkpoint-epoch{k}.pt``, with the optimiser's momentum and the schedule at that point), and the run trains
on from epoch k to the end with the pruned weights held at zero. k = 0 is the original lottery ticket (rewind to
initialisation). A structured ticket (``prune_unit = "channels"``, :mod:`anytime.train.channels`) removes whole
channels instead: the rewound weights are cut to the kept channels and the smaller network trains on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError
from anytime.train.channels import ChannelPlan

MASK_FILE = "mask.safetensors"


def kept_checkpoint(run_dir: str | Path, epoch: int) -> Path:
    """Where a run keeps its full checkpoint after ``epoch`` epochs (0: before the first)."""
    return Path(run_dir) / f"checkpoint-epoch{epoch}.pt"


def prunable(model: nn.Module) -> list[str]:
    """The state-dict names of the weights magnitude pruning may zero: every convolution's and linear layer's."""
    return [f"{name}.weight" if name else "weight" for name, m in model.named_modules()
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))]  # fmt: skip


@dataclass(frozen=True)
class Mask:
    """Which weights survive: one boolean tensor per pruned weight (True: kept)."""

    keep: dict[str, Tensor]

    @property
    def sparsity(self) -> float:
        """The share of the maskable weights that are pruned."""
        total = sum(m.numel() for m in self.keep.values())
        return 1.0 - sum(int(m.sum()) for m in self.keep.values()) / max(total, 1)

    def layer_sparsity(self) -> dict[str, float]:
        """Each layer's share of pruned weights."""
        return {name: 1.0 - float(m.float().mean()) for name, m in self.keep.items()}

    @torch.no_grad()
    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Zero the pruned weights (and their momentum, so it cannot revive them)."""
        params = dict(model.named_parameters())
        for name, keep in self.keep.items():
            param = params[name]
            param.mul_(keep.to(param.device, param.dtype))
            if optimizer is not None:
                buffer = optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    buffer.mul_(keep.to(buffer.device, buffer.dtype))

    @torch.no_grad()
    def mask_gradients(self, model: nn.Module) -> None:
        """Zero the gradients of the pruned weights (before the optimiser's step)."""
        params = dict(model.named_parameters())
        for name, keep in self.keep.items():
            grad = params[name].grad
            if grad is not None:
                grad.mul_(keep.to(grad.device, grad.dtype))

    def save(self, path: str | Path) -> Path:
        """Write the mask as safetensors (uint8), atomically."""
        from safetensors.torch import save_file

        from anytime.utils.io import atomic_path

        with atomic_path(path) as tmp:
            save_file({k: v.to(torch.uint8).contiguous().cpu() for k, v in self.keep.items()}, str(tmp))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Mask:
        """Read a mask written by :meth:`save`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return cls({k: v.bool() for k, v in load_file(str(path)).items()})
        except (SafetensorError, OSError) as exc:
            raise AnytimeError(f"{path} is not a readable mask ({exc}); train that ticket again") from None

    def state(self) -> dict[str, Tensor]:
        """The mask as a checkpoint holds it."""
        return {k: v.to(torch.uint8) for k, v in self.keep.items()}


def magnitude_mask(
    weights: dict[str, Tensor],
    names: list[str],
    sparsity: float,
    *,
    scope: str = "global",
    previous: Mask | None = None,
) -> Mask:
    """Keep the ``1 - sparsity`` largest-magnitude weights of ``names`` (over all of them at once, or in each layer),
    among those ``previous`` kept; the pruned share is of all those weights, previous rounds' included."""
    from anytime.train.config import PRUNE_SCOPES

    if scope not in PRUNE_SCOPES:
        raise AnytimeError(f"unknown pruning scope {scope!r}; choose one of {', '.join(PRUNE_SCOPES)}")
    if not 0.0 <= sparsity < 1.0:
        raise AnytimeError(f"sparsity is the share of weights pruned, in [0, 1) (got {sparsity})")
    missing = [n for n in names if n not in weights]
    if missing:
        raise AnytimeError(f"the weights to prune have no {missing[0]}: they are not of this model")
    scores = {}
    for name in names:
        score = weights[name].detach().float().abs().cpu()
        if previous is not None and name in previous.keep:
            score = torch.where(previous.keep[name], score, torch.full_like(score, -1.0))
        scores[name] = score
    if previous is not None and previous.sparsity > sparsity + 1e-9:
        raise AnytimeError(f"sparsity {sparsity:g} is below the {previous.sparsity:.4g} of the ticket pruned from; "
                           "each round prunes more")  # fmt: skip

    def keep_top(score: Tensor, count: int) -> Tensor:
        keep = torch.zeros(score.numel(), dtype=torch.bool)
        if count > 0:
            keep[torch.topk(score.reshape(-1), count).indices] = True
        return keep.reshape(score.shape)

    if scope == "layer":
        return Mask({n: keep_top(s, round((1.0 - sparsity) * s.numel())) for n, s in scores.items()})
    flat = torch.cat([s.reshape(-1) for s in scores.values()])
    keep_flat = keep_top(flat, round((1.0 - sparsity) * flat.numel()))
    out, start = {}, 0
    for name, score in scores.items():
        out[name] = keep_flat[start : start + score.numel()].reshape(score.shape)
        start += score.numel()
    return Mask(out)


def dense_root(run_dir: str | Path) -> Path:
    """The dense run a chain of tickets rewinds to: follow ``prune_from`` back to a run that has none."""
    seen: set[Path] = set()
    current = Path(run_dir)
    while True:
        resolved = current.resolve()
        if resolved in seen:
            raise AnytimeError(f"the tickets' prune_from links go round in a circle at {current}")
        seen.add(resolved)
        try:
            config = json.loads((current / "config.json").read_text())["train"]
        except (OSError, ValueError, KeyError):
            raise AnytimeError(f"{current} is not a finished run (no readable config.json); train it first") from None
        parent = config.get("prune_from")
        if parent is None:
            return current
        current = Path(parent)


@dataclass(frozen=True)
class Ticket:
    """What a ticket run starts from: the mask, and the dense run's checkpoint it rewinds to."""

    mask: Mask
    rewind: dict[str, Any]  # the dense run's checkpoint after reset_epoch epochs
    dense_run: Path


def make_ticket(model: nn.Module, prune_from: str | Path, *, sparsity: float, reset_epoch: int, scope: str) -> Ticket:
    """Prune ``prune_from``'s final weights to ``sparsity`` and find the rewind point of its dense run."""
    from anytime.train.checkpoint import load_checkpoint, read_weights

    source = Path(prune_from)
    weights_path = source / "model.safetensors"
    if not weights_path.is_file():
        raise AnytimeError(f"--prune-from {source} is not a finished run (no model.safetensors); train it first")
    previous = Mask.load(source / MASK_FILE) if (source / MASK_FILE).is_file() else None
    mask = magnitude_mask(read_weights(weights_path), prunable(model), sparsity, scope=scope, previous=previous)
    dense = dense_root(source)
    rewind_path = kept_checkpoint(dense, reset_epoch)
    if not rewind_path.is_file():
        raise AnytimeError(f"the dense run {dense} kept no checkpoint after epoch {reset_epoch}: train it with "
                           f"--keep-checkpoints {reset_epoch} (0 keeps the initial weights)")  # fmt: skip
    return Ticket(mask=mask, rewind=load_checkpoint(rewind_path), dense_run=dense)


def round_sparsities(sparsity: float, rounds: int) -> list[float]:
    """Iterative pruning's total sparsity after each of ``rounds`` rounds, each pruning the same share of what is
    left, the last reaching ``sparsity``."""
    if rounds < 1:
        raise AnytimeError(f"--rounds must be at least 1 (got {rounds})")
    return [1.0 - (1.0 - sparsity) ** ((r + 1) / rounds) for r in range(rounds)]


@dataclass(frozen=True)
class ChannelTicket:
    """What a structured ticket starts from: the channel plan, and the dense run's checkpoint it rewinds to."""

    plan: ChannelPlan
    rewind: dict[str, Any]
    dense_run: Path
    dense_parameters: int


def make_channel_ticket(
    model: nn.Module, prune_from: str | Path, *, sparsity: float, reset_epoch: int, scope: str,
    input_shape: tuple[int, ...], num_classes: int,
) -> ChannelTicket:  # fmt: skip
    """Plan which channels of ``prune_from``'s final weights to keep (``model`` is the dense network, untouched)
    and find the rewind point of its dense run."""
    import copy

    from anytime.train.channels import plan_channels, run_channel_plan, shrink
    from anytime.train.checkpoint import load_checkpoint, read_weights

    source = Path(prune_from)
    weights_path = source / "model.safetensors"
    if not weights_path.is_file():
        raise AnytimeError(f"--prune-from {source} is not a finished run (no model.safetensors); train it first")
    if (source / MASK_FILE).is_file():
        raise AnytimeError(f"--prune-from {source} is a ticket of masked weights; prune the channels of its dense run "
                           "or of a structured ticket")  # fmt: skip
    previous = run_channel_plan(source)
    trained = copy.deepcopy(model)
    if previous is not None:
        shrink(trained, previous)
    trained.load_state_dict(read_weights(weights_path))
    plan = plan_channels(trained, input_shape, sparsity, scope=scope, num_classes=num_classes, previous=previous)
    dense = dense_root(source)
    rewind_path = kept_checkpoint(dense, reset_epoch)
    if not rewind_path.is_file():
        raise AnytimeError(f"the dense run {dense} kept no checkpoint after epoch {reset_epoch}: train it with "
                           f"--keep-checkpoints {reset_epoch} (0 keeps the initial weights)")  # fmt: skip
    return ChannelTicket(plan, load_checkpoint(rewind_path), dense, sum(p.numel() for p in model.parameters()))
