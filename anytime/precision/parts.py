"""The chain-of-graphs form of a model's steps: how a model splits into parts (a multi-exit model's segments and
exit heads, one module per step, or the model itself), the input each part sees, and :class:`PartsModel`, which runs
such a chain (converted or exported) under the step contract; with the example inputs and compile-cache room the
parts need.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from anytime.backbones.base import example_input, takes_tokens
from anytime.contract import is_segmented, step_count
from anytime.errors import AnytimeError

SHAPES_PER_PART = 16  # input shapes (batch sizes, sentence lengths) each compiled part may meet and stay compiled


class StepPart(nn.Module):
    """Step ``k`` of a model whose steps are separate forwards, as a module of its own (to export it)."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.model = model
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        return self.model.forward_until(x, self.k)  # type: ignore[operator]


def layout_of(model: nn.Module) -> str:
    """How a model's steps are computed: ``exits`` (segments and heads), ``steps`` (one forward per step) or ``plain``."""
    if is_segmented(model):
        return "exits"
    if step_count(model) > 1:
        return "steps"
    return "plain"


def float_parts(model: nn.Module) -> list[nn.Module]:
    """The graphs a model is converted as: for a multi-exit model segment 0, head 0, segment 1, ...,
    the last segment; for separate steps one module per step; otherwise the model itself."""
    layout = layout_of(model)
    if layout == "exits":
        segments, heads = list(model.segments), list(model.heads)  # type: ignore[arg-type]
        parts: list[nn.Module] = []
        for k, segment in enumerate(segments):
            parts.append(segment)
            if k < len(heads):
                parts.append(heads[k])
        return parts
    if layout == "steps":
        return [StepPart(model, k) for k in range(int(model.num_steps))]  # type: ignore[arg-type]
    return [model]


def part_inputs(layout: str, parts: list[nn.Module], x: Tensor) -> list[Tensor]:
    """The input each part sees when the model runs on ``x`` (a multi-exit model's head sees its segment's output)."""
    if layout != "exits":
        return [x] * len(parts)
    inputs, h = [], x
    for i, part in enumerate(parts):
        if i % 2 == 0:
            inputs.append(h)
            h = part(h)
        else:
            inputs.append(h)
    return inputs


def run_parts(layout: str, parts: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """Every step's output of a chain of parts (segments and heads, or one part per step) on ``x``."""
    if layout != "exits":
        return [part(x) for part in parts]
    outputs, h = [], x
    for i in range(0, len(parts), 2):
        h = parts[i](h)
        outputs.append(parts[i + 1](h) if i + 1 < len(parts) else h)
    return outputs


class PartsModel(nn.Module):
    """Steps computed by a chain of graphs (``float_parts`` of a model, converted or exported), under the step
    contract: a multi-exit model's parts are segment 0, head 0, segment 1, ..., the last segment; otherwise
    one part per step. Inputs are cast to ``dtype`` and logits come back in float32."""

    def __init__(
        self, layout: str, parts: list[nn.Module], *, dtype: torch.dtype, step_flops: tuple[int, ...],
        exit_info: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layout = layout
        self.parts = nn.ModuleList(parts)
        self.step_flops = step_flops
        self.exit_info = exit_info
        self.backbone_flops = step_flops[-1]
        self.incremental = layout == "exits"
        self._dtype = dtype
        self.training = False

    @property
    def num_steps(self) -> int:
        """The number of steps (exits, slices, ladder steps; 1 for a plain model)."""
        if self.layout == "exits":
            return (len(self.parts) + 1) // 2
        return len(self.parts)

    @property
    def segments(self) -> tuple[nn.Module, ...]:
        """Multi-exit models: the converted backbone segments (with the input cast of the first)."""
        return self._wrapped()[0]

    @property
    def heads(self) -> list[nn.Module]:
        """Multi-exit models: the converted exit heads (logits returned in float32)."""
        return list(self._wrapped()[1])

    def _wrapped(self) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
        # Made once: building the wrapper modules on every early-exit call cost 30 us at batch 1 (LeNet: 110 us
        # in all). Kept in a plain attribute, so the parts are not registered twice.
        wrapped = self.__dict__.get("_wrappers")
        if wrapped is None:
            segments = tuple(_Cast(p, self._dtype) if i == 0 else p for i, p in enumerate(self.parts[0::2]))
            wrapped = self.__dict__["_wrappers"] = (segments, tuple(_Float(p) for p in self.parts[1::2]))
        return wrapped

    def backbone(self, x: Tensor) -> Tensor:
        """The whole converted network to its last exit (what the plain backbone computes)."""
        return self.forward_until(x, self.num_steps - 1)

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        """Each step's logits in turn; for a multi-exit model each computed only when asked for."""
        if self.layout != "exits":
            for k in range(self.num_steps):
                yield self.forward_until(x, k)
            return
        h = _cast(x, self._dtype)
        last = self.num_steps - 1
        for k in range(self.num_steps):
            h = self.parts[2 * k](h)
            yield h.float() if k == last else self.parts[2 * k + 1](h).float()

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        """Logits ``[B, C]`` of step ``k``, computing no more than it needs."""
        if not isinstance(k, int) or not -self.num_steps <= k < self.num_steps:
            raise AnytimeError(f"step {k} does not exist; this model has steps 0..{self.num_steps - 1}")
        k %= self.num_steps
        if self.layout != "exits":
            return self.parts[k](_cast(x, self._dtype)).float()
        h = _cast(x, self._dtype)
        for i in range(k + 1):
            h = self.parts[2 * i](h)
        return h.float() if k == self.num_steps - 1 else self.parts[2 * k + 1](h).float()

    def forward_all(self, x: Tensor) -> Tensor:
        """Logits of every step, ``[K, B, C]``, cheapest first."""
        return torch.stack(list(self.steps(x)))

    def forward(self, x: Tensor) -> Tensor:
        """``forward_all`` for a model of several steps, the logits ``[B, C]`` for a plain one."""
        return self.forward_until(x, 0) if self.layout == "plain" else self.forward_all(x)

    def train(self, mode: bool = True) -> PartsModel:
        """Always in inference mode: the converted graphs were exported in eval mode and have no other."""
        if mode:
            raise AnytimeError("a converted model is for inference; train the float run it came from")
        self.training = False  # not passed down: exported graphs refuse train()/eval()
        return self


class _Cast(nn.Module):
    def __init__(self, part: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.part, self.dtype = part, dtype

    def forward(self, x: Tensor) -> Tensor:
        return self.part(_cast(x, self.dtype))


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Images to the model's precision; token ids stay integers."""
    return x.to(dtype) if x.is_floating_point() else x


class _Float(nn.Module):
    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part

    def forward(self, x: Tensor) -> Tensor:
        return self.part(x).float()


def room_for_compiled_parts(count: int) -> None:
    """Let ``count`` compiled parts each meet :data:`SHAPES_PER_PART` input shapes. Every module torch.compile
    wraps runs through one shared function, whose graph cache holds 8 entries by default: a model of five parts
    seen at two batch sizes fills it, and past it TorchDynamo runs the module eagerly, with only a log warning."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(int(getattr(config, name)), SHAPES_PER_PART * count))


def example_for(model: nn.Module, shape: tuple[int, ...], batch: int) -> Tensor:
    """Inputs of one sample's ``shape`` for ``model``: zeros, or a sentence's token ids for a text encoder."""
    return example_input(shape, batch, tokens=takes_tokens(model))
