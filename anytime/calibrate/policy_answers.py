"""What an exit policy hands back and keeps per request: :class:`PolicyResult` (how a policy does on a split,
offline), :class:`EarlyExitOutput` (real early exit on a batch), and the per-request state of a policy applied
exit by exit, :class:`ExitAnswers` (each exit's answer, combined or not) and :class:`ExitDecisions` (who leaves
where, for criteria that compare exits too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anytime.calibrate.combine import Weights, combine_step, log_probs

if TYPE_CHECKING:
    from torch import Tensor

    from anytime.calibrate.policy import ExitPolicy


@dataclass(frozen=True)
class PolicyResult:
    """How a policy does on a split: accuracy, mean FLOPs per sample and where samples leave."""

    accuracy: float
    mean_flops: float
    flops_ratio: float
    exit_share: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the speed-up in FLOPs (base / mean)."""
        return {"accuracy": self.accuracy, "mean_flops": self.mean_flops, "flops_ratio": self.flops_ratio,
                "flops_speedup": 1.0 / self.flops_ratio if self.flops_ratio > 0 else None,
                "exit_share": list(self.exit_share)}  # fmt: skip


@dataclass(frozen=True)
class EarlyExitOutput:
    """Real early exit on a batch: each sample's predicted class, the exit it left at, and its logits."""

    predictions: Tensor
    exits: Tensor
    logits: Tensor


@dataclass
class ExitAnswers:
    """Each exit's answer to one batch under a policy: the exit's own logits, or under a combining policy its
    weighted ensemble with the earlier exits (:mod:`anytime.calibrate.combine`). Feed it every exit whose
    head runs, in order."""

    weights: Weights | None
    _seen: dict[int, Tensor] = field(default_factory=dict)

    def answer(self, k: int, logits: Tensor) -> Tensor:
        """Exit ``k``'s answer given its logits."""
        if self.weights is None:
            return logits
        self._seen[k] = log_probs(logits)
        return combine_step(self._seen, self.weights[k])

    def keep(self, stay: Tensor) -> None:
        """Forget the samples that have left (``stay``: a mask over the rows seen so far)."""
        self._seen = {j: lp[stay] for j, lp in self._seen.items()}


class ExitDecisions:
    """A policy's exit-by-exit decisions for one request that runs every head in order (the anytime runtime's
    way): :meth:`leaves` for one sample, :meth:`confident` for a batch. Feed it every early exit, in order; a
    criterion that compares exits (patience, learned gates) keeps what it needs of the exits seen so far."""

    def __init__(self, policy: ExitPolicy) -> None:
        self.policy = policy
        self._state: Any = None  # learned: GateState or RowState; patience: (predicted, streak) tensors

    def leaves(self, k: int, logits: Tensor) -> bool:
        """Whether the one sample whose answer at early exit ``k`` is ``logits`` (``[1, C]``) leaves."""
        policy = self.policy
        crit = policy._crit
        if crit.learned:
            from anytime.calibrate.gates import row_features

            assert policy.gates is not None
            features, self._state = row_features(logits.tolist()[0], self._state)
            return -policy.gates.score_row(k, features) <= policy._limits[k]
        if crit.stateful:
            leave = self.confident(k, logits)
            return leave is not None and bool(leave[0])
        return policy.leaves(k, logits)

    def keep(self, stay: Tensor) -> None:
        """Forget the samples that have left (``stay``: a mask over the rows seen at the last exit)."""
        from anytime.calibrate.gates import GateState

        if isinstance(self._state, GateState):
            self._state = self._state.keep(stay.cpu())
        elif isinstance(self._state, tuple):
            self._state = (self._state[0][stay], self._state[1][stay])

    def confident(self, k: int, logits: Tensor) -> Tensor | None:
        """Which samples of the batch may leave at early exit ``k`` (``None`` if nobody may leave there)."""
        import torch

        policy = self.policy
        crit, limit = policy._crit, policy._limits[k]
        if crit.learned:
            from anytime.calibrate.gates import exit_features

            assert policy.gates is not None
            features, self._state = exit_features(logits.cpu(), self._state)
            score = policy.gates.score_exit(k, features).to(logits.device)
        elif crit.stateful:
            predicted = logits.argmax(dim=1)
            streak = torch.zeros(predicted.shape, dtype=torch.float64, device=logits.device)
            if self._state is not None:
                streak = torch.where(predicted == self._state[0], self._state[1] + 1, 0.0)
            self._state, score = (predicted, streak), streak
        else:
            return policy.confident(k, logits)
        return None if limit == -math.inf else -score <= limit
