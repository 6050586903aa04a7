"""One registry of model builders, one factory, and cost metadata."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError

TV_PREFIX = "tv:"
B = TypeVar("B", bound=Callable[..., nn.Module])


@dataclass(frozen=True)
class ModelSpec:
    """A registered zoo model."""

    name: str
    family: str
    description: str
    builder: Callable[..., nn.Module]
    modality: str = "image"  # "text" models take token ids and a vocabulary size


@dataclass(frozen=True)
class ModelCost:
    """Size and compute of a model. ``flops`` counts a multiply-add as 2 FLOPs (FlopCounterMode's convention)
    for one image at the size asked; ``None`` where counting failed (e.g. input too small for the model)."""

    name: str
    parameters: int
    flops: int | None


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(name: str, *, family: str, description: str, modality: str = "image") -> Callable[[B], B]:
    """Decorator that registers a keyword-only builder ``f(*, num_classes, in_channels) -> nn.Module`` (a text
    model's also takes ``vocab_size`` and ``max_length``)."""

    def decorate(builder: B) -> B:
        if name in _REGISTRY:
            raise ValueError(f"model '{name}' is registered twice")
        _REGISTRY[name] = ModelSpec(name=name, family=family, description=description, builder=builder,
                                    modality=modality)  # fmt: skip
        return builder

    return decorate


def _torchvision_names() -> list[str]:
    import torchvision.models

    return sorted(torchvision.models.list_models(module=torchvision.models))


def list_models(*, include_torchvision: bool = True) -> list[str]:
    """Zoo names in registration order, then ``tv:NAME`` for every torchvision classifier."""
    names = list(_REGISTRY)
    if include_torchvision:
        names += [TV_PREFIX + n for n in _torchvision_names()]
    return names


def _unknown(name: str, candidates: list[str]) -> AnytimeError:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return AnytimeError(f"unknown model '{name}'; {hint}run `anytime models` for the list")


def get_spec(name: str) -> ModelSpec:
    """The registry entry of a zoo model."""
    if name not in _REGISTRY:
        raise _unknown(name, list(_REGISTRY))
    return _REGISTRY[name]


def model_modality(name: str) -> str:
    """``"text"`` for a text encoder of the zoo, ``"image"`` for any other model (torchvision's included)."""
    spec = _REGISTRY.get(name)
    return "image" if spec is None else spec.modality


def create_model(
    name: str, *, num_classes: int = 10, in_channels: int = 3, vocab_size: int | None = None,
    max_length: int | None = None, hf_config: dict | None = None,
) -> nn.Module:  # fmt: skip
    """Build a zoo model (e.g. ``resnet20``) or a torchvision classifier (``tv:resnet18``) with random weights.

    A text model (``mobilebert_tiny``) takes ``vocab_size`` and ``max_length`` (its defaults where None); a
    ``transformers`` one (``hf_bert``, ``hf_mobilebert``) also ``hf_config``, a configuration to build instead of
    its small default (a checkpoint's, or the one a run recorded)."""
    text = {k: v for k, v in (("vocab_size", vocab_size), ("max_length", max_length), ("hf_config", hf_config))
            if v is not None}  # fmt: skip
    if text and model_modality(name) != "text":
        raise AnytimeError(f"{name} is an image model; a vocabulary and a maximum length are for text models")
    if hf_config is not None and get_spec(name).family != "transformers":
        raise AnytimeError(
            f"{name} is not a transformers model; a Hugging Face configuration is for hf_bert or hf_mobilebert"
        )
    if not isinstance(num_classes, int) or num_classes < 2:
        raise AnytimeError(f"num_classes must be at least 2 (got {num_classes}): a classifier needs 2 classes or more")
    if not isinstance(in_channels, int) or in_channels < 1:
        raise AnytimeError(f"in_channels must be at least 1 (got {in_channels}): use 1 for grey images, 3 for RGB")
    if name.startswith(TV_PREFIX):
        from anytime.backbones.torchvision_models import torchvision_model

        tv_name = name[len(TV_PREFIX) :]
        known = _torchvision_names()
        if tv_name not in known:
            raise _unknown(name, [TV_PREFIX + n for n in known])
        return torchvision_model(tv_name, num_classes=num_classes, in_channels=in_channels)
    if name not in _REGISTRY:
        raise _unknown(name, list_models())
    return _REGISTRY[name].builder(num_classes=num_classes, in_channels=in_channels, **text)


def _param_to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    return None if param is None else nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


def _buffer_to_meta(module: nn.Module, name: str, buffer: Tensor | None) -> Tensor | None:
    return None if buffer is None else buffer.to("meta")


def _build_on_meta(name: str, *, num_classes: int, in_channels: int) -> nn.Module:
    """Build a model whose parameters and buffers live on the meta device (no memory, no initialisation).

    The ``meta`` default device handles most builders; some compute their shapes with tensors (RegNet's
    widths need real values), so those are built with every parameter and buffer moved to meta as it is
    registered, before its initialisation runs. A builder that refuses both is built on the CPU.
    """
    from torch.nn.modules import module as module_hooks

    try:
        with torch.device("meta"):
            return create_model(name, num_classes=num_classes, in_channels=in_channels)
    except AnytimeError:
        raise
    except Exception:  # noqa: BLE001  any error from a third-party builder: try the next way
        pass
    handles = [
        module_hooks.register_module_parameter_registration_hook(_param_to_meta),
        module_hooks.register_module_buffer_registration_hook(_buffer_to_meta),
    ]
    try:
        return create_model(name, num_classes=num_classes, in_channels=in_channels)
    except Exception:  # noqa: BLE001
        pass
    finally:
        for handle in handles:
            handle.remove()
    return create_model(name, num_classes=num_classes, in_channels=in_channels)


def model_cost(
    name: str, *, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, count_flops: bool = True
) -> ModelCost:
    """Parameters and forward FLOPs of one ``image_size`` x ``image_size`` image (a text model: one sentence of
    its maximum length).

    The model is built on the meta device where possible, so even the largest torchvision models cost
    no memory and little time. FLOPs follow :class:`~torch.utils.flop_counter.FlopCounterMode`: a
    multiply-add counts as 2.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if name.startswith(TV_PREFIX):
        _torchvision_names()  # torchvision must be imported outside the meta device context
    if model_modality(name) == "text" and count_flops:  # its padding mask needs real values: built on the CPU
        model = create_model(name, num_classes=num_classes, in_channels=in_channels)
    else:
        model = _build_on_meta(name, num_classes=num_classes, in_channels=in_channels)
    parameters = sum(p.numel() for p in model.parameters())
    flops: int | None = None
    if count_flops:
        device = next(model.parameters()).device
        counter = FlopCounterMode(display=False)
        from anytime.backbones.base import example_input

        text = model_modality(name) == "text"
        shape = (int(model.max_length),) if text else (in_channels, image_size, image_size)
        try:
            with torch.no_grad(), counter:
                model.eval()(example_input(shape, 1, tokens=text, device=device))
            flops = int(counter.get_total_flops())
        except Exception:  # noqa: BLE001  any model may reject the size (ViT wants 224): FLOPs are then unknown
            flops = None
    return ModelCost(name=name, parameters=parameters, flops=flops)


def model_costs(names: list[str], *, count_flops: bool = False) -> list[ModelCost]:
    """:func:`model_cost` of many models at the default size (10 classes, 3 channels, 32x32).

    torchvision's costs never change for an installed version, and building its largest models
    takes seconds even on the meta device, so they are cached beside the data cache.
    """
    import json

    import torchvision

    from anytime.data.base import default_cache_dir
    from anytime.utils.io import write_json

    path = default_cache_dir() / f"model-costs-torch{torch.__version__}-tv{torchvision.__version__}.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    costs, changed = [], False
    for name in names:
        entry = cached.get(name) if name.startswith(TV_PREFIX) else None
        if entry is None or (count_flops and "flops" not in entry):
            cost = model_cost(name, count_flops=count_flops)
            if name.startswith(TV_PREFIX):
                cached[name] = {"parameters": cost.parameters, **({"flops": cost.flops} if count_flops else {})}
                changed = True
        else:
            cost = ModelCost(name=name, parameters=entry["parameters"], flops=entry.get("flops"))
        costs.append(cost)
    if changed:
        try:
            write_json(path, cached)
        except OSError:
            pass  # a read-only home only costs speed
    return costs
