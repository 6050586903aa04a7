"""Early exits on any backbone: ``attach_exits`` turns a classifier into a ladder of exits (the step contract).

Step k is the exit after the k-th chosen point; the backbone's own head is the last step, so the last
step computes exactly what the backbone computes. Exit heads read the feature map at their point and are
sized to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from anytime.backbones.base import Scale, StagedBackbone, example_input, takes_tokens
from anytime.errors import AnytimeError
from anytime.families.tracing import Chain, Cut, count_flops, refresh_attributes, split_points

HEADS: tuple[str, ...] = ("pool", "scaled", "linear", "conv", "conv2", "msdnet")
GRADED = "graded"  # a head per exit by its position: see head_kinds
_GRADED_THIRDS: tuple[str, str, str] = ("conv2", "conv", "pool")
GRADED_HEAD_SHARE = 0.05  # of the backbone's FLOPs: a graded head that would cost more is made one layer shallower
SDN_FRACTIONS: tuple[float, ...] = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)


def exit_head(kind: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """An exit classifier for features of ``shape`` (``(C, H, W)`` or ``(F,)``).

    ``linear``: global average pooling and a linear layer (the cheapest).
    ``pool``: after SDN's head, average pooling to at most 4x4, then a linear layer (cheap in FLOPs, keeps
    some spatial layout). SDN mixes max and average pooling; the max branch made training diverge at
    learning rates the backbones train well with (0.05 on the digits), so it is left out. ``scaled``: ``pool``
    with its logits multiplied by ``2 / sqrt(features)``, as airbench-style nets scale their own classifier (1/9
    for 256 features): a step of the learning rate then moves the logits about as much whatever the exit's width,
    so the high rates of the fast recipes do not blow up a head that reads thousands of features.
    ``conv``: BranchyNet-like, a 3x3 conv-BN-ReLU at the features' width (strided on maps of 8 pixels or more),
    global pooling and a linear layer; ``conv2``: two of them, for exits after shallow stages, whose features
    are still low-level (BranchyNet gave its earliest branches the most layers). ``msdnet``: MSDNet's
    classifier, two strided 3x3 conv-BN-ReLU of 128 channels, global pooling and a linear layer.
    """
    if kind not in HEADS:
        raise AnytimeError(f"unknown exit head '{kind}'; choose one of {', '.join(HEADS)} (or '{GRADED}')")
    if len(shape) == 1:
        return nn.Linear(shape[0], num_classes)
    if len(shape) == 2:
        if kind in ("conv2", "msdnet"):
            raise AnytimeError(f"the exit head '{kind}' is made of convolutions over an image's features; a text "
                               "model's exits take pool, scaled, linear or conv")  # fmt: skip
        return TokenHead(kind, shape[1], num_classes)
    channels, height, width = shape
    if kind == "linear":
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
    if kind in ("pool", "scaled"):
        size = min(4, height, width)
        features = channels * size * size
        layers = [nn.AdaptiveAvgPool2d(size), nn.Flatten(), nn.Linear(features, num_classes)]
        return nn.Sequential(*layers, *([Scale(2 / math.sqrt(features))] if kind == "scaled" else []))
    if kind == "msdnet":
        from anytime.backbones.msdnet import msd_classifier

        return msd_classifier(channels, num_classes)
    convs: list[nn.Module] = []
    for _ in range(2 if kind == "conv2" else 1):
        stride = 2 if min(height, width) >= 8 else 1
        convs += [nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(channels),
                  nn.ReLU(inplace=True)]  # fmt: skip
        height, width = -(-height // stride), -(-width // stride)
    return nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))


def exit_head_error(spec: str) -> str | None:
    """Why ``spec`` names no exit heads (a one-line message), or None when it does (see :func:`head_kinds`)."""
    unknown = [k.strip() for k in str(spec).split(",") if k.strip() not in HEADS]
    if spec == GRADED or not unknown:
        return None
    return (f"unknown exit head '{unknown[0]}'; choose one of {', '.join(HEADS)}, one per exit separated by commas, "
            f"or '{GRADED}'")  # fmt: skip


def head_kinds(spec: str, fractions: Sequence[float]) -> list[str]:
    """The head kind of each early exit, at ``fractions`` of the backbone's FLOPs: one kind for all (``pool``),
    one per exit (``conv2,pool,pool``), or ``graded``: sized by position, ``conv2`` in the first third of the
    FLOPs, ``conv`` in the second and ``pool`` after (early features are low-level and need layers of their own
    to classify; late ones are nearly there). :func:`attach_exits` then makes a graded head one layer shallower
    while it would cost more than ``GRADED_HEAD_SHARE`` of the backbone's FLOPs (a conv layer over 256 channels
    costs a quarter of an airbench-style net)."""
    if spec == GRADED:
        return [_GRADED_THIRDS[min(2, int(3 * f))] for f in fractions]
    error = exit_head_error(spec)
    if error:
        raise AnytimeError(error)
    kinds = [k.strip() for k in str(spec).split(",")]
    if len(kinds) == 1:
        return kinds * len(fractions)
    if len(kinds) != len(fractions):
        raise AnytimeError(f"{len(kinds)} exit heads given for {len(fractions)} early exits; give one kind, one per "
                           f"early exit, or '{GRADED}'")  # fmt: skip
    return kinds


class TokenHead(nn.Module):
    """An exit classifier for a text encoder's hidden states ``[B, T, H]`` (padded positions zero).

    ``linear``: the first (``[CLS]``) position and a linear layer. ``pool`` / ``scaled``: the mean over the real
    tokens and a linear layer (``scaled`` multiplies the logits by ``2 / sqrt(H)``, as for images). ``conv``: the
    most expressive, BERT's pooler on the first position (a tanh layer) and a linear layer, as DeeBERT's exits.
    """

    def __init__(self, kind: str, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.kind = kind
        self.pool = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if kind == "conv" else nn.Identity()
        self.classifier = nn.Linear(hidden, num_classes)
        self.scale = 2 / math.sqrt(hidden) if kind == "scaled" else 1.0

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, C]``."""
        if self.kind in ("linear", "conv"):
            pooled = x[:, 0]
        else:
            keep = x.ne(0).any(dim=-1, keepdim=True)
            pooled = x.sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        logits = self.classifier(self.pool(pooled))
        return logits * self.scale if self.kind == "scaled" else logits

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


