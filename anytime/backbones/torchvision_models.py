"""torchvision classifiers by name, with random weights (nothing is ever downloaded)."""

from __future__ import annotations

from torch import nn


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    # torchvision registers modules in forward order, so the first Conv2d in pre-order reads the input
    name, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    parent_name, _, child_name = name.rpartition(".")
    replacement = nn.Conv2d(
        in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
        dilation=conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
        device=conv.weight.device, dtype=conv.weight.dtype,
    )  # fmt: skip
    setattr(model.get_submodule(parent_name), child_name, replacement)


def torchvision_model(name: str, *, num_classes: int, in_channels: int) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, num_classes=...)``, its first conv adapted to
    ``in_channels`` when that is not 3.

    GoogLeNet and Inception-v3 are built without auxiliary classifiers, so that every model returns
    plain logits in training mode too.
    """
    import torchvision.models

    kwargs: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if name in ("inception_v3", "googlenet"):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = False
    model = torchvision.models.get_model(name, **kwargs)
    if in_channels != 3:
        _replace_first_conv(model, in_channels)
    return model
