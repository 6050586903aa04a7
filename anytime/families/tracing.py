"""Split any module into a chain of segments: by its stage contract, or by tracing its graph with torch.fx.

A *cut* is a point in the forward computation where exactly one tensor is alive (everything later
depends on the past only through it), so the computation before the cut and the one after it are two
modules that compose back into the original. Exits attach at cuts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone
from anytime.errors import AnytimeError, first_line


@dataclass(frozen=True)
class Cut:
    """A place where the network can be split: after ``name``, whose output has ``shape`` (per sample)."""

    name: str
    position: int  # order of the cut in the forward computation
    shape: tuple[int, ...]
    flops: int  # FLOPs of the computation before the cut, one sample
    stage_end: bool  # the last cut before the resolution drops (or the end of a declared stage)


class Chain:
    """A network as an ordered list of cuts, able to produce the segments between any chosen cuts."""

    def __init__(
        self, cuts: list[Cut], total_flops: int, make: Callable[[list[Cut]], list[nn.Module]],
        aliases: dict[int, str] | None = None,
    ) -> None:  # fmt: skip
        self.cuts = cuts
        self.total_flops = total_flops
        self.aliases = aliases or {}  # other names of some cuts, by position (a stage's name for its last block)
        self._make = make

    def segments(self, chosen: list[Cut]) -> list[nn.Module]:
        """``len(chosen) + 1`` modules: input -> cut 0 -> cut 1 -> ... -> the network's output."""
        return self._make(sorted(chosen, key=lambda c: c.position))


