"""Exit criteria: how confident an exit's answer is, from its logits.

Every criterion maps logits ``[..., C]`` to a score; a sample leaves at an exit when the score passes
that exit's threshold. Scores are computed in float64 by one function used both at run time and on
the cached outputs, so real early exit and the offline sweep agree sample for sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from torch import Tensor

CRITERIA: tuple[str, ...] = ("entropy", "normalized-entropy", "confidence", "margin", "patience", "learned")
PATIENCE_MAX = 1000.0  # the largest patience a threshold may ask (a streak can never reach it)


@dataclass(frozen=True)
class Criterion:
    """A confidence criterion. ``low_is_confident``: a sample leaves when its score is at most the
    threshold (entropy); otherwise when it is at least the threshold (max-softmax, margin)."""

    name: str
    low_is_confident: bool
    description: str

    @property
    def stateful(self) -> bool:
        """Whether an exit's score depends on the earlier exits' answers too (patience, learned gates), not on its
        logits alone."""
        return self.name in ("patience", "learned")

    @property
    def learned(self) -> bool:
        """Whether scores come from gates fit on validation (:mod:`anytime.calibrate.gates`), not from a formula."""
        return self.name == "learned"

    def score(self, logits: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
        """The score of every row of ``logits`` (after dividing by ``temperature``), float64. Patience scores
        every exit at once: ``logits`` is ``[K, N, C]``, exits first (see :func:`agreement_streak`)."""
        import torch
        import torch.nn.functional as F

        if self.learned:
            raise AnytimeError("the learned criterion scores with gates fit on validation: calibrate with "
                               "--criterion learned, and run the calibrated policy")  # fmt: skip
        if self.stateful:
            return agreement_streak(logits)
        if isinstance(temperature, float) and temperature == 1.0:
            z = logits  # softmax casts to float64 first: one operator fewer between a network's stages
        else:
            z = logits.double() / temperature
        p = F.softmax(z, dim=-1, dtype=torch.float64)
        if self.name in ("entropy", "normalized-entropy"):
            entropy = torch.special.entr(p).sum(dim=-1)
            return entropy / math.log(z.shape[-1]) if self.name == "normalized-entropy" else entropy
        if self.name == "confidence":
            return p.amax(dim=-1)
        top = p.topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]

    def score_row(self, logits: Sequence[float], temperature: float = 1.0) -> float:
        """:meth:`score` of one sample's logits given as Python floats, in Python's float64 arithmetic. At batch 1
        with few classes this is the cheap way: a handful of PyTorch operators on a 10-value tensor cost 7 us
        measured alone, and about 35 us each when they run between a network's convolutions (ResNet-32 at batch 1:
        its four exits' criterion added 3.6% to the whole network)."""
        if self.stateful:
            raise AnytimeError("patience compares exits with each other; score it with score() on every exit's logits")
        z = [v / temperature for v in logits] if temperature != 1.0 else list(logits)
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = math.fsum(e)
        if total != total:  # a NaN or +inf logit (or no possible class): NaN, as the tensor score gives
            return math.nan
        if self.name in ("entropy", "normalized-entropy"):
            entropy = -math.fsum(v / total * math.log(v / total) for v in e if v > 0.0)
            return entropy / math.log(len(z)) if self.name == "normalized-entropy" else entropy
        first = max(e)
        if self.name == "confidence":
            return first / total
        e.remove(first)
        return (first - max(e)) / total

    def signed(self, scores: Tensor) -> Tensor:
        """Scores turned so that lower is always more confident (a sample leaves when signed <= signed threshold)."""
        return scores if self.low_is_confident else -scores

    def bounds(self, num_classes: int) -> tuple[float, float]:
        """The range a threshold can take for ``num_classes`` classes."""
        if self.learned:
            return (0.0, 1.0)
        if self.stateful:
            return (0.0, PATIENCE_MAX)
        return (0.0, math.log(num_classes)) if self.name == "entropy" else (0.0, 1.0)

    def check_thresholds(self, thresholds: Sequence[float | None], num_classes: int, num_exits: int) -> None:
        """Validate one threshold per early exit (every exit but the last; ``None`` = nobody leaves there)."""
        if len(thresholds) != num_exits - 1:
            raise AnytimeError(
                f"{len(thresholds)} thresholds given for {num_exits - 1} early exits; give one per exit but the last"
            )
        lo, hi = self.bounds(num_classes)
        for k, t in enumerate(thresholds):
            if t is None:
                continue
            if not isinstance(t, (int, float)) or not math.isfinite(t):
                raise AnytimeError(f"threshold of exit {k} is {t}; thresholds must be finite numbers")
            if not lo <= t <= hi:
                raise AnytimeError(
                    f"threshold {t} of exit {k} is outside [{lo:.4g}, {hi:.4g}], the range of {self.name} "
                    f"for {num_classes} classes"
                )


