"""Building the model a recipe names (plain or multi-exit) and the multi-exit training loss."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones import create_model, get_spec
from anytime.contract import step_count
from anytime.errors import AnytimeError
from anytime.train.config import TrainConfig


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    from anytime.train.checkpoint import payload_refusal, read_weights, torch_load_weights_only

    if path.is_dir():
        if (path / "model.safetensors").is_file():
            path = path / "model.safetensors"
        elif (path / "checkpoint.pt").is_file():
            path = path / "checkpoint.pt"
        else:
            raise AnytimeError(f"{path} holds no model.safetensors or checkpoint.pt; point --init at a trained run")
    if not path.is_file():
        raise AnytimeError(f"--init {path}: no such file; give a run directory, a checkpoint or a weights file")
    try:
        return read_weights(path)
    except AnytimeError as exc:
        if path.suffix == ".safetensors":
            raise AnytimeError(f"--init: {exc}") from None
    try:  # not an anytime checkpoint: a plain state dict (torch.save(model.state_dict()), torchvision's files)
        state = torch_load_weights_only(path)
    except pickle.UnpicklingError as exc:
        raise AnytimeError(f"--init: {payload_refusal(path, exc)}") from None
    except Exception:  # noqa: BLE001  any unreadable file gets the same answer
        raise AnytimeError(f"--init {path} is not a checkpoint or a state dict that loads weights-only") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise AnytimeError(f"--init {path} holds no state dict of tensors")
    return state


def load_backbone_weights(backbone: nn.Module, path: str | Path) -> None:
    """Load trained weights into ``backbone`` from a run directory, an anytime checkpoint, a ``.safetensors``
    file or a plain state dict (``torch.save(model.state_dict())``). A multi-exit run's backbone is taken
    out of its weights, so exits can be trained again on it."""
    state = _read_state_dict(Path(path))
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    try:
        result = backbone.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that do not fit
        detail = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), "shapes differ")
        raise AnytimeError(
            f"--init {path} does not hold weights of {type(backbone).__name__} ({detail}); check --model matches"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        parts = []
        if result.missing_keys:
            parts.append(f"{len(result.missing_keys)} missing (e.g. {result.missing_keys[0]})")
        if result.unexpected_keys:
            parts.append(f"{len(result.unexpected_keys)} unexpected (e.g. {result.unexpected_keys[0]})")
        raise AnytimeError(
            f"--init {path} does not hold weights of {type(backbone).__name__}: {', '.join(parts)}; "
            "check --model matches the checkpoint"
        )


def build_model(
    config: TrainConfig,
    *,
    num_classes: int,
    in_channels: int,
    image_size: tuple[int, int],
    load_init: bool = True,
    text: tuple[int, int] | None = None,
    hf_config: dict[str, Any] | None = None,
) -> nn.Module:
    """The model a recipe trains: the backbone (its weights from ``config.init`` if given and ``load_init``),
    with exits attached when ``config.exits`` is set, sliced when ``config.slices`` is, as a block-drop
    ladder when ``config.ladder`` is, as a resolution ladder when ``config.resolutions`` is, or as a SACT ResNet
    when ``config.sact`` is. ``text`` is a text dataset's ``(vocab_size, max_length)``: the model must be a text
    encoder, and takes exits only. A ``transformers`` model (``hf_bert``, ``hf_mobilebert``) is built from
    ``hf_config`` (the one its run recorded), else from a Hugging Face checkpoint directory given as ``config.init``,
    else from its small default."""
    from anytime.families import set_stochastic_depth

    backbone = _backbone(config, num_classes, in_channels, load_init, text, hf_config)
    if config.stochastic_depth > 0:
        set_stochastic_depth(backbone, config.stochastic_depth)
    input_shape = (in_channels, *image_size)
    family = _image_family(config, backbone, input_shape, image_size)
    if family is not None:
        return family
    if config.exits is None:
        return backbone
    return _with_exits(config, backbone, num_classes, (text[1],) if text is not None else input_shape)


def _backbone(
    config: TrainConfig, num_classes: int, in_channels: int, load_init: bool, text: tuple[int, int] | None,
    hf_config: dict[str, Any] | None,
) -> nn.Module:  # fmt: skip
    """The recipe's backbone for its data's modality, with its initial weights loaded when ``load_init``."""
    from anytime.backbones import model_modality

    modality = model_modality(config.model)
    if (text is not None) != (modality == "text"):
        held, wanted = ("text", "a text model (mobilebert_tiny, bert_mini)") if text else ("images", "an image model")
        raise AnytimeError(f"{config.model} is {'a text' if modality == 'text' else 'an image'} model, and "
                           f"{config.data} holds {held}; choose {wanted}")  # fmt: skip
    if text is not None:
        if config.ladder or config.resolutions or config.sact or config.slices:
            raise AnytimeError("text encoders take early exits (--exits) only; slices, ladders, resolutions and SACT "
                               "are for image networks")  # fmt: skip
        from anytime.backbones.hf import is_checkpoint_dir, read_checkpoint_config

        hf_checkpoint = config.init is not None and get_spec(config.model).family == "transformers" and (
            is_checkpoint_dir(config.init))  # fmt: skip
        if hf_config is None and hf_checkpoint:
            hf_config = read_checkpoint_config(config.init)  # type: ignore[arg-type]
        backbone = create_model(config.model, num_classes=num_classes, vocab_size=text[0], max_length=text[1],
                                hf_config=hf_config)  # fmt: skip
    else:
        hf_checkpoint = False
        backbone = create_model(config.model, num_classes=num_classes, in_channels=in_channels)
    if config.init is not None and load_init:
        if hf_checkpoint:
            from anytime.backbones.hf import load_checkpoint_weights

            load_checkpoint_weights(backbone, config.init)  # type: ignore[arg-type]
        else:
            load_backbone_weights(backbone, config.init)
    return backbone


def _image_family(
    config: TrainConfig, backbone: nn.Module, input_shape: tuple[int, ...], image_size: tuple[int, int]
) -> nn.Module | None:
    """The block-drop ladder, resolution ladder, SACT network or slices the recipe asks for (None: none of them)."""
    from anytime.families import BlockDropLadder, slice_model

    if config.ladder is not None:
        return BlockDropLadder(backbone, input_shape=input_shape)
    if config.resolutions is not None:
        from anytime.families.resolution import ResolutionLadder, parse_resolutions

        ladder = ResolutionLadder(backbone, parse_resolutions(config.resolutions, image_size), input_shape=input_shape)
        if config.exit_weights is not None and len(config.exit_weights) != ladder.num_steps:
            raise AnytimeError(
                f"{len(config.exit_weights)} loss weights given for {ladder.num_steps} resolutions; give one per resolution"
            )
        return ladder
    if config.sact is not None:
        from anytime.families.sact import SACTResNet, parse_thresholds

        return SACTResNet(backbone, parse_thresholds(config.sact), input_shape=input_shape,
                          ponder_cost=config.ponder_cost, mode=config.sact_mode)  # fmt: skip
    if config.slices is not None:
        sliced = slice_model(backbone, config.slices, kind=config.slice_kind, sandwich=config.sandwich,
                             input_shape=input_shape)  # fmt: skip
        if config.exit_weights is not None and len(config.exit_weights) != sliced.num_steps:
            raise AnytimeError(
                f"{len(config.exit_weights)} loss weights given for {sliced.num_steps} slices; give one per slice"
            )
        return sliced
    return None


def _with_exits(config: TrainConfig, backbone: nn.Module, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``backbone`` with the recipe's exits attached (its trunk frozen for heads-only training)."""
    from anytime.families import attach_exits

    assert config.exits is not None
    model = attach_exits(backbone, config.exits, head=config.exit_head, num_classes=num_classes,
                         input_shape=input_shape)  # fmt: skip
    if config.exit_weights is not None and len(config.exit_weights) != model.num_steps:
        raise AnytimeError(
            f"{len(config.exit_weights)} exit weights given for {model.num_steps} exits "
            f"({', '.join(e.name for e in model.exit_info)}); give one per exit"
        )
    if config.exit_mode == "heads-only":
        model.freeze_backbone()
    model.gradient_equilibrium = config.gradient_equilibrium
    return model


