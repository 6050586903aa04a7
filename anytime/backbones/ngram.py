"""A text network for small data sets: a TF-IDF bag of n-grams, fit in closed form, under a small encoder.

Trained from scratch on a few thousand sentences, a transformer loses to a linear model on TF-IDF n-grams (the
baseline every run reports). This network starts from that linear model: its stem computes, beside the token
embeddings, the logits of a multinomial logistic regression on the TF-IDF weights of the token unigrams and hashed
bigrams (fastText's bag of n-grams), fit on the training split by full-batch L-BFGS before training
(:meth:`NgramBag.init_from_text`) and then frozen. The first exit, right after the stem, answers those logits
alone, at a fraction of a layer's cost; every later exit adds a learned correction read from the encoder's states,
weighed after training by what it gains on validation (:meth:`NgramEncoder.fit_to_validation`), so that the
layers add what word order and context give where they give something, and cost nothing in accuracy where not.

Between stages the tensor is ``[B, T, H + C]``: the hidden states, then the bag's ``C`` logits repeated at every
real token (padded positions are all zero, as for :mod:`anytime.backbones.text`), so exits, block skipping and
split computing pass both along in one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.base import StagedBackbone
from anytime.backbones.registry import register_model
from anytime.backbones.text import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_VOCAB_SIZE,
    EncoderLayer,
    TokenEmbedding,
    init_bert_weights,
    token_mask,
)

BAG_ENTRIES = 4_000_000  # weights in the bag's table (rows x classes): 16 MB; the bigram buckets are sized to it
MAX_BUCKETS = 2_000_003
# The bag's regularisation, strongest first, as a linear SVM's C: a fit on N samples weighs its L2 by 1 / (C N) per
# sample, so that the strength follows the data's size (a fixed per-sample grid chose its strongest end on 5,000
# phrases, where the baseline's SVM chose C = 1).
C_GRID: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0)
HOLDOUT = 0.1  # of the training split, to choose the L2 weight on
LBFGS_STEPS = 100
MAX_FIT_SAMPLES = 100_000
BAG_DROPOUT = 0.5
_TF_CHUNK = 1 << 24  # gram pairs compared at once while fitting (bytes of a boolean matrix)
MIX_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # weights of an exit's correction, chosen on validation


def bucket_count(num_classes: int) -> int:
    """Hash buckets for the bigrams: as many as the table's budget allows (few collisions), a prime (the keys
    ``first * vocab + second`` are spread by the modulus)."""
    n = max(1009, min(MAX_BUCKETS, BAG_ENTRIES // max(2, num_classes)))
    while any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n -= 1
    return n


class NgramBag(nn.Module):
    """Logits of a linear model on the TF-IDF weights of the unigrams and hashed bigrams of token ids ``[B, T]``.

    Its table, IDF and bias are buffers (frozen): :meth:`init_from_text` fits them; unfitted, every logit is 0.
    """

    def __init__(self, vocab_size: int, num_classes: int, buckets: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.buckets = buckets
        rows = vocab_size + buckets
        self.register_buffer("idf", torch.ones(rows))
        self.register_buffer("table", torch.zeros(rows, num_classes))
        self.register_buffer("bias", torch.zeros(num_classes))
        self.register_buffer("l2", torch.zeros(()))  # the fit's regularisation, kept for the record

    def grams(self, ids: Tensor) -> Tensor:
        """Row indices ``[B, 2T - 1]`` of the unigrams then bigrams of ``ids``; 0 where there is none."""
        keep = ids.ne(0)
        pairs = (ids[:, :-1] * self.vocab_size + ids[:, 1:]) % self.buckets + self.vocab_size
        return torch.cat([ids, pairs * (keep[:, :-1] & keep[:, 1:])], dim=1)

    def weights(self, grams: Tensor, idf: Tensor) -> Tensor:
        """Each position's share ``[B, G]`` of its gram's TF-IDF weight (sublinear: ``(1 + ln tf) idf``, split
        over the gram's ``tf`` positions), the row's TF-IDF vector L2-normalised; 0 at no gram."""
        present = grams.ne(0)
        tf = (grams.unsqueeze(2) == grams.unsqueeze(1)).sum(dim=2).clamp(min=1).to(idf.dtype)
        w = (1 + tf.log()) * idf[grams] / tf * present
        norm = (w.square() * tf).sum(dim=1, keepdim=True).sqrt()
        return w / norm.clamp(min=1e-6)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``[B, C]``."""
        grams = self.grams(ids)
        return (self.table[grams] * self.weights(grams, self.idf).unsqueeze(-1)).sum(dim=1) + self.bias

    @torch.no_grad()
    def init_from_text(self, ids: Tensor, labels: Tensor) -> None:
        """Fit the IDF and the linear model on training token ids ``[N, T]`` and labels ``[N]``: the L2 weight is
        chosen from :data:`C_GRID` on a seeded :data:`HOLDOUT` of the samples, then the model is fit on them all."""
        from anytime.utils.lbfgs import minimise

        if len(ids) > MAX_FIT_SAMPLES:
            pick = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:MAX_FIT_SAMPLES]
            ids, labels = ids[pick], labels[pick]
        ids, labels = ids.to(self.table.device), labels.to(self.table.device)
        grams = self.grams(ids)
        self.idf.copy_(self._idf(grams))
        rows = max(1, _TF_CHUNK // grams.shape[1] ** 2)  # the term frequencies compare every gram pair of a row
        weights = torch.cat([self.weights(g, self.idf) for g in grams.split(rows)])
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1)).to(ids.device)
        held = order[: int(HOLDOUT * len(ids))] if len(ids) >= 20 else order[:0]
        fit = order[len(held) :]

        def solve(rows: Tensor, l2: float, start: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            table, bias = start[0].clone().requires_grad_(True), start[1].clone().requires_grad_(True)
            g, w, y = grams[rows], weights[rows], labels[rows]
            minimise([table, bias], lambda: F.cross_entropy((table[g] * w.unsqueeze(-1)).sum(1) + bias, y)
                     + 0.5 * l2 * table.square().sum(), steps=LBFGS_STEPS, tolerance=1e-5)  # fmt: skip
            return table.detach(), bias.detach()

        chosen, best = C_GRID[len(C_GRID) // 2], -1.0
        start = (torch.zeros_like(self.table), torch.zeros_like(self.bias))
        if len(held):
            for c in C_GRID:  # each fit starts from the previous (stronger) one
                start = solve(fit, 1.0 / (c * len(fit)), start)
                logits = (start[0][grams[held]] * weights[held].unsqueeze(-1)).sum(1) + start[1]
                accuracy = float((logits.argmax(1) == labels[held]).float().mean())
                if accuracy > best:
                    chosen, best = c, accuracy
        l2 = 1.0 / (chosen * len(ids))
        table, bias = solve(torch.arange(len(ids), device=ids.device), l2, start)
        self.table.copy_(table)
        self.bias.copy_(bias)
        self.l2.fill_(l2)

    def _idf(self, grams: Tensor) -> Tensor:
        """Smoothed inverse document frequency of every row (scikit-learn's: ``ln((1 + N) / (1 + df)) + 1``)."""
        rows = self.idf.numel()
        per_doc = grams + torch.arange(len(grams), device=grams.device).unsqueeze(1) * rows
        seen = torch.unique(per_doc[grams.ne(0)]) % rows
        df = torch.zeros(rows, device=grams.device).index_add_(0, seen, torch.ones(len(seen), device=grams.device))
        return torch.log((1 + len(grams)) / (1 + df)) + 1


class NgramEmbedding(nn.Module):
    """The stem: token embeddings ``[B, T, H]`` and the bag's logits at every real token, ``[B, T, H + C]``.

    In training, the bag's logits are hidden from a random ``bag_dropout`` of the samples: the bag was fit on the
    same sentences and answers nearly all of them right, so without this the exits' corrections would see no
    error to learn from; this way they learn to classify alone, and an exit answers as the two models together.
    """

    def __init__(self, embedding: TokenEmbedding, bag: NgramBag, bag_dropout: float = BAG_DROPOUT) -> None:
        super().__init__()
        self.embedding = embedding
        self.bag = bag
        self.bag_dropout = bag_dropout

    def forward(self, ids: Tensor) -> Tensor:
        """The stage tensor of token ids ``[B, T]``."""
        hidden = self.embedding(ids)
        logits = self.bag(ids)
        if self.training and self.bag_dropout > 0:
            logits = logits * (torch.rand(len(ids), 1, device=ids.device) >= self.bag_dropout)
        logits = logits.unsqueeze(1) * ids.ne(0).unsqueeze(-1)
        return torch.cat([hidden, logits.to(hidden.dtype)], dim=-1)


class Carry(nn.Module):
    """An encoder layer over the hidden part of the stage tensor; the bag's logits pass through unchanged."""

    def __init__(self, layer: nn.Module, hidden: int) -> None:
        super().__init__()
        self.layer = layer
        self.hidden = hidden

    def forward(self, x: Tensor) -> Tensor:
        """The next stage tensor ``[B, T, H + C]``."""
        return torch.cat([self.layer(x[..., : self.hidden]), x[..., self.hidden :]], dim=-1)


class BagHead(nn.Module):
    """An exit: the bag's logits plus a linear correction read from the mean of the real tokens' hidden states
    (the correction starts at zero, so an exit starts as the linear model)."""

    def __init__(self, hidden: int, num_classes: int, dropout: float = 0.1, *, correct: bool = True) -> None:
        super().__init__()
        self.hidden = hidden
        self.dropout = nn.Dropout(dropout)
        self.correction = nn.Linear(hidden, num_classes) if correct else None
        if self.correction is not None:
            nn.init.zeros_(self.correction.weight)
            nn.init.zeros_(self.correction.bias)
        self.register_buffer("mix", torch.ones(()))  # the correction's weight (see NgramEncoder.fit_to_validation)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, C]`` of a stage tensor ``[B, T, H + C]``."""
        if self.correction is None:
            return x[:, 0, self.hidden :]
        hidden = x[..., : self.hidden]
        keep = token_mask(hidden).unsqueeze(-1)
        pooled = hidden.sum(dim=1) / keep.sum(dim=1).clamp(min=1)
        return x[:, 0, self.hidden :] + self.mix * self.correction(self.dropout(pooled))


class NgramEncoder(StagedBackbone):
    """The bag of n-grams and the embeddings (the stem), a pass-through first stage (so the first exit reads the
    stem, at almost no cost), then one stage per encoder layer; every exit and the head are :class:`BagHead`."""

    modality = "text"

    def __init__(
        self, *, layers: int, hidden: int, embed: int, heads: int, inner: int, num_classes: int, vocab_size: int,
        max_length: int, dropout: float,
    ) -> None:  # fmt: skip
        super().__init__(num_classes=num_classes, in_channels=1)
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.hidden = hidden
        embedding = TokenEmbedding(vocab_size, max_length, embed, hidden, dropout)
        stem = NgramEmbedding(embedding, NgramBag(vocab_size, num_classes, bucket_count(num_classes)))
        stages: list[nn.Module] = [nn.Identity()]
        stages += [Carry(EncoderLayer(hidden, heads, inner, dropout), hidden) for _ in range(layers)]
        width = hidden + num_classes
        self._set_stages(stem, stages, BagHead(hidden, num_classes, dropout), [(width, 1)] * len(stages))
        for module in (embedding, *stages):
            module.apply(init_bert_weights)

    @torch.no_grad()
    def fit_to_validation(self, model: nn.Module, ids: Tensor, labels: Tensor, batch_size: int = 256) -> None:
        """After training: weigh each exit's correction (``model`` is this encoder with its exits) by the weight
        of :data:`MIX_GRID` that answers validation token ids ``ids`` best, if it beats the bag alone beyond chance
        (else 0: see :func:`_helpful_mix`). On a few thousand sentences an encoder from scratch can make the bag's
        answers worse; this keeps an exit from answering worse than the bag on data the fit never saw."""
        heads = [*getattr(model, "heads", []), self.head]
        was_training = model.training
        model.eval()
        for head in heads:
            head.mix.fill_(1.0)
        device = self.stem.bag.table.device
        outputs, bags = [], []
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size].to(device)
            outputs.append(model(chunk).float())
            bags.append(self.stem.bag(chunk).float())
        model.train(was_training)
        if not outputs:
            return
        steps, bag, truth = torch.cat(outputs, dim=-2), torch.cat(bags), labels.to(device)
        steps = steps.reshape(len(heads), len(ids), -1)
        for head, logits in zip(heads, steps):
            if head.correction is None:
                continue
            head.mix.fill_(_helpful_mix(bag, logits - bag, truth))

    def exit_head_at(self, name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """Every exit is a :class:`BagHead` (whatever head kind was asked: the bag's logits decide the design);
        the one right after the stem answers the bag's logits alone (the embeddings' mean adds nothing a bag of
        words does not already hold)."""
        del shape
        return BagHead(self.hidden, num_classes, correct=name != "stages.0")


@register_model("ngram_encoder", family="ngram", modality="text",
                description="TF-IDF n-gram linear model fit in closed form, under 4 encoder layers of width 128 (text)")  # fmt: skip
def ngram_encoder(
    *, num_classes: int, in_channels: int = 1, vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> NgramEncoder:  # fmt: skip
    """The small-data text network: a bag of n-grams (exit 0) under thin embeddings (64, projected to 128) and 4
    BERT-style layers (hidden 128, 2 heads, FFN 512), each followed by an exit that adds a learned correction to
    the bag's answer."""
    del in_channels
    return NgramEncoder(layers=4, hidden=128, embed=64, heads=2, inner=512, num_classes=num_classes, vocab_size=vocab_size,
                        max_length=max_length, dropout=0.1)  # fmt: skip


def _helpful_mix(bag: Tensor, correction: Tensor, truth: Tensor) -> float:
    """The weight of :data:`MIX_GRID` whose answers ``bag + weight * correction`` are right most often, kept only if
    it beats the bag alone beyond chance: the samples it turns right outnumber those it turns wrong by more than two
    standard deviations of that difference (McNemar's test at about 2.5%, one-sided). Else 0: on a few thousand
    sentences a correction that wins a few validation answers lost test accuracy."""
    alone = bag.argmax(1) == truth
    best, gain = 0.0, 0.0
    for weight in MIX_GRID[1:]:
        right = (bag + weight * correction).argmax(1) == truth
        fixed, broken = float((right & ~alone).sum()), float((alone & ~right).sum())
        if fixed - broken > max(gain, 2.0 * (fixed + broken) ** 0.5):
            best, gain = weight, fixed - broken
    return best
