"""Learned exit gates: per early exit, a small model that predicts from what is known there whether leaving now
loses nothing (BranchyNet's "meta-recognition", whether the exit's answer is right, left by its authors as future
work; :func:`leave_labels` says why the label is a little wider).

What a gate sees at exit k (:data:`GATE_FEATURES`), all from exits 0..k, so it can run as the network runs: the
exit's softmax statistics (confidence, margin, normalised entropy, the log-sum-exp of its logits), how many
exits in a row before it gave the same class, the probability the previous exit gave to this exit's class, and
the change in confidence since the previous exit. The exit's position and cost are the same for every sample
at an exit, so a gate per exit carries them in its bias.

A gate is a logistic regression on standardised features: deterministic, fit in milliseconds, and a dot
product of seven numbers at run time, which an exported graph can carry. Gates are fit on the validation split's cached outputs. Their thresholds are
calibrated on the same split, so the scores the thresholds see are *cross-fitted* (:func:`cross_fit_scores`):
every validation sample is scored by gates fit on the other folds, never by gates that saw it. The test split is
only reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError
from anytime.utils.lbfgs import minimise

if TYPE_CHECKING:
    from torch import Tensor

GATE_FEATURES: tuple[str, ...] = (
    "confidence", "margin", "normalized-entropy", "logsumexp", "streak", "previous-probability", "confidence-change",
)  # fmt: skip
GATE_L2 = 1e-3  # on standardised features: a light touch, the gates have 8 parameters each
GATE_FOLDS = 5
_LBFGS_STEPS = 100


@dataclass(frozen=True)
class GateState:
    """What a gate at the next exit needs to know of the exits before it, per sample still in: the previous exit's
    probabilities ``[N, C]``, its predicted class and confidence ``[N]``, and the agreement streak ``[N]``."""

    probs: Tensor
    predicted: Tensor
    confidence: Tensor
    streak: Tensor

    def keep(self, stay: Tensor) -> GateState:
        """The state of the samples ``stay`` (a mask or an index) only."""
        return GateState(self.probs[stay], self.predicted[stay], self.confidence[stay], self.streak[stay])


def exit_features(logits: Tensor, before: GateState | None) -> tuple[Tensor, GateState]:
    """One exit's gate features, float64 ``[N, F]``, from its logits ``[N, C]`` and the state left by the exits
    before it (None at the first exit), with the state it leaves for the next: what the network computes as it
    runs, and what :func:`gate_features` computes over a cache, exit by exit, so the two agree sample for sample."""
    import torch
    import torch.nn.functional as F

    z = logits.double()
    probs = F.softmax(z, dim=-1)
    top = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    confidence = top[:, 0]
    margin = confidence - top[:, 1] if top.shape[-1] > 1 else confidence
    entropy = torch.special.entr(probs).sum(-1) / math.log(max(2, probs.shape[-1]))
    predicted = probs.argmax(-1)
    if before is None:
        streak = previous = change = torch.zeros_like(confidence)
    else:
        streak = torch.where(predicted == before.predicted, before.streak + 1, 0.0)
        previous = before.probs.gather(-1, predicted.unsqueeze(-1)).squeeze(-1)
        change = confidence - before.confidence
    features = torch.stack([confidence, margin, entropy, torch.logsumexp(z, dim=-1), streak, previous, change], -1)
    # A NaN or infinite logit makes every feature of that sample NaN: its gate then never lets it leave.
    features = features.masked_fill(~torch.isfinite(z).all(-1, keepdim=True), math.nan)
    return features, GateState(probs, predicted, confidence, streak)


@dataclass(frozen=True)
class RowState:
    """:class:`GateState` of one sample in Python floats (the batch-1 path)."""

    probs: tuple[float, ...]
    predicted: int
    confidence: float
    streak: float


def row_features(row: Sequence[float], before: RowState | None) -> tuple[list[float] | None, RowState]:
    """:func:`exit_features` of one sample's logits given as Python floats, in Python's float64 arithmetic: a
    dozen PyTorch operators on a 10-value tensor cost more than a small network's stage at batch 1. None for a
    row with a NaN or infinite logit (its gate never lets it leave)."""
    if not all(math.isfinite(v) for v in row):
        return None, RowState((0.0,) * len(row), 0, 0.0, 0.0)
    top = max(row)
    e = [math.exp(v - top) for v in row]
    total = math.fsum(e)
    probs = tuple(v / total for v in e)
    predicted = row.index(top)
    confidence = probs[predicted]
    second = max((p for i, p in enumerate(probs) if i != predicted), default=confidence)
    margin = confidence - second if len(probs) > 1 else confidence
    entropy = -math.fsum(p * math.log(p) for p in probs if p > 0.0) / math.log(max(2, len(probs)))
    if before is None:
        streak = previous = change = 0.0
    else:
        streak = before.streak + 1 if predicted == before.predicted else 0.0
        previous, change = before.probs[predicted], confidence - before.confidence
    features = [confidence, margin, entropy, top + math.log(total), streak, previous, change]
    return features, RowState(probs, predicted, confidence, streak)


def gate_features(logits: Tensor) -> Tensor:
    """The gate features of exits' logits ``[K, N, C]`` (exits first), float64 ``[K, N, F]``: feature f of
    sample n at exit k uses exits 0..k only."""
    import torch

    if logits.dim() != 3:
        raise AnytimeError("gates compare exits with each other: give the logits of every exit, [K, N, C]")
    rows, state = [], None
    for exit_logits in logits:
        features, state = exit_features(exit_logits, state)
        rows.append(features)
    return torch.stack(rows)


@dataclass(frozen=True)
class ExitGates:
    """One fitted gate per early exit: standardisation (``mean``, ``scale``) and logistic regression (``weights``,
    ``bias``) over :data:`GATE_FEATURES`. :meth:`score` is the probability that an exit's answer is right."""

    mean: tuple[tuple[float, ...], ...]
    scale: tuple[tuple[float, ...], ...]
    weights: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...]

    def __post_init__(self) -> None:
        count, width = len(self.bias), len(GATE_FEATURES)
        rows = (self.mean, self.scale, self.weights)
        if count < 1 or any(len(r) != count or any(len(v) != width for v in r) for r in rows):
            raise AnytimeError(f"exit gates need, per early exit, {width} means, scales and weights and a bias")
        values = [v for r in rows for row in r for v in row] + list(self.bias)
        if not all(isinstance(v, float) and math.isfinite(v) for v in values):
            raise AnytimeError("exit gates hold finite numbers only")
        if any(s <= 0 for row in self.scale for s in row):
            raise AnytimeError("exit gates' scales are positive")

    @property
    def num_steps(self) -> int:
        """The number of exits (early exits and the last) the gates are for."""
        return len(self.bias) + 1

    def _tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        import torch

        as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        return as_tensor(self.mean), as_tensor(self.scale), as_tensor(self.weights), as_tensor(self.bias)

    def score(self, logits: Tensor) -> Tensor:
        """Each early exit's probability of being right, float64 ``[K-1, N]``, from every exit's logits
        ``[K, N, C]`` (the last exit's are not needed; ``[K-1, N, C]`` is accepted too)."""
        features = gate_features(logits)[: len(self.bias)]
        if features.shape[0] != len(self.bias):
            raise AnytimeError(f"these gates are for {self.num_steps} exits; the logits have {logits.shape[0]}")
        return self.score_features(features)

    def score_features(self, features: Tensor, first: int = 0) -> Tensor:
        """:meth:`score` from :func:`gate_features`' output ``[E, N, F]`` of early exits ``first`` .. ``first`` + E - 1."""
        import torch

        mean, scale, weights, bias = (t[first : first + features.shape[0]] for t in self._tensors())
        standard = (features - mean.unsqueeze(1)) / scale.unsqueeze(1)
        value = torch.sigmoid((standard * weights.unsqueeze(1)).sum(-1) + bias.unsqueeze(1))
        return torch.nan_to_num(value, nan=0.0)

    def score_exit(self, k: int, features: Tensor) -> Tensor:
        """Early exit ``k``'s probability of being right from its features ``[N, F]`` (:func:`exit_features`)."""
        return self.score_features(features.unsqueeze(0), first=k)[0]

    def score_row(self, k: int, features: Sequence[float] | None) -> float:
        """:meth:`score_exit` of one sample's features (:func:`row_features`), in Python floats; 0 for None."""
        if features is None:
            return 0.0
        total = self.bias[k]
        for x, m, s, w in zip(features, self.mean[k], self.scale[k], self.weights[k]):
            total += w * (x - m) / s
        return 1.0 / (1.0 + math.exp(-total)) if total > -700.0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the feature names (checked on reading)."""
        return {"features": list(GATE_FEATURES), "mean": [list(r) for r in self.mean],
                "scale": [list(r) for r in self.scale], "weights": [list(r) for r in self.weights],
                "bias": list(self.bias)}  # fmt: skip

    @classmethod
    def from_dict(cls, values: Any, *, where: str = "gates") -> ExitGates:
        """Rebuild from :meth:`to_dict`'s output; a clear error for anything malformed or of other features."""
        try:
            if list(values["features"]) != list(GATE_FEATURES):
                raise AnytimeError(f"{where}: gates of other features ({values['features']}); calibrate again")
            rows = {key: tuple(tuple(float(v) for v in row) for row in values[key]) for key in ("mean", "scale",
                                                                                               "weights")}  # fmt: skip
            return cls(bias=tuple(float(b) for b in values["bias"]), **rows)
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(f"{where}: not valid exit gates (features, mean, scale, weights, bias)") from None


