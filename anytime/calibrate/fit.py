"""Calibration: thresholds fit on the validation cache for a target accuracy or a mean-cost budget.

Only the cache passed in is read; the caller passes the validation split's, and reports the test split
with the thresholds fixed. Two ways to meet a budget: MSDNet's rule (the share of samples leaving at
exit k proportional to q^k, thresholds set on validation so that those shares leave) and a direct
search (the best setting of a shared-threshold sweep, refined exit by exit).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from anytime.calibrate.combine import Weights, combined_cache, combined_costs, fit_weights, running_exits
from anytime.calibrate.criteria import fit_temperatures, get_criterion
from anytime.calibrate.gates import ExitGates
from anytime.calibrate.policy import ExitPolicy
from anytime.calibrate.policy_answers import PolicyResult
from anytime.calibrate.sweeps import Scores, evaluate_settings, learned_scores, scores_of, shared_grid
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache

RULES: tuple[str, ...] = ("search", "msdnet")


@dataclass(frozen=True)
class Calibration:
    """A fitted policy, how it was fit, and what it does on the data it was fit on."""

    policy: ExitPolicy
    rule: str
    target: dict[str, float]
    fit: PolicyResult


def _candidates(signed: Tensor, per_exit: int) -> list[Tensor]:
    """Per exit: thresholds halfway between neighbouring observed scores (so that a sample never sits on a
    threshold), at ``per_exit`` quantiles, plus "nobody leaves" and "everybody leaves"."""
    out = []
    for row in signed:
        values = torch.unique(row)  # sorted
        mids = (values[1:] + values[:-1]) / 2 if len(values) > 1 else values
        picks = torch.linspace(0, len(mids) - 1, min(per_exit, len(mids))).round().long()
        out.append(torch.cat([(values[0] - 1).view(1), mids[picks], (values[-1] + 1).view(1)]))
    return out


def _to_policy(
    scores: Scores,
    signed: Tensor,
    temperatures: list[float] | None,
    num_classes: int,
    combine: Weights | None = None,
    gates: ExitGates | None = None,
) -> ExitPolicy:
    crit = scores.criterion
    lo, hi = crit.bounds(num_classes)
    floor = scores.signed.min(dim=1).values
    thresholds: list[float | None] = []
    for k, t in enumerate(signed.tolist()):
        if t < float(floor[k]):
            thresholds.append(None)
        else:
            natural = t if crit.low_is_confident else -t
            thresholds.append(min(max(natural, lo), hi))
    temps = None if temperatures is None else tuple(temperatures)
    return ExitPolicy(crit.name, tuple(thresholds), temps, combine, gates)


def _search(
    scores: Scores,
    pick: Callable[[Tensor, Tensor], int | None],
    *,
    per_exit: int = 64,
    rounds: int = 4,
    off: frozenset[int] = frozenset(),
) -> Tensor | None:
    """The shared-threshold sweep's best setting under ``pick``, then coordinate descent over each exit's
    candidate thresholds. ``pick(acc, cost)`` returns the index of the best feasible setting, or None.
    Exits in ``off`` stay disabled (threshold -inf: nobody leaves, the head never runs)."""
    grid = shared_grid(scores, 1000)
    grid[:, sorted(off)] = -math.inf
    acc, cost, _ = evaluate_settings(scores, grid)
    best_index = pick(acc, cost)
    if best_index is None:
        return None
    current = grid[best_index].clone()
    candidates = _candidates(scores.signed, per_exit)
    for _ in range(rounds):
        before = current.clone()
        for k, values in enumerate(candidates):
            if k in off:
                continue
            trial = current.repeat(len(values) + 1, 1)
            trial[1:, k] = values  # row 0 keeps the current setting, so a feasible choice always exists
            acc, cost, _ = evaluate_settings(scores, trial)
            chosen = pick(acc, cost)
            if chosen is not None:
                current = trial[chosen].clone()
        if torch.equal(before, current):
            break
    return current


def _min_cost_reaching(target: float) -> Callable[[Tensor, Tensor], int | None]:
    def pick(acc: Tensor, cost: Tensor) -> int | None:
        ok = acc >= target - 1e-12
        if not bool(ok.any()):
            return None
        key = torch.where(ok, cost - acc * 1e-9, torch.full_like(cost, math.inf))
        return int(key.argmin())

    return pick


def _max_acc_within(budget: float) -> Callable[[Tensor, Tensor], int | None]:
    def pick(acc: Tensor, cost: Tensor) -> int | None:
        ok = cost <= budget * (1 + 1e-12)
        if not bool(ok.any()):
            return None
        key = torch.where(ok, acc - cost * 1e-18, torch.full_like(acc, -math.inf))
        return int(key.argmax())

    return pick


@dataclass(frozen=True)
class _Prepared:
    scores: Scores
    temperatures: list[float] | None
    combine: Weights | None
    gates: ExitGates | None
    last_accuracy: float  # the plain last exit's: the reference of every accuracy target


def _check_combine(criterion: str, temperature: bool) -> None:
    if temperature or get_criterion(criterion).stateful:
        raise AnytimeError("--combine-exits fits each exit's scale itself and scores combined answers: drop "
                           f"{'--temperature' if temperature else f'the {criterion} criterion'} to use it")  # fmt: skip


def _prepare(
    cache: OutputCache, criterion: str, temperature: bool, combine: bool = False, shuffled_gates: bool = False
) -> _Prepared:
    crit = get_criterion(criterion)
    if combine:
        _check_combine(criterion, temperature)
    last = float(cache.step_accuracy()[-1])
    if crit.learned:
        if temperature:
            raise AnytimeError("learned gates read the exits' logits as they are; drop --temperature to use them")
        scores, gates = learned_scores(cache, shuffled=shuffled_gates)
        return _Prepared(scores, None, None, gates, last)
    if shuffled_gates:
        raise AnytimeError("shuffled gates are the control of the learned criterion; calibrate --criterion learned")
    temps, weights = None, None
    if temperature:
        temps = fit_temperatures(torch.from_numpy(cache.logits), torch.from_numpy(cache.labels))
    if combine:
        weights = fit_weights(torch.from_numpy(cache.logits), torch.from_numpy(cache.labels))
        cache = combined_cache(cache, weights)
    return _Prepared(scores_of(cache, criterion, temps), temps, weights, None, last)


def calibrate_max_drop(
    val: OutputCache,
    *,
    max_drop: float,
    criterion: str = "entropy",
    temperature: bool = False,
    combine: bool = False,
    shuffled_gates: bool = False,
) -> Calibration:
    """The cheapest thresholds whose validation accuracy is at most ``max_drop`` points below the last exit's
    (the plain last exit's, also when ``combine`` makes every exit answer with the ones before it). The learned
    criterion fits its gates on ``val`` and calibrates on cross-fitted scores; ``shuffled_gates`` is its control
    (gates fit to shuffled correctness, see :func:`~anytime.calibrate.sweeps.learned_scores`)."""
    if not math.isfinite(max_drop) or not 0 <= max_drop <= 100:
        raise AnytimeError(f"--max-drop is in accuracy points, between 0 and 100 (got {max_drop})")
    prep = _prepare(val, criterion, temperature, combine, shuffled_gates)
    target = prep.last_accuracy - max_drop / 100
    best = _search(prep.scores, _min_cost_reaching(target))
    if best is None:  # only a combined last exit can fall below the plain one's target
        raise AnytimeError(f"no threshold setting reaches {100 * target:.2f}% on validation; the combined last exit "
                           "is below it: calibrate without --combine-exits")  # fmt: skip
    policy = _to_policy(prep.scores, best, prep.temperatures, val.num_classes, prep.combine, prep.gates)
    return Calibration(policy, "max-drop", {"max_drop_points": max_drop, "target_accuracy": target},
                       policy.evaluate(val))  # fmt: skip


@dataclass(frozen=True)
class SubsetChoice:
    """One subset of early exits tried by :func:`select_exits`: its cheapest thresholds for the target, and
    what they do on the data they were fit on (``mean_ms`` from the measured costs)."""

    exits: tuple[int, ...]
    accuracy: float
    mean_ms: float
    reaches_target: bool


def measured_costs(steps_ms: Sequence[float], stages_ms: Sequence[float]) -> tuple[Tensor, Tensor]:
    """Per exit, in ms: answering there alone (backbone so far and its head) and reaching it through every
    earlier exit (cumulative stages: every head on the way paid), as :class:`Scores` holds FLOPs. Timing noise
    that would make a head cost less than nothing is clipped."""
    step = torch.tensor(list(steps_ms), dtype=torch.float64)
    through = torch.cumsum(torch.tensor(list(stages_ms), dtype=torch.float64), dim=0)
    paid = torch.cummax((through - step).clamp(min=0), dim=0).values
    return step, step + paid


def select_exits(
    val: OutputCache, *, max_drop: float, costs: tuple[Tensor, Tensor], criterion: str = "entropy",
    temperature: bool = False, combine: bool = False,
) -> tuple[Calibration, list[SubsetChoice]]:  # fmt: skip
    """Exit selection: every subset of the early exits (the last always answers), each with its cheapest
    thresholds within ``max_drop`` points of the last exit on validation, costed in measured time
    (``costs`` from :func:`measured_costs`), since an exit nobody leaves at only adds its head; the subset with
    the lowest mean time wins. Dropped exits get no threshold (their heads never run). With ``combine``, each
    subset gets its own combination weights over the exits it keeps, and pays every kept head."""
    if not math.isfinite(max_drop) or not 0 <= max_drop <= 100:
        raise AnytimeError(f"--max-drop is in accuracy points, between 0 and 100 (got {max_drop})")
    prep = _prepare(val, criterion, temperature)
    step_ms, cost_ms = costs
    if len(step_ms) != prep.scores.num_steps or len(cost_ms) != prep.scores.num_steps:
        raise AnytimeError(f"the latencies are for {len(step_ms)} steps but the outputs have {prep.scores.num_steps}; "
                           "profile this run again")  # fmt: skip
    if combine:
        _check_combine(criterion, temperature)
    target = prep.last_accuracy - max_drop / 100
    early = range(prep.scores.num_steps - 1)
    tried: list[tuple[SubsetChoice, Tensor, Scores, Weights | None]] = []
    for size in range(len(early) + 1):
        for kept in itertools.combinations(early, size):
            timed, weights = replace(prep.scores, step_flops=step_ms, cost_flops=cost_ms), None
            if combine:
                weights = fit_weights(torch.from_numpy(val.logits), torch.from_numpy(val.labels), members=kept)
                paid = combined_costs(step_ms, cost_ms, running_exits(weights))
                timed = replace(scores_of(combined_cache(val, weights), criterion), step_flops=paid, cost_flops=paid)
            best = _search(timed, _min_cost_reaching(target), off=frozenset(early) - frozenset(kept))
            if best is None:
                continue
            acc, ms, _ = evaluate_settings(timed, best.view(1, -1))
            choice = SubsetChoice(kept, float(acc[0]), float(ms[0]), bool(acc[0] >= target - 1e-12))
            tried.append((choice, best, timed, weights))
    if not tried:
        raise AnytimeError(f"no subset of exits reaches {100 * target:.2f}% on validation; the combined last exit "
                           "is below it: calibrate without --combine-exits")  # fmt: skip
    _, best, scores, weights = min(tried, key=lambda t: (t[0].mean_ms, -t[0].accuracy))
    policy = _to_policy(scores, best, prep.temperatures, val.num_classes, weights, prep.gates)
    calibration = Calibration(policy, "max-drop-select", {"max_drop_points": max_drop, "target_accuracy": target},
                              policy.evaluate(val))  # fmt: skip
    return calibration, [t[0] for t in tried]


def _check_budget(scores: Scores, fraction: float) -> float:
    if not math.isfinite(fraction) or fraction <= 0:
        raise AnytimeError(f"--budget-flops is a fraction of the backbone's FLOPs, above 0 (got {fraction})")
    budget = fraction * scores.base_flops
    cheapest = float(scores.cost_flops[0])
    if budget < cheapest:
        raise AnytimeError(
            f"a budget of {fraction:.3g} of the backbone's FLOPs is below the first exit's own cost "
            f"({cheapest / scores.base_flops:.3g}); no policy can meet it, so raise the budget"
        )
    return budget


def calibrate_budget(
    val: OutputCache,
    *,
    budget: float,
    criterion: str = "entropy",
    rule: str = "search",
    temperature: bool = False,
    combine: bool = False,
    shuffled_gates: bool = False,
) -> Calibration:
    """Thresholds for a mean cost of ``budget`` times the backbone's FLOPs on validation, by ``rule``:
    ``search``, the most accurate setting whose cost is at most the budget (a direct search), or ``msdnet``,
    MSDNet's rule (shares proportional to q^k, q set for the budget), which meets the budget only up to
    the rounding of the shares to whole samples and ties between scores; its cost is reported as found."""
    if rule not in RULES:
        raise AnytimeError(f"unknown budget rule '{rule}'; choose one of {', '.join(RULES)}")
    prep = _prepare(val, criterion, temperature, combine, shuffled_gates)
    scores = prep.scores
    limit = _check_budget(scores, budget)
    if rule == "msdnet":
        best = msdnet_thresholds(scores, limit)
    else:
        found = _search(scores, _max_acc_within(limit))
        assert found is not None  # everybody at the first exit fits, as _check_budget made sure
        best = found
    policy = _to_policy(scores, best, prep.temperatures, val.num_classes, prep.combine, prep.gates)
    return Calibration(policy, f"budget-{rule}", {"budget_flops_fraction": budget}, policy.evaluate(val))


def msdnet_shares(cost: Tensor, budget: float) -> Tensor:
    """MSDNet's exit distribution: share ``p_k`` proportional to ``q^k``, with ``q`` found by bisection so
    that the expected cost ``sum_k p_k cost_k`` equals ``budget``."""
    k = torch.arange(len(cost), dtype=torch.float64)
    lo, hi = -30.0, 30.0  # log q; the expected cost grows with q
    for _ in range(200):
        mid = (lo + hi) / 2
        if float((torch.softmax(k * mid, dim=0) * cost).sum()) > budget:
            hi = mid
        else:
            lo = mid
    return torch.softmax(k * lo, dim=0)


def msdnet_thresholds(scores: Scores, budget: float) -> Tensor:
    """Signed thresholds that send MSDNet's shares of the validation samples out at each exit, most
    confident first."""
    n = scores.signed.shape[1]
    shares = msdnet_shares(scores.cost_flops, budget)
    remaining = torch.ones(n, dtype=torch.bool)
    thresholds = []
    for k, row in enumerate(scores.signed):
        pool = row[remaining].sort().values
        take = min(int(round(float(shares[k]) * n)), len(pool))
        if take == 0:
            t = float(row.min()) - 1
        elif take >= len(pool):
            t = float(row.max()) + 1
        else:
            t = float((pool[take - 1] + pool[take]) / 2)
        thresholds.append(t)
        remaining &= row > t
    return torch.tensor(thresholds, dtype=torch.float64)
