"""Threshold sweeps from the outputs cache: accuracy, expected cost and exit distribution of many settings at once.

A *setting* is one threshold per early exit. For S settings, K exits and N samples the sweep is a
handful of tensor operations on ``[S, K-1, N]`` booleans; nothing runs the network again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from anytime.calibrate.criteria import Criterion, get_criterion
from anytime.calibrate.gates import ExitGates
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache


def exit_costs(step_flops: Tensor, cost_flops: Tensor, enabled: Tensor) -> Tensor:
    """FLOPs a sample spends when it leaves at each exit, ``[S, K]``, for S settings whose enabled early exits
    are ``enabled`` ``[S, K-1]``: the backbone up to the exit, plus the head of every enabled exit on the way
    (a disabled exit, whose threshold lets nobody leave, is skipped, head and all).

    ``step_flops[k]`` is the backbone up to exit k plus its own head; ``cost_flops[k]`` adds every earlier
    head, so the heads' FLOPs are recovered from the difference.
    """
    paid_before = cost_flops - step_flops  # heads of exits 0..k-1
    heads = torch.diff(paid_before)  # [K-1]
    backbone = step_flops - torch.cat([heads, heads.new_zeros(1)])
    paid = torch.cumsum(enabled.to(heads.dtype) * heads, dim=1)  # heads paid up to and including exit k
    paid = torch.cat([paid, paid[:, -1:]], dim=1)  # the last exit pays every enabled early head
    return backbone.unsqueeze(0) + paid


@dataclass(frozen=True)
class Scores:
    """Every early exit's signed scores on a cache (lower = more confident), ``[K-1, N]`` float64, with
    what the sweep needs to score a setting: which exits are right, and what each costs."""

    criterion: Criterion
    signed: Tensor
    correct: Tensor  # [K, N] bool
    step_flops: Tensor  # [K] float64, the backbone up to exit k and its head
    cost_flops: Tensor  # [K] float64, ... and every earlier head
    base_flops: int

    @property
    def num_steps(self) -> int:
        """K."""
        return int(self.correct.shape[0])

    @property
    def floor(self) -> Tensor:
        """Each early exit's lowest signed score: a threshold below it lets nobody leave there."""
        return self.signed.min(dim=1).values

    def mean_cost(self, share: Tensor, enabled: Tensor) -> Tensor:
        """Mean FLOPs per sample ``[S]`` of settings with exit shares ``[S, K]`` and enabled exits ``[S, K-1]``.
        A criterion that compares exits (patience, learned gates) runs every early head whatever is enabled."""
        if self.criterion.stateful:
            enabled = torch.ones_like(enabled, dtype=torch.bool)
        return (share * exit_costs(self.step_flops, self.cost_flops, enabled)).sum(dim=1)


def scores_of(
    cache: OutputCache,
    criterion: str | Criterion,
    temperatures: list[float] | None = None,
    gates: ExitGates | None = None,
) -> Scores:
    """Score every early exit of ``cache`` under ``criterion`` (after per-exit temperature scaling, if given; the
    learned criterion with ``gates``, fitted ones: see :func:`learned_scores` to fit them)."""
    crit = get_criterion(criterion) if isinstance(criterion, str) else criterion
    if cache.num_steps < 2:
        raise AnytimeError("this cache has a single step: there is no exit decision to sweep")
    if crit.learned:
        if gates is None:
            raise AnytimeError(
                "the learned criterion needs gates fit on validation: calibrate with --criterion learned"
            )
        if gates.num_steps != cache.num_steps:
            raise AnytimeError(f"these gates are for {gates.num_steps} exits; the outputs have {cache.num_steps}")
        return _scores(crit, gates.score(torch.from_numpy(cache.logits)), cache)
    logits = torch.from_numpy(cache.logits[:-1])
    temps = torch.ones(cache.num_steps - 1, dtype=torch.float64)
    if temperatures is not None:
        if len(temperatures) != cache.num_steps:
            raise AnytimeError(f"{len(temperatures)} temperatures for {cache.num_steps} exits; give one per exit")
        temps = torch.tensor(temperatures[:-1], dtype=torch.float64)
    return _scores(crit, crit.score(logits, temps.view(-1, 1, 1)), cache)


