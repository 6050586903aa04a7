"""Transformer encoders for text classification, with the stage contract: embeddings -> layers -> pooled head.

The input is int64 token ids ``[B, T]`` padded with 0 (:mod:`anytime.data.text`). Between stages the tensor is the
hidden states ``[B, T, H]`` with every padded position exactly zero: each layer recovers the padding mask from its
input and zeroes those positions again in its output. One tensor therefore carries both, so exits, block
skipping and split computing pass it along like an image's feature map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone
from anytime.backbones.registry import register_model

DEFAULT_VOCAB_SIZE = 8000
DEFAULT_MAX_LENGTH = 64
_PAD = 0


def token_mask(hidden: Tensor) -> Tensor:
    """Bool ``[B, T]``: True at real tokens (padded positions are all-zero vectors)."""
    return hidden.ne(0).any(dim=-1)


class TokenEmbedding(nn.Module):
    """Word and position embeddings, projected to the hidden width (MobileBERT's thin embedding when narrower),
    normalised; padded positions are zero."""

    def __init__(self, vocab_size: int, max_length: int, embed: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.max_length = max_length
        self.words = nn.Embedding(vocab_size, embed, padding_idx=_PAD)
        self.positions = nn.Embedding(max_length, embed)
        self.project = nn.Linear(embed, hidden) if embed != hidden else nn.Identity()
        self.norm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        """Hidden states ``[B, T, H]`` of token ids ``[B, T]`` (``T`` at most the maximum length)."""
        if ids.dtype != torch.int64 or ids.dim() != 2:
            raise ValueError(f"a text encoder takes int64 token ids [B, T], got {ids.dtype} {tuple(ids.shape)}")
        if ids.shape[1] > self.max_length:
            raise ValueError(f"{ids.shape[1]} tokens given; this encoder reads at most {self.max_length}")
        keep = ids.ne(_PAD).unsqueeze(-1)
        x = self.words(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.dropout(self.norm(self.project(x))) * keep


class SelfAttention(nn.Module):
    """Multi-head self-attention that ignores padded keys."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        """Attention output ``[B, T, W]``; ``keep`` is the real-token mask ``[B, T]``."""
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        # Batch 1 and full batches have no padding: no mask lets SDPA take its fastest kernel.
        mask = None if bool(keep.all()) else keep[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, w))


class FeedForward(nn.Sequential):
    """Linear, GELU, linear."""

    def __init__(self, width: int, inner: int, dropout: float) -> None:
        super().__init__(nn.Linear(width, inner), nn.GELU(), nn.Linear(inner, width), nn.Dropout(dropout))


class EncoderLayer(nn.Module):
    """A BERT layer (post-norm): attention and a feed-forward network, each residual."""

    def __init__(self, hidden: int, heads: int, inner: int, dropout: float) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, heads, dropout)
        self.attention_dropout = nn.Dropout(dropout)
        self.attention_norm = nn.LayerNorm(hidden)
        self.ffn = FeedForward(hidden, inner, dropout)
        self.ffn_norm = nn.LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Hidden states in, hidden states out, padded positions zero."""
        keep = token_mask(x)
        x = self.attention_norm(x + self.attention_dropout(self.attention(x, keep)))
        x = self.ffn_norm(x + self.ffn(x))
        return x * keep.unsqueeze(-1)


class BottleneckLayer(nn.Module):
    """A MobileBERT layer: the wide inter-block state is squeezed to a bottleneck, where attention and a stack of
    feed-forward networks run, then expanded back and added to it (Sun et al. 2020). Layer norm is kept where
    MobileBERT uses its NoNorm, which needs its teacher distillation to train stably."""

    def __init__(self, hidden: int, bottleneck: int, heads: int, inner: int, stacked: int, dropout: float) -> None:
        super().__init__()
        self.inward = nn.Linear(hidden, bottleneck)
        self.inward_norm = nn.LayerNorm(bottleneck)
        self.attention = SelfAttention(bottleneck, heads, dropout)
        self.attention_norm = nn.LayerNorm(bottleneck)
        self.ffns = nn.ModuleList(FeedForward(bottleneck, inner, dropout) for _ in range(stacked))
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(bottleneck) for _ in range(stacked))
        self.outward = nn.Linear(bottleneck, hidden)
        self.dropout = nn.Dropout(dropout)
        self.output_norm = nn.LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Hidden states in, hidden states out, padded positions zero."""
        keep = token_mask(x)
        h = self.inward_norm(self.inward(x))
        h = self.attention_norm(h + self.attention(h, keep))
        for ffn, norm in zip(self.ffns, self.ffn_norms):
            h = norm(h + ffn(h))
        x = self.output_norm(x + self.dropout(self.outward(h)))
        return x * keep.unsqueeze(-1)


class PoolerHead(nn.Module):
    """The classifier: the mean of the real tokens' states (a network trained from scratch generalised better from
    it than from BERT's ``[CLS]`` position here) through a tanh layer, then a linear layer."""

    def __init__(self, hidden: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.pool = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, C]`` of hidden states ``[B, T, H]``."""
        keep = token_mask(x).unsqueeze(-1)
        pooled = x.sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        return self.classifier(self.dropout(torch.tanh(self.pool(pooled))))


class TextEncoder(StagedBackbone):
    """Embeddings (the stem), one stage per layer, and a pooled head: exits can follow any layer."""

    modality = "text"

    def __init__(
        self, layers: list[nn.Module], *, hidden: int, embed: int, num_classes: int, vocab_size: int, max_length: int,
        dropout: float,
    ) -> None:  # fmt: skip
        super().__init__(num_classes=num_classes, in_channels=1)
        self.vocab_size = vocab_size
        self.max_length = max_length
        self._set_stages(
            TokenEmbedding(vocab_size, max_length, embed, hidden, dropout), layers,
            PoolerHead(hidden, num_classes, dropout), [(hidden, 1)] * len(layers),
        )  # fmt: skip
        self.apply(init_bert_weights)


def init_bert_weights(module: nn.Module) -> None:
    """BERT's initialisation of one module (for ``Module.apply``): N(0, 0.02) weights, zero biases, the padding
    embedding zero."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


