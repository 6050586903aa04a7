"""Hugging Face ``transformers`` encoders with the stage contract: a ``BertForSequenceClassification`` or
``MobileBertForSequenceClassification`` built from a config (random weights, offline), or from a local checkpoint
directory (``anytime train --init DIR``), cut into embeddings -> one stage per layer -> pooler and classifier.

Inside, the stages speak the zoo's text convention (:mod:`anytime.backbones.text`): hidden states ``[B, T, H]``
whose padded positions are exactly zero, the padding mask recovered from them in every layer, so exits, profiles
and the runtime treat these encoders like the zoo's. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone
from anytime.backbones.registry import register_model
from anytime.backbones.text import DEFAULT_MAX_LENGTH, DEFAULT_VOCAB_SIZE, token_mask
from anytime.errors import AnytimeError

_PAD = 0
#: The small configurations the zoo names build (a CPU trains them in minutes); ``--init DIR`` takes DIR's own.
SMALL_CONFIGS: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
    "mobilebert": {"hidden_size": 256, "embedding_size": 64, "true_hidden_size": 64, "intra_bottleneck_size": 64,
                   "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 256,
                   "num_feedforward_networks": 2},
}  # fmt: skip
HF_CONFIG_FILE = "config.json"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise AnytimeError("Hugging Face encoders need the transformers library: pip install 'anytime[hf]'") from None
    return transformers


class _Embeddings(nn.Module):
    """The checkpoint's embeddings; padded positions zeroed (the stages read the padding mask from the zeros)."""

    def __init__(self, embeddings: nn.Module, max_length: int) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.max_length = max_length

    def forward(self, ids: Tensor) -> Tensor:
        """Hidden states ``[B, T, H]`` of token ids ``[B, T]``."""
        if ids.dtype != torch.int64 or ids.dim() != 2:
            raise ValueError(f"a text encoder takes int64 token ids [B, T], got {ids.dtype} {tuple(ids.shape)}")
        if ids.shape[1] > self.max_length:
            raise ValueError(f"{ids.shape[1]} tokens given; this encoder reads at most {self.max_length}")
        return self.embeddings(input_ids=ids) * ids.ne(_PAD).unsqueeze(-1)


class _Layer(nn.Module):
    """One of the checkpoint's encoder layers, masking padded keys (additive mask, which eager attention and
    SDPA both take) and keeping padded positions zero."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        """Hidden states in, hidden states out, padded positions zero."""
        keep = token_mask(x)
        mask = None
        if not bool(keep.all()):  # no padding (batch 1): no mask, the fastest attention kernel
            mask = (~keep)[:, None, None, :].to(x.dtype) * torch.finfo(x.dtype).min
        out = self.layer(x, attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out  # transformers 4 returned a tuple
        return out * keep.unsqueeze(-1)


class _Head(nn.Module):
    """The checkpoint's pooler (first token, through its dense layer and tanh) and classifier."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler
        self.dropout = dropout
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, C]`` of hidden states ``[B, T, H]``."""
        return self.classifier(self.dropout(self.pooler(x)))


class HFEncoder(StagedBackbone):
    """A ``transformers`` sequence classifier as a staged backbone: exits can follow any layer. ``hf_config`` is
    the model's configuration as a dict (a run keeps it, so it rebuilds without the checkpoint directory)."""

    modality = "text"

    def __init__(self, model: nn.Module, *, max_length: int) -> None:
        super().__init__(num_classes=int(model.config.num_labels), in_channels=1)
        base = getattr(model, model.base_model_prefix)
        if getattr(base, "pooler", None) is None:
            raise AnytimeError("the checkpoint's model has no pooler; build it with add_pooling_layer=True")
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_length = max_length
        self.hf_config = config.to_dict()
        self.__dict__["_hf_model"] = model  # the same modules as the stages, kept unregistered: loading a
        # checkpoint's state dict goes through it, and the run's weights hold each tensor once
        if max_length > int(config.max_position_embeddings):
            raise AnytimeError(f"--max-length {max_length} is more than the {config.model_type} model's "
                               f"{config.max_position_embeddings} positions")  # fmt: skip
        layers: list[nn.Module] = [_Layer(layer) for layer in base.encoder.layer]
        self._set_stages(_Embeddings(base.embeddings, max_length), layers,
                         _Head(base.pooler, model.dropout, model.classifier),
                         [(int(config.hidden_size), 1)] * len(layers))  # fmt: skip