def learned_scores(
    cache: OutputCache, fit_on: OutputCache | None = None, *, shuffled: bool = False
) -> tuple[Scores, ExitGates]:
    """The learned criterion's scores of ``cache`` and the gates that produce them at run time. With ``fit_on``
    (the validation cache, when ``cache`` is another split) the gates are fit there and score ``cache``. Without
    it, ``cache`` is the validation split itself: the gates are fit on all of it, and each sample's score comes
    from gates fit on the other folds (:func:`~anytime.calibrate.gates.cross_fit_scores`), so thresholds
    calibrated on these scores never see the gates' own fit. ``shuffled`` is the control: gates fit to each
    exit's correctness shuffled across samples, which tells them nothing."""
    from anytime.calibrate.gates import cross_fit_scores, fit_gates, leave_labels, shuffled_correctness

    source = cache if fit_on is None else fit_on
    if source.num_steps != cache.num_steps:
        raise AnytimeError(f"the validation outputs have {source.num_steps} exits, these {cache.num_steps}")
    logits, correct = torch.from_numpy(source.logits), leave_labels(torch.from_numpy(source.correct()))
    if shuffled:
        correct = shuffled_correctness(correct)
    gates = fit_gates(logits, correct)
    crit = get_criterion("learned")
    if fit_on is not None:
        return scores_of(cache, crit, gates=gates), gates
    return _scores(crit, cross_fit_scores(logits, correct), cache), gates


def _scores(crit: Criterion, raw: Tensor, cache: OutputCache) -> Scores:
    return Scores(
        criterion=crit, signed=crit.signed(raw), correct=torch.from_numpy(cache.correct()),
        step_flops=torch.from_numpy(cache.step_flops.astype(np.float64)),
        cost_flops=torch.from_numpy(cache.cost_flops.astype(np.float64)), base_flops=cache.base_flops,
    )  # fmt: skip


def assign_exits(signed: Tensor, signed_thresholds: Tensor) -> Tensor:
    """The exit each sample leaves at, ``[S, N]``, for S settings ``[S, K-1]`` of signed thresholds: the first
    exit whose signed score is at most its threshold, else the last exit (index K-1)."""
    settings, early = signed_thresholds.shape
    exits = torch.full((settings, signed.shape[1]), early, dtype=torch.long)
    for k in reversed(range(early)):  # the earliest passing exit is written last, so it wins
        exits.masked_fill_(signed[k].unsqueeze(0) <= signed_thresholds[:, k : k + 1], k)
    return exits


@dataclass(frozen=True)
class SweepResult:
    """The outcome of S settings: thresholds in the criterion's own units ``[S, K-1]`` (NaN: nobody leaves
    at that exit), accuracy ``[S]``, mean FLOPs per sample ``[S]`` and the share of samples leaving at each
    exit ``[S, K]``."""

    criterion: str
    thresholds: np.ndarray
    accuracy: np.ndarray
    mean_flops: np.ndarray
    exit_share: np.ndarray
    base_flops: int
    shared: np.ndarray | None = None  # the one threshold all exits share, per setting (criterion's units)

    @property
    def flops_ratio(self) -> np.ndarray:
        """Mean FLOPs relative to the plain backbone's (below 1 saves compute)."""
        return self.mean_flops / self.base_flops

    def pareto(self) -> np.ndarray:
        """Indices of the settings no other setting beats on both accuracy and cost, cheapest first."""
        order = np.lexsort((-self.accuracy, self.mean_flops))
        front, best = [], -np.inf
        for i in order:
            if self.accuracy[i] > best:
                front.append(i)
                best = self.accuracy[i]
        return np.asarray(front, dtype=np.int64)

    def area(self) -> float:
        """The area under this criterion's accuracy-vs-FLOPs curve (:func:`anytime.utils.stats.area_under_front`:
        the mean best accuracy over FLOPs budgets from the cheapest setting's to the backbone's)."""
        from anytime.utils.stats import area_under_front

        return area_under_front(self.flops_ratio, self.accuracy)

    def rows(self, indices: np.ndarray | None = None) -> list[dict[str, float | None]]:
        """One dict per setting (for CSV and JSON): thresholds (None: nobody leaves there), accuracy, FLOPs,
        ratio and exit shares."""
        chosen = range(len(self.accuracy)) if indices is None else indices
        rows = []
        for i in chosen:
            row: dict[str, float | None] = {
                f"threshold{k}": None if np.isnan(t) else float(t) for k, t in enumerate(self.thresholds[i])
            }
            row.update(accuracy=float(self.accuracy[i]), mean_flops=float(self.mean_flops[i]),
                       flops_ratio=float(self.mean_flops[i] / self.base_flops))  # fmt: skip
            row.update({f"share{k}": float(s) for k, s in enumerate(self.exit_share[i])})
            rows.append(row)
        return rows