def exit_weights(config: TrainConfig, model: nn.Module) -> Tensor:
    """The loss weight of every exit: the recipe's, or SDN's default, each exit weighted by the share of the
    backbone's FLOPs it has run (the last exit weighs 1), so that cheap early exits do not pull the shared
    layers away from the final classifier. A plain model has one weight, 1; the steps of other families
    (slices, ladders) weigh 1 each, as slimmable networks train them."""
    from anytime.families import MultiExitModel

    if config.exit_weights is not None:
        return torch.tensor(config.exit_weights, dtype=torch.float32)
    if not isinstance(model, MultiExitModel):
        return torch.ones(step_count(model))
    info = model.exit_info
    total = float(model.backbone_flops)  # type: ignore[union-attr]
    return torch.tensor([min(1.0, e.flops / total) for e in info[:-1]] + [1.0], dtype=torch.float32)


def multi_exit_loss(
    logits: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    distill: float = 0.0,
    temperature: float = 3.0,
    label_smoothing: float = 0.0,
    teacher: str = "last",
) -> Tensor:
    """``sum_k w_k CE(logits_k, y)`` over exits (``logits`` is ``[K, B, C]``; cross-entropy with
    ``label_smoothing``), plus ``distill`` times the self-distillation loss: each earlier exit matches a
    softened teacher (KL divergence at ``temperature``, scaled by its square as in Hinton et al.). ``teacher``
    ``last``: the last exit's output (BYOT); ``later``: for exit k, the mean of the softened outputs of exits
    k+1..K-1, an ensemble of every exit after it (for the next to last, the last exit alone)."""
    num_steps, batch, classes = logits.shape
    per_exit = F.cross_entropy(logits.reshape(-1, classes), labels.repeat(num_steps), reduction="none",
                               label_smoothing=label_smoothing)  # fmt: skip
    loss = (per_exit.view(num_steps, batch).mean(dim=1) * weights.to(logits.device)).sum()
    if distill > 0 and num_steps > 1:
        soft = F.softmax(logits.detach() / temperature, dim=2)
        if teacher == "later":  # mean over k+1..K-1 for each k: suffix sums over the exits, divided by their count
            suffix = soft.flip(0).cumsum(0).flip(0)[1:]
            counts = torch.arange(num_steps - 1, 0, -1, device=logits.device, dtype=soft.dtype)
            targets = suffix / counts[:, None, None]
        else:
            targets = soft[-1].expand(num_steps - 1, batch, classes)
        students = F.log_softmax(logits[:-1] / temperature, dim=2)
        kl = F.kl_div(students, targets, reduction="none").sum(dim=2).mean(dim=1)
        loss = loss + distill * temperature**2 * kl.sum()
    return loss