def count_flops(module: nn.Module, x: Tensor) -> tuple[int, Tensor]:
    """FLOPs of ``module`` on ``x`` (a multiply-add = 2), and its output."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        y = module(x)
    return int(counter.get_total_flops()), y


def _is_block(module: nn.Module) -> bool:
    # A block is a module made of modules (a residual block, conv-BN-ReLU); a bare conv or ReLU is a
    # layer, and cutting between layers would hand exits tensors the next layer changes in place.
    return any(True for _ in module.children())


def staged_chain(backbone: StagedBackbone, sample: Tensor) -> Chain:
    """Cuts after the stem and after every block of every stage (a stage that is not a sequence of blocks
    is one unit)."""
    units: list[tuple[str, nn.Module, bool]] = [("stem", backbone.stem, False)]
    for i, stage in enumerate(backbone.stages):
        children = list(stage.children()) if isinstance(stage, nn.Sequential) else []
        if len(children) > 1 and all(_is_block(c) for c in children):
            units += [(f"stages.{i}.{j}", c, j == len(children) - 1) for j, c in enumerate(children)]
        else:
            units.append((f"stages.{i}", stage, True))
    cuts: list[Cut] = []
    flops = 0
    x = sample
    was_training = backbone.training
    backbone.eval()
    try:
        for position, (name, unit, stage_end) in enumerate(units):
            unit_flops, x = count_flops(unit, x)
            flops += unit_flops
            cuts.append(Cut(name, position, tuple(x.shape[1:]), flops, stage_end))
        head_flops, _ = count_flops(backbone.head, x)
    finally:
        backbone.train(was_training)
    # A stage named by its block ("stages.2.2") is also reachable by the stage's name.
    aliases = {c.position: c.name.rsplit(".", 1)[0] for c in cuts if c.stage_end and c.name.count(".") == 2}

    def make(chosen: list[Cut]) -> list[nn.Module]:
        bounds = [c.position + 1 for c in chosen]
        starts = [0, *bounds]
        ends = [*bounds, len(units)]
        segments: list[nn.Module] = [nn.Sequential(*(u[1] for u in units[a:b])) for a, b in zip(starts, ends)]
        segments[-1] = nn.Sequential(*segments[-1], backbone.head)  # type: ignore[misc]
        return segments

    return Chain(cuts, flops + head_flops, make, aliases)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, keeping modules whose forward branches on ``self.training`` whole (stochastic depth)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        from torchvision.ops import StochasticDepth

        return isinstance(m, StochasticDepth) or super().is_leaf_module(m, module_qualified_name)


def _modifies_input_in_place(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    if node.op == "call_function":
        return bool(node.kwargs.get("inplace", False))
    return False


def traced_chain(backbone: nn.Module, sample: Tensor) -> Chain:
    """Cuts of any traceable module, found on its torch.fx graph."""
    from torch.fx.passes.shape_prop import ShapeProp

    was_training = backbone.training
    graphs = []
    try:
        # fx runs Python control flow once, at trace time: a forward that branches on self.training would be
        # frozen in one mode, so it is traced in both and refused if they differ.
        for mode in (True, False):
            graphs.append(_Tracer().trace(backbone.train(mode)))
    except Exception as exc:  # noqa: BLE001  fx raises many types; all mean the same to the user
        raise AnytimeError(
            f"cannot split {type(backbone).__name__} into stages: torch.fx could not trace it ({first_line(exc)}); "
            "give it a stage contract (subclass StagedBackbone) or make its forward traceable"
        ) from None
    finally:
        backbone.train(was_training)
    if str(graphs[0]) != str(graphs[1]):
        raise AnytimeError(
            f"cannot split {type(backbone).__name__}: its forward branches on self.training outside standard layers, "
            "so one traced graph cannot serve training and inference; give it a stage contract (StagedBackbone)"
        )
    graph = graphs[0]
    root = fx.GraphModule(backbone, graph)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise AnytimeError(
            f"cannot split {type(backbone).__name__}: its forward takes {len(placeholders)} inputs; exits need one"
        )
    backbone.eval()
    try:
        with torch.no_grad():
            ShapeProp(root).propagate(sample)
        per_node = _flops_per_node(root, sample)
    finally:
        backbone.train(was_training)
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    alive: set[fx.Node] = set()
    values: dict[int, fx.Node] = {}
    cuts: list[Cut] = []
    seen_values: set[fx.Node] = set()
    running = 0
    stacks = [list(n.meta.get("nn_module_stack", {})) for n in nodes]
    for i, node in enumerate(nodes[:-1]):
        running += per_node.get(node.name, 0)
        if node.op != "get_attr" and last_use[node] > i:
            alive.add(node)
        for done in [n for n in alive if last_use[n] <= i]:
            alive.discard(done)
        if node.op == "placeholder" or len(alive) != 1:
            continue
        (value,) = alive
        meta = value.meta.get("tensor_meta")
        if value in seen_values or not hasattr(meta, "shape") or len(meta.shape) not in (2, 4):
            continue
        if any(_modifies_input_in_place(u, root) for u in value.users):
            continue
        seen_values.add(value)
        values[i] = value
        cuts.append(Cut(_cut_name(i, stacks, value), i, tuple(meta.shape[1:]), running, False))
    total = running + sum(per_node.get(n.name, 0) for n in nodes[-1:])
    cuts = _mark_stage_ends(cuts)

    def make(chosen: list[Cut]) -> list[nn.Module]:
        segments: list[nn.Module] = []
        start = 0
        prev_value: fx.Node | None = None
        for cut in [*chosen, None]:
            stop = len(nodes) - 1 if cut is None else cut.position
            out_value = nodes[-1].args[0] if cut is None else values[cut.position]
            segments.append(_segment(root, nodes[start : stop + 1], prev_value, out_value))
            if cut is not None:
                start, prev_value = cut.position + 1, values[cut.position]
        return segments

    return Chain(cuts, total, make)


def refresh_attributes(segment: nn.Module, source: nn.Module) -> None:
    """Point a traced segment's directly fetched tensors (``get_attr``) back at ``source``'s current ones.

    A traced segment holds its own references to tensors it reads outside any submodule (a top-level
    buffer, say); moving the backbone (``.to(device)``) replaces buffers, so the references are renewed.
    """
    if not isinstance(segment, fx.GraphModule):
        return
    for node in segment.graph.nodes:
        if node.op == "get_attr":
            *path, name = str(node.target).split(".")
            prefix = ".".join(path)
            setattr(segment.get_submodule(prefix), name, getattr(source.get_submodule(prefix), name))


def split_points(backbone: nn.Module, sample: Tensor) -> Chain:
    """Every point ``backbone`` can exit after: by its stage contract, else on its torch.fx graph."""
    return staged_chain(backbone, sample) if isinstance(backbone, StagedBackbone) else traced_chain(backbone, sample)


def _cut_name(i: int, stacks: list[list[str]], value: fx.Node) -> str:
    # Name a cut by the outermost module that ends exactly there (e.g. "layer2"), else by the graph node.
    here, after = stacks[i], stacks[i + 1] if i + 1 < len(stacks) else []
    for path in here:
        if path not in after:
            return path
    return value.name


def _mark_stage_ends(cuts: list[Cut]) -> list[Cut]:
    # A stage is a run of cuts at one resolution; its end is the last of the run's shallowest named modules
    # (a whole block such as "features.1", rather than the first conv inside the next, strided block).
    def resolution(cut: Cut) -> tuple[int, ...] | None:
        return cut.shape[1:] if len(cut.shape) == 3 else None

    def depth(cut: Cut) -> int:
        return cut.name.count(".") if "_" not in cut.name.split(".")[-1] else 1 << 20

    ends: set[int] = set()
    run: list[Cut] = []
    for k, cut in enumerate(cuts):
        run.append(cut)
        nxt = cuts[k + 1] if k + 1 < len(cuts) else None
        if nxt is None or resolution(nxt) != resolution(cut):
            if resolution(cut) is not None:
                shallowest = min(depth(c) for c in run)
                ends.add([c for c in run if depth(c) == shallowest][-1].position)
            run = []
    return [Cut(c.name, c.position, c.shape, c.flops, c.position in ends) for c in cuts]


def _flops_per_node(root: fx.GraphModule, sample: Tensor) -> dict[str, int]:
    from torch.utils.flop_counter import FlopCounterMode

    counts: dict[str, int] = {}
    counter = FlopCounterMode(display=False)

    class Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            before = counter.get_total_flops()
            result = super().run_node(n)
            counts[n.name] = int(counter.get_total_flops() - before)
            return result

    with torch.no_grad(), counter:
        Counting(root).run(sample)
    return counts


def _segment(root: fx.GraphModule, span: list[fx.Node], inp: fx.Node | None, out: object) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {}
    if inp is not None:
        env[inp] = x

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise AnytimeError(f"internal error: value '{node.name}' crosses a cut")
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    for node in span:
        if node.op == "placeholder":
            env[node] = x
        elif node.op != "output":
            env[node] = graph.node_copy(node, lookup)
    graph.output(fx.node.map_arg(out, lookup))  # type: ignore[type-var]
    return fx.GraphModule(root, graph)