def evaluate_settings(
    scores: Scores, signed_thresholds: Tensor, *, floor_disables: bool = True, chunk: int = 256
) -> tuple[Tensor, Tensor, Tensor]:
    """Accuracy ``[S]``, mean cost ``[S]`` and exit shares ``[S, K]`` of any signed threshold settings ``[S, K-1]``.

    An exit whose threshold is -inf is disabled (its head never runs). With ``floor_disables`` (settings
    fit on this very cache), so is one whose threshold is below every score it has here: the policy made
    from it says "nobody leaves" there (``None``), and the head is skipped.
    """
    n = scores.signed.shape[1]
    k_last = scores.num_steps - 1
    accs, shares = [], []
    for start in range(0, signed_thresholds.shape[0], chunk):
        limits = signed_thresholds[start : start + chunk]
        remaining = torch.ones(limits.shape[0], n, dtype=torch.bool)
        hits = torch.zeros(limits.shape[0], dtype=torch.int64)
        counts = torch.zeros(limits.shape[0], k_last + 1, dtype=torch.int64)
        for k in range(k_last + 1):
            leave = remaining if k == k_last else remaining & (scores.signed[k].unsqueeze(0) <= limits[:, k : k + 1])
            counts[:, k] = leave.sum(dim=1)
            hits += (leave & scores.correct[k].unsqueeze(0)).sum(dim=1)
            if k < k_last:
                remaining &= ~leave
        accs.append(hits.double() / n)
        shares.append(counts.double() / n)
    share = torch.cat(shares)
    limit = scores.floor.unsqueeze(0) if floor_disables else torch.tensor(-math.inf, dtype=torch.float64)
    enabled = signed_thresholds >= limit if floor_disables else signed_thresholds > limit
    return torch.cat(accs), scores.mean_cost(share, enabled), share