@register_model("bert_mini", family="bert", modality="text",
                description="BERT-Mini shape: 4 layers, hidden 256, 4 heads, FFN 1024 (text)")  # fmt: skip
def bert_mini(
    *, num_classes: int, in_channels: int = 1, vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> TextEncoder:  # fmt: skip
    """A BERT-style encoder the size of Google's BERT-Mini (L=4, H=256), with random weights."""
    del in_channels
    layers: list[nn.Module] = [EncoderLayer(256, 4, 1024, 0.1) for _ in range(4)]
    return TextEncoder(layers, hidden=256, embed=256, num_classes=num_classes, vocab_size=vocab_size,
                       max_length=max_length, dropout=0.1)  # fmt: skip


@register_model("mobilebert_tiny", family="mobilebert", modality="text",
                description="MobileBERT shape, 6 bottleneck layers: hidden 256, bottleneck 64, 2 FFNs each (text)")  # fmt: skip
def mobilebert_tiny(
    *, num_classes: int, in_channels: int = 1, vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> TextEncoder:  # fmt: skip
    """A MobileBERT-shaped encoder a CPU trains in minutes: thin embeddings (64, projected to 256), 6 layers with a
    64-wide bottleneck holding 4-head attention and 2 stacked feed-forward networks (64 -> 256 -> 64)."""
    del in_channels
    layers: list[nn.Module] = [BottleneckLayer(256, 64, 4, 256, 2, 0.1) for _ in range(6)]
    return TextEncoder(layers, hidden=256, embed=64, num_classes=num_classes, vocab_size=vocab_size,
                       max_length=max_length, dropout=0.1)  # fmt: skip
