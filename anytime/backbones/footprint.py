"""What a model needs in memory: its weights, and what one sample adds to a forward pass or a training step;
refused up front where it cannot fit (see :mod:`anytime.utils.resources` for the machine's side)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from anytime.backbones.base import example_input, takes_tokens
from anytime.utils.resources import check_memory

_MEASURE_PIXELS = 256 * 256


def forward_bytes_per_sample(model: nn.Module, input_shape: Sequence[int], *, training: bool = False) -> int:
    """The memory one sample adds to a forward pass of ``model`` (bytes): for inference the largest layer's
    input and output with room for a residual branch, for training every layer's output (what autograd keeps).

    Measured with forward hooks on one sample; an input of more than 256x256 pixels is measured at 256x256 and
    scaled by area, so an absurd size is judged without allocating it.
    """
    text = takes_tokens(model)  # token ids (T,), counted as a 1 x 1 x T input
    channels, height, width = (1, 1, int(input_shape[0])) if len(input_shape) == 1 else (int(v) for v in input_shape)
    scale = 1.0
    if height * width > _MEASURE_PIXELS:
        side = int(_MEASURE_PIXELS**0.5)
        scale = height * width / (min(height, side) * min(width, side))
        height, width = min(height, side), min(width, side)
    sizes: list[tuple[int, int]] = []

    def nbytes(value: object) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (tuple, list)):
            return sum(nbytes(v) for v in value)
        return 0

    def hook(_module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        sizes.append((nbytes(inputs), nbytes(output)))

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    was_training = model.training
    try:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        model.eval()
        with torch.no_grad():
            model(
                example_input(
                    tuple(int(v) for v in input_shape) if len(input_shape) == 1 else (channels, height, width),
                    1,
                    tokens=text,
                    device=device,
                )
            )
    except Exception:  # noqa: BLE001  a model that only takes its own size: judge by the input alone
        sizes = []
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    input_bytes = (8 if text else 4) * channels * height * width
    if not sizes:
        return int(scale * 64 * input_bytes)
    if training:
        footprint = input_bytes + sum(out for _, out in sizes) + 2 * max(out for _, out in sizes)
    else:
        footprint = input_bytes + 2 * max(inp + out for inp, out in sizes)
    return int(scale * footprint)


def model_bytes(model: nn.Module) -> int:
    """The bytes of a model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def check_forward_memory(
    model: nn.Module, input_shape: Sequence[int], batch_size: int, *, training: bool = False, what: str, hint: str
) -> None:
    """Refuse a forward (or training step) of ``batch_size`` samples that cannot fit in memory."""
    model = getattr(model, "float_model", model)  # a converted model is judged by its float graph
    per_sample = forward_bytes_per_sample(model, input_shape, training=training)
    weights = model_bytes(model) * (4 if training else 1)  # training: gradients, momentum and the update
    check_memory(batch_size * per_sample + weights, what, hint)
