"""How an activation travels from the device to the server: fp32 as is, fp16, or int8 with a per-channel affine
scale (the channel's minimum and step, sent as fp32 beside the bytes).

``encode`` turns a tensor into (header fields, payload bytes); ``decode`` turns them back. ``payload_bytes`` says
what a tensor of a given shape costs on the wire, without encoding one, so the planner can price a partition point
from its shape alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from torch import Tensor

CODECS = ("fp32", "fp16", "int8")


def check_codec(codec: str) -> str:
    """Refuse a codec name this module does not know."""
    if codec not in CODECS:
        raise AnytimeError(f"unknown codec '{codec}'; choose one of {', '.join(CODECS)}")
    return codec


def parse_codecs(text: str) -> tuple[str, ...]:
    """``fp32,int8`` -> ("fp32", "int8"), each checked, duplicates refused."""
    codecs = tuple(c.strip() for c in text.split(",") if c.strip())
    if not codecs:
        raise AnytimeError(f"no codec given; choose from {', '.join(CODECS)}")
    if len(set(codecs)) != len(codecs):
        raise AnytimeError(f"codec listed twice in '{text}'")
    return tuple(check_codec(c) for c in codecs)


def _channels(shape: Sequence[int]) -> int:
    # A feature map [C, H, W] is scaled per channel; a flat vector [F] as one channel.
    return int(shape[0]) if len(shape) > 1 else 1


def payload_bytes(shape: Sequence[int], codec: str, batch: int = 1) -> int:
    """Bytes on the wire for ``batch`` tensors of one sample's ``shape`` under ``codec`` (the header aside)."""
    numel = math.prod(int(s) for s in shape) * batch
    if check_codec(codec) == "fp32":
        return 4 * numel
    if codec == "fp16":
        return 2 * numel
    return numel + 8 * _channels(shape) * batch


def encode(x: Tensor, codec: str) -> tuple[dict[str, Any], bytes]:
    """``x`` ``[N, ...]`` as header fields and payload bytes (contiguous, little-endian)."""
    import torch

    check_codec(codec)
    x = x.detach().to("cpu", torch.float32).contiguous()
    fields: dict[str, Any] = {"codec": codec, "shape": list(x.shape)}
    if codec == "fp32":
        return fields, x.numpy().tobytes()
    if codec == "fp16":
        return fields, x.half().numpy().tobytes()
    rows = x.reshape(x.shape[0], _channels(x.shape[1:]), -1)
    low = rows.amin(dim=2, keepdim=True)
    step = (rows.amax(dim=2, keepdim=True) - low) / 255
    step = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((rows - low) / step).clamp_(0, 255).to(torch.uint8)
    scale = torch.cat([low, step], dim=2).contiguous()  # [N, C, 2] fp32
    return fields, scale.numpy().tobytes() + codes.numpy().tobytes()


def decode(fields: dict[str, Any], payload: bytes) -> Tensor:
    """The tensor :func:`encode` sent; a clear error when the payload does not match its shape and codec."""
    import numpy as np
    import torch

    codec = fields.get("codec")
    shape = fields.get("shape")
    if codec not in CODECS:
        raise AnytimeError(f"unknown codec {codec!r}; send one of {', '.join(CODECS)}")
    if (not isinstance(shape, list) or len(shape) < 2 or not all(isinstance(s, int) and not isinstance(s, bool)
                                                                 and s > 0 for s in shape)):  # fmt: skip
        raise AnytimeError(f"shape {shape!r} is not a list of positive whole numbers [N, ...]")
    expected = payload_bytes(shape[1:], codec, shape[0])
    if len(payload) != expected:
        raise AnytimeError(
            f"the payload has {len(payload)} bytes but a {codec} tensor of shape {shape} needs {expected}"
        )
    if codec == "fp32":
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").reshape(shape).copy())
    if codec == "fp16":
        return torch.from_numpy(np.frombuffer(payload, dtype="<f2").reshape(shape).astype(np.float32))
    n, c = shape[0], _channels(shape[1:])
    scale = torch.from_numpy(np.frombuffer(payload[: 8 * n * c], dtype="<f4").reshape(n, c, 2).copy())
    codes = torch.from_numpy(np.frombuffer(payload[8 * n * c :], dtype=np.uint8).reshape(n, c, -1).astype(np.float32))
    return (scale[:, :, :1] + codes * scale[:, :, 1:]).reshape(shape)


def roundtrip(x: Tensor, codec: str) -> Tensor:
    """What the server receives when the device sends ``x`` under ``codec`` (the accuracy effect, offline)."""
    fields, payload = encode(x, codec)
    return decode(fields, payload).to(x.device)
