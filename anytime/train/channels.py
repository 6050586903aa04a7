"""Structured lottery tickets: whole channels pruned, so a ticket is a smaller network that runs faster.

Which channels must be pruned together comes from Torch-Pruning's dependency graph (``torch-pruning``): a
convolution's output channels, the batch norm after it and the next layer's input channels form one group. Only the
groups whose channels stay inside a chain of convolutions, linear layers, batch norms and activations are pruned:
a group that reaches an addition (a residual stream), a slice, a concatenation, a reshape or a classifier is left
whole, since channels there are shared with a shortcut or an exit, and the zoo's CIFAR ResNets pad their shortcuts
with a fixed channel count. On a ResNet that is every residual block's inner channels (Li et al., "Pruning Filters
for Efficient ConvNets", 2017, pruned the same way), on a plain chain (VGG, LeNet) every layer but the last.

A channel's importance is its filter's mean absolute weight, divided by its group's mean when ranked over all
groups at once (so that no layer is emptied for the scale its fan-in gave its weights). The plan
names, per module, which of the dense network's output and input channels it keeps; :func:`shrink` cuts a dense
model to it, with no Torch-Pruning needed, so a ticket run loads wherever anytime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError

CHANNELS_FILE = "channels.json"
CHANNELS_FORMAT = "anytime-channels-v1"
_SHRINKABLE = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d)
# Operations a channel passes through unchanged, one to one: a group made of these and the layers above is closed.
_PASS_THROUGH = ("Relu", "Relu6", "Hardtanh", "Silu", "Gelu", "Hardswish", "Hardsigmoid", "Sigmoid", "Tanh", "Elu",
                 "LeakyRelu", "MaxPool", "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool", "Dropout", "Clone")  # fmt: skip


@dataclass(frozen=True)
class ChannelPlan:
    """Per module, the dense network's output and input channels it keeps (None: all); ``groups``: each pruned
    group's root module and its dense channel count."""

    keep: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]]
    groups: dict[str, int]

    @property
    def sparsity(self) -> float:
        """The share of the prunable (closed groups') channels removed."""
        total = sum(self.groups.values())
        kept = sum(len(self.keep[root][0] or range(count)) for root, count in self.groups.items())
        return 1.0 - kept / max(total, 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, tagged."""
        return {"format": CHANNELS_FORMAT, "groups": self.groups,
                "keep": {name: {"out": None if o is None else list(o), "in": None if i is None else list(i)}
                         for name, (o, i) in self.keep.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> ChannelPlan:
        """Rebuild from :meth:`to_dict`; one clear error for anything malformed."""
        try:
            if doc["format"] != CHANNELS_FORMAT:
                raise ValueError("format")

            def indices(value: Any) -> tuple[int, ...] | None:
                if value is None:
                    return None
                out = tuple(int(v) for v in value)
                if not out or min(out) < 0 or len(set(out)) != len(out):
                    raise ValueError("indices")
                return out

            keep = {str(n): (indices(k["out"]), indices(k["in"])) for n, k in doc["keep"].items()}
            groups = {str(n): int(c) for n, c in doc["groups"].items()}
            if any(root not in keep or keep[root][0] is None for root in groups):
                raise ValueError("a group without its root")
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(f"{where} is not a readable channel plan; train that ticket again") from None
        return cls(keep, groups)

    def save(self, path: str | Path) -> Path:
        """Write atomically."""
        from anytime.utils.io import write_json

        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ChannelPlan:
        """Read a plan written by :meth:`save`."""
        from anytime.utils.io import read_json

        return cls.from_dict(read_json(path, what="channel plan", make="train the ticket", redo="train the ticket again"),
                             str(path))  # fmt: skip


def run_channel_plan(run_dir: str | Path) -> ChannelPlan | None:
    """The channel plan of a structured ticket run (None for any other run)."""
    path = Path(run_dir) / CHANNELS_FILE
    return ChannelPlan.load(path) if path.is_file() else None


@torch.no_grad()
def shrink(model: nn.Module, plan: ChannelPlan) -> nn.Module:
    """Cut a dense model (in place) to the channels ``plan`` keeps; returns it."""
    modules = dict(model.named_modules())
    for name, (out_keep, in_keep) in plan.keep.items():
        module = modules.get(name)
        if module is None or not isinstance(module, _SHRINKABLE):
            raise AnytimeError(f"the channel plan names {name!r}, which this model has no shrinkable layer for: "
                               "the plan is from another architecture")  # fmt: skip
        _shrink_module(module, name, out_keep, in_keep)
    return model


def _select(tensor: Tensor, dim: int, keep: tuple[int, ...] | None, name: str) -> Tensor:
    if keep is None:
        return tensor
    if max(keep) >= tensor.shape[dim]:
        raise AnytimeError(f"the channel plan keeps channel {max(keep)} of {name}, which has {tensor.shape[dim]}")
    return tensor.index_select(dim, torch.tensor(keep, device=tensor.device)).contiguous()


def _shrink_module(
    module: nn.Module, name: str, out_keep: tuple[int, ...] | None, in_keep: tuple[int, ...] | None
) -> None:
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        keep = out_keep or in_keep
        for attr in ("weight", "bias", "running_mean", "running_var"):
            value = getattr(module, attr)
            if value is not None:
                shrunk = _select(value.data, 0, keep, name)
                if isinstance(value, nn.Parameter):
                    setattr(module, attr, nn.Parameter(shrunk, requires_grad=value.requires_grad))
                else:
                    setattr(module, attr, shrunk)
        module.num_features = len(keep) if keep is not None else module.num_features
        return
    weight = module.weight
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and module.groups > 1:
        if module.groups != module.in_channels or module.groups != module.out_channels:
            raise AnytimeError(f"{name} is a grouped convolution that is not depthwise; the plan cannot shrink it")
        keep = out_keep or in_keep
        if out_keep is not None and in_keep is not None and out_keep != in_keep:
            raise AnytimeError(f"the channel plan keeps different input and output channels of depthwise {name}")
        new = _select(weight.data, 0, keep, name)
        module.in_channels = module.out_channels = module.groups = new.shape[0]
    else:
        new = _select(_select(weight.data, 0, out_keep, name), 1, in_keep, name)
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = new.shape[0], new.shape[1]
        else:
            module.out_channels, module.in_channels = new.shape[0], new.shape[1]  # type: ignore[assignment]
    module.weight = nn.Parameter(new, requires_grad=weight.requires_grad)
    if module.bias is not None:
        module.bias = nn.Parameter(
            _select(module.bias.data, 0, out_keep, name), requires_grad=module.bias.requires_grad
        )


def plan_channels(
    model: nn.Module, input_shape: Sequence[int], sparsity: float, *, scope: str = "global", num_classes: int,
    previous: ChannelPlan | None = None,
) -> ChannelPlan:  # fmt: skip
    """Which channels to keep so that ``sparsity`` of the prunable channels (of the dense network, previous rounds'
    included) are gone: the lowest-L1 filters of ``model`` (its trained weights, already cut to ``previous``)."""
    try:
        import torch_pruning as tp
    except ImportError:
        raise AnytimeError("structured tickets need Torch-Pruning's dependency graph: pip install 'anytime[train]' "
                           "(torch-pruning)") from None  # fmt: skip
    from anytime.train.config import PRUNE_SCOPES

    if scope not in PRUNE_SCOPES:
        raise AnytimeError(f"unknown pruning scope {scope!r}; choose one of {', '.join(PRUNE_SCOPES)}")
    done = previous.sparsity if previous is not None else 0.0
    if not 0.0 <= sparsity < 1.0 or sparsity + 1e-9 < done:
        raise AnytimeError(f"channel sparsity {sparsity:g} must be in [{done:.4g}, 1): the share of channels pruned, "
                           "previous rounds' included")  # fmt: skip
    names = {m: n for n, m in model.named_modules()}
    outputs = [m for m in model.modules() if (isinstance(m, nn.Linear) and m.out_features == num_classes)
               or (isinstance(m, nn.Conv2d) and m.out_channels == num_classes)]  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        graph = tp.DependencyGraph().build_dependency(
            model, example_inputs=torch.randn(1, *input_shape, device=next(model.parameters()).device), verbose=False,
        )  # fmt: skip
        candidates = list(graph.get_all_groups(ignored_layers=outputs, root_module_types=(nn.Conv2d, nn.Linear)))
    finally:
        model.train(was_training)
    groups: list[tuple[str, list[tuple[str, str, list[int]]], Tensor]] = []  # root, (module, side, idxs), importance
    for group in candidates:
        members: list[tuple[str, str, list[int]]] = []
        closed = True
        for dep, idxs in group:
            target = dep.target.module
            side = getattr(dep.handler, "__name__", "")
            if (
                isinstance(target, _SHRINKABLE)
                and target not in outputs
                and side in ("prune_out_channels", "prune_in_channels")
            ):
                members.append((names[target], "out" if side == "prune_out_channels" else "in", [int(i) for i in idxs]))
            elif not (type(target).__name__ == "_ElementWiseOp" and _passes_through(target)):
                closed = False
                break
        root = members[0] if members else None
        if not closed or root is None or root[1] != "out":
            continue
        weight = dict(model.named_modules())[root[0]].weight.detach().float()
        importance = weight.abs().reshape(weight.shape[0], -1).mean(dim=1)[root[2]]
        # Divided by the group's mean: a layer's weights are scaled by its fan-in at initialisation, and unnormalised
        # magnitudes ranked over all layers at once would empty the widest layers first.
        groups.append((root[0], members, importance / importance.mean().clamp_min(1e-12)))
    if not groups:
        raise AnytimeError("this network has no channels that can be pruned on their own (every group reaches an "
                           "addition, a reshape or a classifier); prune its weights instead (--prune-unit weights)")  # fmt: skip
    dense = previous.groups if previous is not None else {}
    counts = {root: dense.get(root, len(imp)) for root, _, imp in groups}
    total_keep = round((1.0 - sparsity) * sum(counts.values()))
    keep_positions = _choose(groups, counts, total_keep, sparsity, scope)
    keep: dict[str, list[list[int] | None]] = {}
    for (_, members, _), positions in zip(groups, keep_positions):
        for module, side, idxs in members:
            entry = keep.setdefault(module, [None, None])
            entry[0 if side == "out" else 1] = [idxs[p] for p in positions]
    return _compose(previous, {m: (tuple(o) if o else None, tuple(i) if i else None) for m, (o, i) in keep.items()},
                    counts)  # fmt: skip


def _passes_through(op: Any) -> bool:
    grad_fn = getattr(op, "_grad_fn", None)
    name = type(grad_fn).__name__ if grad_fn is not None and not isinstance(grad_fn, str) else str(grad_fn)
    return any(name.startswith(kind) for kind in _PASS_THROUGH)


def _choose(groups: list[tuple[str, Any, Tensor]], counts: dict[str, int], total_keep: int, sparsity: float,
            scope: str) -> list[list[int]]:  # fmt: skip
    """Per group, the positions (in its current channels) to keep, at least one each."""
    if scope == "layer":
        return [_top(imp, max(1, round((1.0 - sparsity) * counts[root]))) for root, _, imp in groups]
    flat = torch.cat([imp for _, _, imp in groups])
    order = torch.argsort(flat, descending=True)
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[order[: max(total_keep, 0)]] = True
    out, start = [], 0
    for _, _, imp in groups:
        mine = chosen[start : start + imp.numel()]
        positions = [int(i) for i in torch.nonzero(mine).flatten()] or _top(imp, 1)
        out.append(sorted(positions))
        start += imp.numel()
    return out


def _top(importance: Tensor, count: int) -> list[int]:
    return sorted(int(i) for i in torch.topk(importance, min(count, importance.numel())).indices)


def _compose(previous: ChannelPlan | None, keep: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]],
             counts: dict[str, int]) -> ChannelPlan:  # fmt: skip
    """A plan over the dense network's channels: this round's positions, mapped through the previous round's."""
    if previous is None:
        return ChannelPlan(keep, counts)
    merged = dict(previous.keep)
    for module, (out_keep, in_keep) in keep.items():
        before_out, before_in = previous.keep.get(module, (None, None))
        merged[module] = (_through(before_out, out_keep), _through(before_in, in_keep))
    return ChannelPlan(merged, {**previous.groups, **counts})


def _through(before: tuple[int, ...] | None, now: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if now is None:
        return before
    return now if before is None else tuple(before[i] for i in now)