def leave_labels(correct: Tensor) -> Tensor:
    """What a gate learns to predict, from each exit's correctness ``[K, N]``: leaving at exit k loses nothing
    against the last exit (exit k is right, or the last exit is wrong too). Calibration targets accuracy relative
    to the last exit, so a sample no exit gets right should leave at the first, not be carried to the end; on the
    fast CIFAR-10 card's 4-epoch run this label gave 0.440x FLOPs at 81.53% where "exit k is right" gave 0.468x at
    81.43% (test, thresholds for 0.5 point on validation)."""
    return correct | ~correct[-1:].expand_as(correct)


def fit_gates(logits: Tensor, correct: Tensor, *, l2: float = GATE_L2) -> ExitGates:
    """Gates for every early exit of ``logits`` ``[K, N, C]``, each fit to predict ``correct[k]`` (``[K, N]`` bool:
    a label per exit and sample, :func:`leave_labels` in calibration)."""
    features = gate_features(logits)[:-1]
    return _fit(features, correct[:-1], l2)


def _fit(features: Tensor, correct: Tensor, l2: float) -> ExitGates:
    import torch

    means, scales, weights, biases = [], [], [], []
    for x, y in zip(features, correct):
        keep = torch.isfinite(x).all(-1)
        x, y = x[keep], y[keep].double()
        mean = x.mean(0) if len(x) else torch.zeros(x.shape[-1], dtype=torch.float64)
        scale = x.std(0) if len(x) > 1 else torch.ones(x.shape[-1], dtype=torch.float64)
        scale = torch.where(torch.isfinite(scale) & (scale > 1e-9), scale, torch.ones_like(scale))
        w, b = _logistic((x - mean) / scale, y, l2)
        means.append(tuple(mean.tolist()))
        scales.append(tuple(scale.tolist()))
        weights.append(tuple(w.tolist()))
        biases.append(b)
    return ExitGates(tuple(means), tuple(scales), tuple(weights), tuple(biases))