@dataclass(frozen=True)
class ExitInfo:
    """One exit: where it reads, and what answering there costs (one sample, a multiply-add = 2 FLOPs)."""

    index: int
    name: str  # the point it reads ("stages.1", "layer2"); "output" for the backbone's own head
    shape: tuple[int, ...]  # per-sample shape of the features at the point (MSDNet: its scales packed, see exit_view)
    flops: int  # backbone up to the point plus this exit's head: the cost of this step alone
    cost_flops: int  # FLOPs spent by a sample that leaves here under early exit (every head on the way)
    params: int  # parameters needed to answer here (backbone so far and this head)
    head_flops: int
    head_params: int
    head: str = ""  # the exit head's kind ("pool", "conv2"...); "" for the backbone's own head and other families

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict."""
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


class _ScaleGradient(torch.autograd.Function):
    """Identity forward (bit for bit); the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def _scale_gradient(x: Tensor, scale: float) -> Tensor:
    """``x`` in value; ``scale`` times its gradient on the way back."""
    return _ScaleGradient.apply(x, scale)


class MultiExitModel(nn.Module):
    """A backbone with exits, obeying the step contract.

    ``forward_all(x)`` gives ``[K, B, C]`` logits (cheapest exit first), ``forward_until(x, k)`` computes
    no more than exit ``k`` needs, and ``steps(x)`` yields the exits one by one as they are ready.
    ``forward`` is ``forward_all``. The backbone keeps its own parameter names under ``backbone.``; the
    exit heads are ``heads.0`` ... ``heads.{K-2}``.
    """

    def __init__(
        self, backbone: nn.Module, segments: list[nn.Module], heads: list[nn.Module], info: tuple[ExitInfo, ...],
        *, points: str, head: str, backbone_flops: int,
    ) -> None:  # fmt: skip
        super().__init__()
        if len(segments) != len(heads) + 1 or len(info) != len(segments):
            raise ValueError("a multi-exit model needs one segment per exit and one head per early exit")
        self.backbone = backbone
        self.heads = nn.ModuleList(heads)
        # The segments share the backbone's modules; they are kept out of the module tree so that the
        # parameters are registered (and saved) once, under their backbone names.
        self._segments: tuple[nn.Module, ...]
        object.__setattr__(self, "_segments", tuple(segments))
        self.exit_info = info
        self.points = points
        self.head_kind = head
        self.backbone_flops = backbone_flops
        self.backbone_frozen = False
        self.gradient_equilibrium = False

    def freeze_backbone(self) -> MultiExitModel:
        """Train only the exit heads: the backbone's parameters stop taking gradients and its batch-norm
        statistics stay as trained (the backbone stays in eval mode even under ``train()``)."""
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.backbone_frozen = True
        self.backbone.eval()
        return self

    def train(self, mode: bool = True) -> MultiExitModel:
        super().train(mode)
        if self.backbone_frozen:
            self.backbone.eval()
        return self

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        for segment in self._segments:
            refresh_attributes(segment, self.backbone)
        return self

    @property
    def num_steps(self) -> int:
        """The number of exits, the backbone's own head included."""
        return len(self._segments)

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        """Yield the logits of exit 0, 1, ... computing each only when asked for.

        With ``gradient_equilibrium`` set, in training, the gradients are rescaled where the exits branch off
        (Li et al. 2019, "Improved techniques for training adaptive deep networks"): the head of exit k gets
        1/(K-k) of its features' gradient and the rest of the backbone (K-k-1)/(K-k), so every layer receives the
        mean, not the sum, of the gradients of the exits after it. Values are unchanged."""
        last = len(self._segments) - 1
        balance = self.gradient_equilibrium and self.training and torch.is_grad_enabled()
        for k, segment in enumerate(self._segments):
            x = segment(x)
            if k == last:
                yield x
            elif balance:
                share = 1.0 / (last + 1 - k)
                yield self.heads[k](_scale_gradient(x, share))
                x = _scale_gradient(x, 1.0 - share)
            else:
                yield self.heads[k](x)

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        """Logits ``[B, C]`` of exit ``k``: the backbone up to its point and its head, nothing else."""
        k = self._check_step(k)
        for segment in self._segments[: k + 1]:
            x = segment(x)
        return x if k == self.num_steps - 1 else self.heads[k](x)

    def forward_all(self, x: Tensor) -> Tensor:
        """Logits of every exit, ``[K, B, C]``, cheapest first."""
        return torch.stack(list(self.steps(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Same as :meth:`forward_all`."""
        return self.forward_all(x)

    @property
    def segments(self) -> tuple[nn.Module, ...]:
        """The backbone cut at the exit points: segment k turns exit k-1's features into exit k's."""
        return self._segments

    def _check_step(self, k: int) -> int:
        if not isinstance(k, int) or not -self.num_steps <= k < self.num_steps:
            raise AnytimeError(f"exit {k} does not exist; this model has exits 0..{self.num_steps - 1}")
        return k % self.num_steps

    def extra_repr(self) -> str:
        return f"exits={[e.name for e in self.exit_info]}, head={self.head_kind!r}"


def _parse_points(points: str | int | Sequence[str] | Sequence[float]) -> tuple[str, object]:
    if isinstance(points, bool):
        raise AnytimeError("exit points must be 'auto', 'sdn', a count, fractions of FLOPs or point names")
    if isinstance(points, int):
        return "count", points
    if isinstance(points, str):
        text = points.strip()
        if text in ("auto", "sdn"):
            return text, None
        if text.isdigit():
            return "count", int(text)
        items: list[str] = [p.strip() for p in text.split(",") if p.strip()]
        if not items:
            raise AnytimeError("no exit points given; use 'auto', 'sdn', a count, fractions like 0.25,0.5 or names")
        if all(p.isdigit() for p in items):  # "3,7": indices of a Sequential, not fractions
            return "names", items
        try:
            numbers = [float(p) for p in items]
        except ValueError:
            return "names", items
        return "fractions", _fractions(numbers)
    values = list(points)
    if not values:
        raise AnytimeError("no exit points given; use 'auto', 'sdn', a count, fractions like 0.25,0.5 or names")
    if all(isinstance(p, str) for p in values):
        return "names", values
    if all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in values):
        return "fractions", _fractions([float(p) for p in values])
    raise AnytimeError("exit points must be all names (str) or all fractions of FLOPs (float)")


def _fractions(values: list[float]) -> list[float]:
    if not all(0 < f < 1 for f in values):
        raise AnytimeError(f"exit points given as numbers are fractions of the backbone's FLOPs in (0, 1): {values}")
    return sorted(values)


def _at_fractions(chain: Chain, fractions: Sequence[float]) -> list[Cut]:
    chosen: list[Cut] = []
    candidates = [c for c in chain.cuts if c.flops < chain.total_flops]
    if not candidates:
        raise AnytimeError("this backbone has no point to exit at before its output")
    for f in fractions:
        best = min(candidates, key=lambda c: abs(c.flops / chain.total_flops - f))
        if best not in chosen:
            chosen.append(best)
    return chosen


def _choose(chain: Chain, kind: str, value: object, staged: bool) -> list[Cut]:
    total = chain.total_flops
    if kind == "auto":
        ends = [c for c in chain.cuts if c.stage_end]
        if staged:
            return ends[:-1]
        # Traced graphs have no declared stages: the ends of each resolution, skipping the stem's and
        # those just before the classifier.
        chosen: list[Cut] = []
        for cut in ends:
            if 0.1 <= cut.flops / total <= 0.95 and (not chosen or cut.flops > chosen[-1].flops):
                chosen.append(cut)
        return chosen
    if kind == "sdn":
        return _at_fractions(chain, SDN_FRACTIONS)
    if kind == "fractions":
        return _at_fractions(chain, value)  # type: ignore[arg-type]
    if kind == "count":
        count = int(value)  # type: ignore[call-overload]
        if count < 1:
            raise AnytimeError(f"an exit count must be at least 1 (got {count}); 1 is the backbone alone")
        chosen = _at_fractions(chain, [k / count for k in range(1, count)])
        if len(chosen) < count - 1:
            raise AnytimeError(
                f"{count} exits asked, but only {len(chosen) + 1} distinct ones fit: this backbone has "
                f"{len(chain.cuts)} points to exit at, unevenly spread over its FLOPs; ask for fewer or name them"
            )
        return chosen
    aliases = chain.aliases
    chosen = []
    for name in value:  # type: ignore[attr-defined]
        match = [c for c in chain.cuts if c.name == name or aliases.get(c.position) == name]
        if not match:
            valid = [c.name for c in chain.cuts] + list(aliases.values())
            raise AnytimeError(f"no exit point named '{name}'; this backbone can exit after: {', '.join(valid)}")
        chosen.append(match[0])
    positions = [c.position for c in chosen]
    if len(set(positions)) != len(positions):
        raise AnytimeError(f"exit points {', '.join(value)} name the same point twice")  # type: ignore[arg-type]
    return sorted(chosen, key=lambda c: c.position)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _unique_params(modules: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def attach_exits(
    backbone: nn.Module,
    points: str | int | Sequence[str] | Sequence[float] = "auto",
    *,
    head: str = "pool",
    num_classes: int | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> MultiExitModel:
    """Attach early exits to ``backbone`` and return a :class:`MultiExitModel`.

    ``points``: ``"auto"`` (after every stage but the last), ``"sdn"`` (at 15, 30, ... 90% of the
    backbone's FLOPs, as SDN places them), a count ``N`` (N exits in all, evenly spread over the FLOPs),
    fractions of FLOPs (``[0.25, 0.5]``) or point names (``["stages.0", "stages.1.2"]``, or module names such
    as ``layer2`` for a torchvision model). Zoo models split at their declared stages and blocks; any
    other module is split on its torch.fx graph. ``head`` picks the exit head design (see :func:`exit_head`): one
    for every exit, one per early exit (``conv2,pool,pool``) or ``graded`` (see :func:`head_kinds`).
    ``input_shape`` is one sample's ``(C, H, W)``; by default the backbone's ``in_channels`` at 32x32, or for a
    text encoder ``(T,)``, its maximum length (FLOPs are counted at that length).
    """
    kind, value = _parse_points(points)
    error = exit_head_error(head)
    if error:  # before any tracing
        raise AnytimeError(error)
    if input_shape is None and getattr(backbone, "modality", "image") == "text":
        input_shape = (int(backbone.max_length),)  # type: ignore[arg-type]
    if input_shape is None:
        input_shape = (int(getattr(backbone, "in_channels", 3)), 32, 32)
    try:
        device = next(backbone.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    sample = example_input(input_shape, 1, tokens=takes_tokens(backbone), device=device)
    chain = split_points(backbone, sample)
    chosen = _choose(chain, kind, value, isinstance(backbone, StagedBackbone))
    segments = chain.segments(chosen)
    if num_classes is None:
        with torch.no_grad():
            was_training = backbone.training
            num_classes = int(backbone.eval()(sample).shape[-1])
            backbone.train(was_training)
    kinds = head_kinds(head, [cut.flops / chain.total_flops for cut in chosen])
    heads, built = [], []
    for cut, kind in zip(chosen, kinds):
        if head == GRADED and len(cut.shape) == 2:
            kind = "pool"  # a text encoder's tokens: no convolutions to grade
        made = _head_at(backbone, cut, kind, num_classes)
        while head == GRADED and kind != "pool" and _flops(made, cut) > GRADED_HEAD_SHARE * chain.total_flops:
            kind = _GRADED_THIRDS[_GRADED_THIRDS.index(kind) + 1]
            made = _head_at(backbone, cut, kind, num_classes)
        heads.append(made.to(device))
        built.append(kind)
    info = _costs(backbone, segments, heads, chosen, sample, built)
    spec = str(points) if isinstance(points, (str, int)) else ",".join(str(p) for p in points)
    return MultiExitModel(backbone, segments, heads, info, points=spec, head=head, backbone_flops=chain.total_flops)


def _head_at(backbone: nn.Module, cut: Cut, kind: str, num_classes: int) -> nn.Module:
    """The exit head after ``cut``: on its features, or on what the backbone says an exit there reads (MSDNet's
    coarsest scale of its packed scales), or the backbone's own design when it has one (``exit_head_at``)."""
    own = getattr(backbone, "exit_head_at", None)
    if own is not None:
        return own(cut.name, cut.shape, num_classes)
    view = getattr(backbone, "exit_view", None)
    if view is None:
        return exit_head(kind, cut.shape, num_classes)
    reader, shape = view(cut.name, cut.shape)
    return nn.Sequential(reader, exit_head(kind, shape, num_classes))


def _flops(head: nn.Module, cut: Cut) -> int:
    """FLOPs of ``head`` on one sample at ``cut``."""
    flops, _ = count_flops(head.eval(), torch.zeros(1, *cut.shape))
    head.train()
    return flops


def _costs(
    backbone: nn.Module, segments: list[nn.Module], heads: list[nn.Module], chosen: list[Cut], sample: Tensor,
    kinds: Sequence[str],
) -> tuple[ExitInfo, ...]:  # fmt: skip
    was_training = backbone.training
    backbone.eval()
    for h in heads:
        h.eval()
    info: list[ExitInfo] = []
    spent = 0  # backbone FLOPs so far
    heads_spent = 0
    x = sample
    try:
        for k, segment in enumerate(segments):
            seg_flops, x = count_flops(segment, x)
            spent += seg_flops
            last = k == len(segments) - 1
            head_flops, head_params = (0, 0) if last else (count_flops(heads[k], x)[0], _params(heads[k]))
            heads_spent += head_flops
            info.append(ExitInfo(
                index=k, name="output" if last else chosen[k].name, shape=tuple(x.shape[1:]),
                flops=spent + head_flops, cost_flops=spent + heads_spent,
                params=_unique_params(segments[: k + 1]) + head_params, head_flops=head_flops, head_params=head_params,
                head="" if last else kinds[k],
            ))  # fmt: skip
    finally:
        backbone.train(was_training)
        for h in heads:
            h.train(was_training)
    return tuple(info)
