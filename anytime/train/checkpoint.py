"""Checkpoints that are written atomically and loaded without running code from the file."""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytime.errors import AnytimeError
from anytime.utils.io import atomic_path

CHECKPOINT_FORMAT = "anytime-checkpoint-v1"


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Save ``state`` (tensors, numbers, strings, lists, dicts only) atomically with a format tag."""
    with atomic_path(path) as tmp:
        torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    return Path(path)


def torch_load_weights_only(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, without the unpickler's warnings about the file's pickle
    protocol: such a file is answered in one line (refused, or loaded) by the caller, never by a warning first."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._weights_only_unpickler")
        return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: a file that would need to run code is refused."""
    target = Path(path)
    if not target.is_file():
        raise AnytimeError(f"no checkpoint at {target}; train first, or point at a run's checkpoint.pt")
    try:
        state = torch_load_weights_only(target)
    except pickle.UnpicklingError as exc:
        raise AnytimeError(payload_refusal(target, exc)) from None
    except Exception as exc:  # noqa: BLE001  a corrupt file can fail anywhere inside the unpickler
        raise AnytimeError(f"{target} is not a readable checkpoint ({type(exc).__name__}); is it truncated?") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise AnytimeError(f"{target} is a torch file but not an anytime checkpoint (no '{CHECKPOINT_FORMAT}' tag)")
    return state


def payload_refusal(path: Path, exc: BaseException) -> str:
    """The refusal of a torch file that holds more than tensors. PyTorch's own message suggests
    ``weights_only=False``; for a file from an unknown source that is exactly what must not be done."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = f" (it calls {found.group(1)})" if found else ""
    return (
        f"{path} holds code, not only weights{what}, so it was not loaded; do not load it with "
        "weights_only=False unless you trust its source: that would run the code"
    )


def save_weights(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Export the model's weights as safetensors (no pickle at all), atomically."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return Path(path)


def read_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The state dict in a ``.safetensors`` file or an anytime checkpoint."""
    target = Path(path)
    if target.suffix != ".safetensors":
        return load_checkpoint(target)["model"]
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not target.is_file():
        raise AnytimeError(f"no weights file at {target}")
    try:
        return load_file(str(target))
    except (SafetensorError, OSError) as exc:
        raise AnytimeError(f"{target} is not a valid safetensors file ({exc})") from None


def load_weights(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Load weights from a ``.safetensors`` file or an anytime checkpoint into ``model``."""
    target = Path(path)
    weights = read_weights(target)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise AnytimeError(f"weights in {target} do not fit this model ({first})") from None
    return model