def _logistic(x: Tensor, y: Tensor, l2: float) -> tuple[Tensor, float]:
    """Binary logistic regression (mean log-loss + ``l2`` / 2 times the squared weights) by L-BFGS from zeros."""
    import torch
    import torch.nn.functional as F

    if len(y) == 0 or bool((y == y[0]).all()):  # one class only: a constant gate at its (smoothed) rate
        rate = (float(y.sum()) + 0.5) / (len(y) + 1.0)
        return torch.zeros(x.shape[-1], dtype=torch.float64), math.log(rate / (1 - rate))
    w = torch.zeros(x.shape[-1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    minimise([w, b], lambda: F.binary_cross_entropy_with_logits(x @ w + b, y) + 0.5 * l2 * w.pow(2).sum(),
             steps=_LBFGS_STEPS, tolerance=1e-7)  # fmt: skip
    return w.detach(), float(b.detach())


def cross_fit_scores(
    logits: Tensor, correct: Tensor, *, folds: int = GATE_FOLDS, seed: int = 0, l2: float = GATE_L2
) -> Tensor:
    """Every early exit's gate score of every sample, ``[K-1, N]``, each from gates fit on the other ``folds`` - 1
    folds (a seeded random partition): scores to calibrate thresholds on, free of the gates' own fit."""
    import torch

    features = gate_features(logits)[:-1]
    count = features.shape[1]
    if count < 2 * folds:
        raise AnytimeError(f"learned gates are cross-fitted on {folds} folds of the validation split, which has "
                           f"{count} samples: collect a larger validation split")  # fmt: skip
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    fold_of = torch.empty(count, dtype=torch.long)
    fold_of[order] = torch.arange(count) % folds
    scores = torch.empty(features.shape[:2], dtype=torch.float64)
    for f in range(folds):
        held = fold_of == f
        gates = _fit(features[:, ~held], correct[:-1][:, ~held], l2)
        scores[:, held] = gates.score_features(features[:, held])
    return scores


def shuffled_correctness(correct: Tensor, seed: int = 0) -> Tensor:
    """``correct`` with each exit's row permuted across samples: labels that carry nothing about the samples (the
    control a learned gate must not beat the hand-made criteria with)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.stack([row[torch.randperm(row.shape[0], generator=generator)] for row in correct])