_CRITERIA = {
    "entropy": Criterion("entropy", True, "softmax entropy in nats (BranchyNet); leave when at most the threshold"),
    "normalized-entropy": Criterion(
        "normalized-entropy", True, "entropy / log(classes) in [0, 1] (DDNN); leave when at most the threshold"
    ),
    "confidence": Criterion("confidence", False, "max softmax probability (SDN); leave when at least the threshold"),
    "margin": Criterion("margin", False, "top-1 minus top-2 probability; leave when at least the threshold"),
    "patience": Criterion(
        "patience",
        False,
        "PABEE: how many exits in a row before this one gave the same class; "
        "leave when at least the threshold (every earlier exit's head runs)",
    ),
    "learned": Criterion(
        "learned",
        False,
        "a gate per exit, fit on validation, predicting from the exit's softmax and the earlier exits' agreement "
        "whether its answer is right; leave when its probability is at least the threshold",
    ),
}


def agreement_streak(logits: Tensor) -> Tensor:
    """Patience scores (Zhou et al. 2020, PABEE) of exits' logits ``[K, N, C]``: for exit k and sample n, how many
    exits in a row just before k predicted the class exit k predicts (0 at the first exit), as float64 ``[K, N]``."""
    import torch

    if logits.dim() != 3:
        raise AnytimeError("patience compares exits with each other: score the logits of every exit, [K, N, C]")
    predicted = logits.argmax(dim=-1)
    streak = torch.zeros(predicted.shape, dtype=torch.float64, device=logits.device)
    for k in range(1, predicted.shape[0]):
        streak[k] = torch.where(predicted[k] == predicted[k - 1], streak[k - 1] + 1, 0.0)
    return streak


def get_criterion(name: str) -> Criterion:
    """The criterion called ``name`` (one of :data:`CRITERIA`)."""
    if name not in _CRITERIA:
        raise AnytimeError(f"unknown exit criterion '{name}'; choose one of {', '.join(CRITERIA)}")
    return _CRITERIA[name]


def fit_temperatures(logits: Tensor, labels: Tensor) -> list[float]:
    """Per-exit temperature scaling (Guo et al. 2017): the temperature minimising each exit's negative
    log-likelihood on ``logits`` ``[K, N, C]``, searched on a log grid from 0.05 to 20 and refined once."""
    import torch
    import torch.nn.functional as F

    def nll(z: Tensor, grid: Tensor) -> Tensor:
        return torch.stack([F.cross_entropy(z / t, labels) for t in grid])

    temps: list[float] = []
    coarse = torch.logspace(math.log10(0.05), math.log10(20.0), 161, dtype=torch.float64)
    for z in logits.double():
        i = int(nll(z, coarse).argmin())
        fine = torch.linspace(float(coarse[max(i - 1, 0)]), float(coarse[min(i + 1, len(coarse) - 1)]), 81,
                              dtype=torch.float64)  # fmt: skip
        temps.append(float(fine[int(nll(z, fine).argmin())]))
    return temps