def _classifier(kind: str, config: dict[str, Any]) -> nn.Module:
    from anytime.utils.quiet import quiet_torchao

    lib = _transformers()
    config_class = {"bert": lib.BertConfig, "mobilebert": lib.MobileBertConfig}[kind]
    hf_config = config_class(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
    hf_config._attn_implementation = "sdpa"
    with quiet_torchao():  # transformers' model classes import torchao where it is installed
        model_class = {"bert": lib.BertForSequenceClassification,
                       "mobilebert": lib.MobileBertForSequenceClassification}[kind]  # fmt: skip
        return model_class(hf_config)


def hf_encoder(
    kind: str, *, num_classes: int, vocab_size: int, max_length: int, config: dict[str, Any] | None = None,
) -> HFEncoder:  # fmt: skip
    """A ``kind`` (``bert`` or ``mobilebert``) sequence classifier with random weights, from ``config`` (a recorded
    or a checkpoint's configuration) or the zoo's small one, for ``num_classes`` labels and ``vocab_size`` tokens."""
    base = (
        dict(config) if config is not None else {**SMALL_CONFIGS[kind], "max_position_embeddings": max(512, max_length)}
    )
    if config is not None and base.get("model_type", kind) != kind:
        raise AnytimeError(f"the configuration is of a {base.get('model_type')} model; this is hf_{kind}")
    if config is not None and int(base.get("vocab_size", vocab_size)) != vocab_size:
        raise AnytimeError(f"the {kind} checkpoint has {base.get('vocab_size')} tokens and the run's tokenizer "
                           f"{vocab_size}: train with the checkpoint's own tokenizer (--tokenizer DIR/tokenizer.json)")  # fmt: skip
    base.update(vocab_size=vocab_size, num_labels=num_classes, pad_token_id=_PAD)
    for key in ("id2label", "label2id"):  # a checkpoint's labels are not the run's
        base.pop(key, None)
    return HFEncoder(_classifier(kind, base), max_length=max_length)


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory (``config.json`` naming a ``model_type``), as opposed
    to an anytime run folder or a weights file."""
    config = Path(path).expanduser() / HF_CONFIG_FILE
    try:
        return config.is_file() and "model_type" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def read_checkpoint_config(folder: str | Path) -> dict[str, Any]:
    """A local Hugging Face checkpoint directory's configuration (``config.json``), or a one-line error."""
    path = Path(folder).expanduser() / HF_CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AnytimeError(f"{folder} is not a Hugging Face checkpoint directory (no {HF_CONFIG_FILE})") from None
    except (OSError, ValueError) as exc:
        raise AnytimeError(f"cannot read {path} ({exc}); save the checkpoint again with save_pretrained") from None
    if not isinstance(config, dict) or config.get("model_type") not in SMALL_CONFIGS:
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise AnytimeError(f"{path} describes a {kind} model; anytime takes bert and mobilebert checkpoints")
    return config


def load_checkpoint_weights(encoder: HFEncoder, folder: str | Path) -> None:
    """The weights of a local checkpoint directory (``model.safetensors``) into ``encoder``, except the
    classifier when its label count differs (a new task's head starts fresh)."""
    from safetensors.torch import load_file

    path = Path(folder).expanduser() / "model.safetensors"
    if not path.is_file():
        raise AnytimeError(f"{folder} has no model.safetensors; save the checkpoint with save_pretrained "
                           "(safe_serialization, the default): anytime never unpickles a checkpoint")  # fmt: skip
    try:
        state = load_file(str(path))
    except Exception as exc:  # noqa: BLE001  safetensors raises its own error types
        raise AnytimeError(
            f"{path} could not be read ({str(exc).splitlines()[0]}); save the checkpoint again"
        ) from None
    model: nn.Module = encoder.__dict__["_hf_model"]
    prefix = model.base_model_prefix
    if not any(k.startswith(prefix + ".") for k in state):  # a base model's checkpoint (BertModel.save_pretrained)
        state = {f"{prefix}.{k}": v for k, v in state.items()}
    own = model.state_dict()
    wanted = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped = [k for k in own if k not in wanted and not k.startswith("classifier.")]
    if skipped:
        raise AnytimeError(f"{path} does not hold the model's weights: {len(skipped)} missing or of another shape "
                           f"(e.g. {skipped[0]}); --model must match the checkpoint's model_type")  # fmt: skip
    model.load_state_dict(wanted, strict=False)


@register_model("hf_bert", family="transformers", modality="text",
                description="transformers BertForSequenceClassification from a config: 4 layers, hidden 256 (text)")  # fmt: skip
def hf_bert(
    *, num_classes: int, in_channels: int = 1, vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH, hf_config: dict[str, Any] | None = None,
) -> HFEncoder:  # fmt: skip
    """``transformers``' BERT at BERT-Mini's size (or ``hf_config``), random weights, exits after any layer."""
    del in_channels
    return hf_encoder("bert", num_classes=num_classes, vocab_size=vocab_size, max_length=max_length, config=hf_config)


@register_model("hf_mobilebert", family="transformers", modality="text",
                description="transformers MobileBertForSequenceClassification from a config: 6 layers (text)")  # fmt: skip
def hf_mobilebert(
    *, num_classes: int, in_channels: int = 1, vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH, hf_config: dict[str, Any] | None = None,
) -> HFEncoder:  # fmt: skip
    """``transformers``' MobileBERT, 6 bottleneck layers of hidden 256 (or ``hf_config``), random weights."""
    del in_channels
    return hf_encoder("mobilebert", num_classes=num_classes, vocab_size=vocab_size, max_length=max_length,
                      config=hf_config)  # fmt: skip
