"""Resource checks before allocation: refuse a request that cannot fit in memory or on disk, in one line that
says how much it would need and what to try, instead of letting the kernel kill the process.

``available_memory`` and ``free_space`` are the two figures every check reads; tests replace them to
exercise the checks with small inputs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from torch import nn

# Above this many pixels per image the footprint is measured at a smaller size and scaled by area.
_MEASURE_PIXELS = 256 * 256


def available_memory() -> int:
    """Bytes this process can still allocate: the kernel's MemAvailable, capped by a cgroup's memory limit."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            available = 1 << 62
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
            used -= int(stat.get("file", 0))  # the page cache is given back on demand
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def free_space(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor)."""
    where = Path(path)
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return 0


def format_bytes(count: float) -> str:
    """``1.5 GB``-style size (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(count) < 1024 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} PB"


def check_memory(need: int, what: str, hint: str) -> None:
    """Refuse ``what`` if it needs more than the memory available now."""
    have = available_memory()
    if need > have:
        raise AnytimeError(f"{what} needs about {format_bytes(need)} of memory but {format_bytes(have)} are available; {hint}")


def check_disk(path: str | os.PathLike[str], need: int, what: str, hint: str) -> None:
    """Refuse ``what`` if the file system of ``path`` has less than ``need`` bytes free."""
    have = free_space(path)
    if need > have:
        raise AnytimeError(f"{what} needs about {format_bytes(need)} free at {path} but {format_bytes(have)} are free; {hint}")


def forward_bytes_per_sample(model: nn.Module, input_shape: Sequence[int], *, training: bool = False) -> int:
    """The memory one sample adds to a forward pass of ``model`` (bytes): for inference the largest layer's
    input and output with room for a residual branch, for training every layer's output (what autograd keeps).

    Measured with forward hooks on one sample; an input of more than 256x256 pixels is measured at 256x256 and
    scaled by area, so an absurd size is judged without allocating it.
    """
    import torch

    from anytime.backbones.base import example_input, takes_tokens

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
            model(example_input(tuple(int(v) for v in input_shape) if len(input_shape) == 1 else (channels, height, width),
                                1, tokens=text, device=device))
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


def check_input_memory(input_shape: Sequence[int], batch_size: int, *, what: str, hint: str) -> None:
    """Refuse an input tensor (float32) that alone cannot fit in memory: a first, allocation-free check."""
    values = batch_size
    for v in input_shape:
        values *= int(v)
    check_memory(4 * values, what, hint)