def sweep_shared(scores: Scores, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`evaluate_settings` for S thresholds shared by every exit (``values`` ``[S]``, signed), in
    O(K N log N + K S log N) rather than O(S K N).

    With one threshold t for all exits, a sample leaves at the first exit k whose running minimum of
    scores ``m_k = min(s_0..s_k)`` is at most t. So ``A_k(t) = #{n: m_k(n) <= t}`` samples have left by exit
    k, the share of exit k is ``A_k - A_{k-1}``, and the accuracy gains, as t passes ``m_k(n)``, the
    difference between exit k's and exit k+1's correctness on sample n. Sorting each ``m_k`` once and
    binary-searching the S values gives every setting exactly, ties included.
    """
    n = scores.signed.shape[1]
    k_last = scores.num_steps - 1
    running = torch.cummin(scores.signed, dim=0).values  # [K-1, N]
    correct = scores.correct.to(torch.int64)
    left = torch.zeros(values.shape[0], k_last + 1, dtype=torch.int64)  # A_k(t), and N for the last exit
    hits = torch.full((values.shape[0],), int(correct[k_last].sum()), dtype=torch.int64)
    for k in range(k_last):
        order = torch.argsort(running[k], stable=True)
        sorted_m = running[k][order]
        gain = (correct[k] - correct[k + 1])[order].cumsum(0)
        idx = torch.searchsorted(sorted_m, values, right=True)
        left[:, k] = idx
        hits += torch.where(idx > 0, gain[(idx - 1).clamp(min=0)], torch.zeros_like(idx))
    left[:, k_last] = n
    counts = torch.diff(left, dim=1, prepend=torch.zeros(values.shape[0], 1, dtype=torch.int64))
    share = counts.double() / n
    enabled = values.unsqueeze(1) >= scores.floor.unsqueeze(0)
    return hits.double() / n, scores.mean_cost(share, enabled), share


def shared_grid(scores: Scores, settings: int) -> Tensor:
    """``settings`` signed thresholds shared by every exit: quantiles of the pooled scores, from "no sample
    leaves early" to "every sample leaves at the first exit"."""
    if settings < 2:
        raise AnytimeError(f"a sweep needs at least 2 settings (got {settings})")
    pooled = scores.signed.reshape(-1)
    q = torch.linspace(0, 1, settings - 2, dtype=torch.float64)
    inner = torch.quantile(pooled, q) if settings > 2 else torch.empty(0, dtype=torch.float64)
    low = pooled.min() - 1.0  # below every score: nobody leaves early
    high = pooled.max()
    values = torch.cat([low.view(1), inner, high.view(1)])
    return values.view(-1, 1).expand(-1, scores.num_steps - 1).contiguous()


def to_natural(criterion: Criterion, signed_thresholds: Tensor, num_classes: int, floor: Tensor) -> np.ndarray:
    """Signed thresholds back in the criterion's units. A threshold below every score of its exit (``floor``,
    ``[K-1]``) means "nobody leaves here" and becomes NaN; one past the criterion's range is clipped to it
    (everybody leaves)."""
    lo, hi = criterion.bounds(num_classes)
    natural = (signed_thresholds if criterion.low_is_confident else -signed_thresholds).clamp(lo, hi)
    never = signed_thresholds < floor.view(1, -1)
    return torch.where(never, torch.full_like(natural, float("nan")), natural).numpy()


def sweep(
    cache: OutputCache,
    criterion: str = "entropy",
    *,
    settings: int = 1000,
    temperatures: list[float] | None = None,
    val: OutputCache | None = None,
) -> SweepResult:
    """Sweep ``settings`` thresholds shared by all exits (BranchyNet's single knob) over the cache. The learned
    criterion's gates are fit on ``val`` (the validation cache, when ``cache`` is another split) or cross-fitted
    on ``cache`` itself (see :func:`learned_scores`)."""
    if get_criterion(criterion).learned:
        scores = learned_scores(cache, val)[0]
    else:
        scores = scores_of(cache, criterion, temperatures)
    grid = shared_grid(scores, settings)
    acc, cost, share = sweep_shared(scores, grid[:, 0].contiguous())
    lo, hi = scores.criterion.bounds(cache.num_classes)
    shared = (grid[:, 0] if scores.criterion.low_is_confident else -grid[:, 0]).clamp(lo, hi).numpy()
    return SweepResult(
        shared=shared,
        criterion=scores.criterion.name,
        thresholds=to_natural(scores.criterion, grid, cache.num_classes, scores.signed.min(dim=1).values),
        accuracy=acc.numpy(), mean_flops=cost.numpy(), exit_share=share.numpy(), base_flops=cache.base_flops,
    )  # fmt: skip


@dataclass(frozen=True)
class Oracle:
    """Each sample leaves at its first correct exit (the last if none is right), paying every head on the
    way: the cheapest way to reach the accuracy of "some exit is right", the ceiling of early exit."""

    accuracy: float
    mean_flops: float
    exit_share: np.ndarray
    base_flops: int

    @property
    def flops_ratio(self) -> float:
        """Mean FLOPs relative to the plain backbone's."""
        return self.mean_flops / self.base_flops


def oracle(cache: OutputCache) -> Oracle:
    """The oracle's accuracy, cost and exit distribution on ``cache``."""
    correct = cache.correct()
    k = cache.num_steps
    first = np.where(correct.any(axis=0), correct.argmax(axis=0), k - 1)
    return Oracle(
        accuracy=float(correct.any(axis=0).mean()), mean_flops=float(cache.cost_flops[first].mean()),
        exit_share=np.bincount(first, minlength=k) / cache.num_samples, base_flops=cache.base_flops,
    )  # fmt: skip
