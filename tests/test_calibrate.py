"""Criteria, sweeps, the oracle and calibration, on hand-made and random caches (no network involved)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from anytime.calibrate import (
    CRITERIA,
    ExitPolicy,
    calibrate_budget,
    calibrate_max_drop,
    fit_temperatures,
    get_criterion,
    msdnet_shares,
    oracle,
    sweep,
)
from anytime.calibrate.sweeps import evaluate_settings, learned_scores, scores_of, shared_grid, sweep_shared
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache


def _logit(p: float, right: bool) -> list[float]:
    z = math.log(p / (1 - p))
    return [z, 0.0] if right else [0.0, z]  # class 0 is the label


def hand_made() -> OutputCache:
    """3 exits x 4 samples, 2 classes; confidences and rightness chosen by hand (label 0 everywhere)."""
    table = [
        [(0.9, True), (0.6, False), (0.95, False), (0.55, True)],
        [(0.8, True), (0.9, True), (0.7, False), (0.6, True)],
        [(0.99, True), (0.99, True), (0.99, True), (0.99, False)],
    ]
    logits = np.array([[_logit(p, r) for p, r in row] for row in table], dtype=np.float32)
    return OutputCache(
        logits=logits, labels=np.zeros(4, dtype=np.int64), step_names=("a", "b", "out"),
        step_flops=np.array([10, 20, 30]), cost_flops=np.array([10, 20, 30]), base_flops=30, split="val",
        model_fingerprint="hand",
    )  # fmt: skip


def random_cache(seed: int = 0, k: int = 4, n: int = 500, c: int = 10) -> OutputCache:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, n)
    logits = rng.normal(size=(k, n, c)).astype(np.float32)
    for step in range(k):  # later exits are more often right and more confident
        logits[step, np.arange(n), labels] += 1.0 + step
    cost = np.cumsum(rng.integers(5, 20, k))
    return OutputCache(logits, labels, tuple(f"e{i}" for i in range(k)), cost, cost + 1, int(cost[-1]), "val", "rnd")


def test_the_hand_made_cache_right_to_the_sample():
    cache = hand_made()
    scores = scores_of(cache, "confidence")
    settings = torch.tensor([[-0.85, -0.85], [-math.inf, -0.65]], dtype=torch.float64)  # signed: -confidence
    acc, cost, share = evaluate_settings(scores, settings)
    assert acc.tolist() == [0.5, 0.5]
    assert cost.tolist() == [17.5, 22.5]
    assert share.tolist() == [[0.5, 0.25, 0.25], [0.0, 0.75, 0.25]]
    policy = ExitPolicy("confidence", (0.85, 0.85))
    assert policy.assign(cache).tolist() == [0, 1, 0, 2]
    result = policy.evaluate(cache)
    assert (result.accuracy, result.mean_flops, result.exit_share) == (0.5, 17.5, (0.5, 0.25, 0.25))
    assert ExitPolicy("confidence", (None, 0.65)).assign(cache).tolist() == [1, 1, 1, 2]


def test_the_oracle_on_the_hand_made_cache():
    o = oracle(hand_made())
    assert o.accuracy == 1.0 and o.mean_flops == 17.5
    assert o.exit_share.tolist() == [0.5, 0.25, 0.25]


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_shared_sweep_equals_the_general_one(criterion, seed):
    cache = random_cache(seed)
    scores = learned_scores(cache)[0] if criterion == "learned" else scores_of(cache, criterion)
    grid = shared_grid(scores, 300)
    fast = sweep_shared(scores, grid[:, 0].contiguous())
    slow = evaluate_settings(scores, grid)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[2], slow[2])
    assert torch.allclose(fast[1], slow[1])


def test_sweep_spans_from_last_exit_to_first():
    cache = random_cache()
    result = sweep(cache, "entropy", settings=200)
    assert result.exit_share[0].tolist() == [0, 0, 0, 1]  # nobody leaves early
    assert result.exit_share[-1][0] == 1  # everybody leaves at the first exit
    assert result.accuracy[0] == pytest.approx(cache.step_accuracy()[-1])
    assert np.isnan(result.thresholds[0]).all()
    assert np.allclose(result.exit_share.sum(axis=1), 1)


def test_pareto_front_is_non_dominated_and_sorted():
    result = sweep(random_cache(), "confidence", settings=300)
    front = result.pareto()
    assert np.all(np.diff(result.mean_flops[front]) > 0) and np.all(np.diff(result.accuracy[front]) > 0)
    for i in range(len(result.accuracy)):
        dominated_or_on = np.any((result.mean_flops[front] <= result.mean_flops[i]) &
                                 (result.accuracy[front] >= result.accuracy[i]))  # fmt: skip
        assert dominated_or_on


def test_criteria_values():
    uniform = torch.zeros(1, 10)
    peaked = torch.tensor([[10.0, 0.0, 0.0]])
    assert get_criterion("entropy").score(uniform).item() == pytest.approx(math.log(10))
    assert get_criterion("normalized-entropy").score(uniform).item() == pytest.approx(1.0)
    assert get_criterion("confidence").score(uniform).item() == pytest.approx(0.1)
    assert get_criterion("margin").score(uniform).item() == pytest.approx(0.0)
    p = torch.softmax(peaked.double(), dim=1)[0]
    assert get_criterion("margin").score(peaked).item() == pytest.approx(float(p[0] - p[1]))
    assert get_criterion("confidence").score(peaked, 2.0).item() == pytest.approx(
        float(torch.softmax(peaked.double() / 2, dim=1).max())
    )


@pytest.mark.parametrize("criterion", ["entropy", "normalized-entropy", "confidence", "margin"])
def test_one_sample_scored_in_python_floats_agrees_with_the_tensor_score(criterion):
    crit = get_criterion(criterion)
    generator = torch.Generator().manual_seed(7)
    for i, classes in enumerate([2, 10, 100, 10, 128]):
        logits = torch.randn(1, classes, generator=generator) * (1 + 10 * i)  # up to peaked: probabilities of 0
        for temperature in (1.0, 0.3, 2.5):
            expected = float(crit.score(logits, temperature))
            assert crit.score_row(logits[0].tolist(), temperature) == pytest.approx(expected, rel=1e-12, abs=1e-14)
    inf, nan = math.inf, math.nan
    for row in ([nan, 1.0, 2.0], [1.0, nan, 2.0], [inf, 1.0, 2.0], [1.0, inf, inf], [-inf, -inf, -inf]):
        assert math.isnan(float(crit.score(torch.tensor([row]), 1.0)))
        assert math.isnan(crit.score_row(row)), row  # an entropy of 0 would let the sample leave
    with pytest.raises(AnytimeError, match="patience compares exits"):
        get_criterion("patience").score_row([0.0, 1.0])


def test_the_one_sample_decision_agrees_with_the_batch_decision():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(400, 10, generator=generator) * 3
    for criterion in ("entropy", "confidence", "margin"):
        scores = get_criterion(criterion).score(logits, 1.7)
        threshold = float(torch.quantile(scores, 0.4))
        policy = ExitPolicy(criterion, (threshold,), temperatures=(1.7, 1.0))
        batch = policy.confident(0, logits)
        assert batch is not None and 0 < int(batch.sum()) < 400
        assert [policy.leaves(0, row[None]) for row in logits] == batch.tolist()


class _Pick(torch.nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.k]


class _TwoExits(torch.nn.Module):
    """Exit 0 answers with ``x[:, 0]``, the last exit with ``x[:, 1]``: every answer is chosen by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList([_Pick(0)])
        self.segments = (torch.nn.Identity(), _Pick(1))


@pytest.mark.parametrize("classes", [10, 200])  # up to 128 classes one sample is scored in Python floats
@pytest.mark.parametrize("criterion", ["entropy", "normalized-entropy", "confidence", "margin"])
def test_one_sample_answers_as_its_row_of_the_batch(criterion, classes):
    # At batch 1 an exit's logits are read as Python floats, which also give the leaving sample its class; ties,
    # impossible classes (-inf), NaN and +inf must answer as the batch path, which computes in tensors.
    generator = torch.Generator().manual_seed(9)
    first = torch.randn(40, classes, generator=generator) * 4
    first[0, :] = -30.0
    first[0, 2] = first[0, 7] = 5.0  # a tie at the top
    first[1, 3:] = -math.inf
    first[2, 4] = math.nan
    first[3, 5] = math.inf
    x = torch.stack([first, torch.randn(40, classes, generator=generator)], dim=1)
    crit = get_criterion(criterion)
    signed = crit.signed(crit.score(first, 1.0))
    limit = float(torch.quantile(signed[4:], 0.5))
    if criterion != "margin":  # a tie has no margin: it never leaves under that criterion
        limit = max(limit, float(signed[0]))
    policy = ExitPolicy(criterion, (limit,))
    model = _TwoExits().eval()
    batch = policy.run(model, x)
    assert 0 < int(batch.exits.eq(0).sum()) < 40
    assert batch.exits[2:4].tolist() == [1, 1]  # a NaN or +inf logit never leaves
    if criterion != "margin":
        assert batch.exits[0].item() == 0 and batch.predictions[0].item() == 2  # the first of the tied classes
    runner = policy.runner(model)  # the same answers, bound once
    for i in range(40):
        for one in (policy.run(model, x[i : i + 1]), runner(x[i : i + 1])):
            assert one.exits.tolist() == batch.exits[i : i + 1].tolist(), i
            assert one.predictions.tolist() == batch.predictions[i : i + 1].tolist(), i
            assert one.predictions.dtype == one.exits.dtype == torch.long
            assert torch.equal(one.logits, batch.logits[i : i + 1])


def test_a_runner_answers_as_run_and_takes_runs_way_where_it_is_not_one_sample_on_the_cpu():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(30, 2, 10, generator=generator) * 3
    model = _TwoExits().eval()
    middle = get_criterion("entropy").score(x[:, 0], 1.0).sort().values[14:16].mean()  # no sample on the threshold
    policy = ExitPolicy("entropy", (float(middle),))
    runner = policy.runner(model)
    whole = runner(x)  # a batch: run's way
    assert torch.equal(whole.exits, policy.run(model, x).exits) and 0 < int(whole.exits.sum()) < 30
    with torch.inference_mode():
        inside = [runner(x[i : i + 1]) for i in range(30)]
    outside = [runner(x[i : i + 1]) for i in range(30)]  # run enters inference mode itself
    for i, (a, b) in enumerate(zip(inside, outside)):
        assert a.exits.tolist() == b.exits.tolist() == whole.exits[i : i + 1].tolist()
        assert a.predictions.tolist() == b.predictions.tolist() == whole.predictions[i : i + 1].tolist()
    model.train()  # after the runner was made: refused as run refuses it
    with pytest.raises(AnytimeError, match="eval mode"):
        runner(x[:1])
    with pytest.raises(AnytimeError, match="for 3 exits; the model has 2"):
        ExitPolicy("entropy", (0.5, 0.5)).runner(model.eval())(x[:1])
    streak = ExitPolicy("patience", (1.0,)).runner(model)
    assert torch.equal(streak(x[:1]).exits, ExitPolicy("patience", (1.0,)).run(model, x[:1]).exits)


def test_max_drop_calibration_meets_its_target_and_saves():
    cache = random_cache(n=2000)
    last = cache.step_accuracy()[-1]
    for drop in (0.0, 1.0, 5.0):
        cal = calibrate_max_drop(cache, max_drop=drop)
        assert cal.fit.accuracy >= last - drop / 100 - 1e-12
        assert cal.fit.mean_flops <= cache.cost_flops[-1]
    assert (
        calibrate_max_drop(cache, max_drop=5.0).fit.mean_flops < calibrate_max_drop(cache, max_drop=0.0).fit.mean_flops
    )


def test_budget_calibration_stays_within_budget():
    cache = random_cache(n=2000)
    for fraction in (0.4, 0.6, 0.9):
        cal = calibrate_budget(cache, budget=fraction)
        assert cal.fit.mean_flops <= fraction * cache.base_flops + 1e-9
    msd = calibrate_budget(cache, budget=0.6, rule="msdnet")
    assert msd.fit.mean_flops == pytest.approx(0.6 * cache.base_flops, rel=0.05)


def test_msdnet_shares_follow_a_geometric_law_and_the_budget():
    cost = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    shares = msdnet_shares(cost, 2.0)
    assert float(shares.sum()) == pytest.approx(1.0)
    assert float((shares * cost).sum()) == pytest.approx(2.0, abs=1e-9)
    ratios = (shares[1:] / shares[:-1]).tolist()
    assert max(ratios) - min(ratios) < 1e-9  # p_k proportional to q^k


def test_impossible_budget_is_refused():
    with pytest.raises(AnytimeError, match="below the first exit"):
        calibrate_budget(random_cache(), budget=0.01)


@pytest.mark.parametrize("budget", [float("nan"), -1.0, 0.0])
def test_nonsense_budget_is_refused(budget):
    with pytest.raises(AnytimeError, match="--budget-flops"):
        calibrate_budget(random_cache(), budget=budget)


@pytest.mark.parametrize("drop", [float("nan"), -1.0, 101.0])
def test_nonsense_max_drop_is_refused(drop):
    with pytest.raises(AnytimeError, match="--max-drop"):
        calibrate_max_drop(random_cache(), max_drop=drop)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (lambda: ExitPolicy("entropy", (float("nan"), 0.1, 0.1)), "finite"),
        (lambda: ExitPolicy("perplexity", (0.1, 0.1, 0.1)), "unknown exit criterion"),
        (lambda: ExitPolicy("entropy", (0.1, 0.1, 0.1), temperatures=(1.0, 1.0)), "temperatures"),
        (lambda: ExitPolicy("entropy", (0.1, 0.1, 0.1), temperatures=(1.0, 1.0, -1.0, 1.0)), "positive"),
    ],
)
def test_malformed_policies_are_refused(policy, message):
    with pytest.raises(AnytimeError, match=message):
        policy()


def test_thresholds_out_of_range_or_miscounted_are_refused():
    cache = random_cache()
    with pytest.raises(AnytimeError, match="outside"):
        ExitPolicy("confidence", (1.5, 0.5, 0.5)).evaluate(cache)
    with pytest.raises(AnytimeError, match="outside"):
        ExitPolicy("entropy", (0.5, 3.0, 0.5)).evaluate(cache)  # log(10) = 2.30 is the most entropy can be
    with pytest.raises(AnytimeError, match="exits"):
        ExitPolicy("entropy", (0.5, 0.5)).evaluate(cache)


def test_policy_round_trips_through_json_values():
    policy = ExitPolicy("margin", (0.3, None, 0.1), temperatures=(1.0, 2.0, 0.5, 1.0))
    assert ExitPolicy.from_dict(policy.to_dict()) == policy
    with pytest.raises(AnytimeError, match="not a valid exit policy"):
        ExitPolicy.from_dict({"thresholds": [0.1]})


def test_temperature_scaling_lowers_the_nll():
    cache = random_cache(n=2000)
    logits = torch.from_numpy(cache.logits).double()
    labels = torch.from_numpy(cache.labels)
    base = fit_temperatures(logits, labels)
    sharp = fit_temperatures(logits * 3, labels)  # logits 3x too confident want a 3x higher temperature
    for k, t in enumerate(sharp):
        before = torch.nn.functional.cross_entropy(logits[k] * 3, labels)
        after = torch.nn.functional.cross_entropy(logits[k] * 3 / t, labels)
        assert after <= before
        assert t / base[k] == pytest.approx(3, rel=0.02)


def test_calibration_with_temperatures_is_saved_in_the_policy():
    cal = calibrate_max_drop(random_cache(), max_drop=1.0, temperature=True)
    assert cal.policy.temperatures is not None and len(cal.policy.temperatures) == 4


def test_a_sweep_of_1000_settings_over_10000_samples_runs():
    result = sweep(random_cache(n=10_000, k=5), "entropy", settings=1000)
    assert result.accuracy.shape == (1000,) and result.exit_share.shape == (1000, 5)


def test_exit_selection_drops_an_exit_whose_head_costs_more_than_it_saves():
    from anytime.calibrate import measured_costs, select_exits

    cache = random_cache(seed=3, k=4, n=600)
    cheap_heads = measured_costs([1.0, 2.0, 3.0, 4.0], [1.0, 1.05, 1.05, 1.05])  # heads of 0.05 ms
    steep_head = measured_costs([1.0, 2.0, 3.0, 4.0], [1.0, 1.05, 3.05, 1.05])  # exit 1's head: 2 ms
    calibration, tried = select_exits(cache, max_drop=1.0, costs=cheap_heads)
    assert len(tried) == 8 and {t.exits for t in tried} == {(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)}
    best = min(tried, key=lambda t: t.mean_ms)
    assert best.reaches_target and best.mean_ms < 4.0
    kept = tuple(k for k, t in enumerate(calibration.policy.thresholds) if t is not None)
    assert kept == best.exits
    target = float(cache.step_accuracy()[-1]) - 0.01
    assert calibration.fit.accuracy >= target - 1e-12
    _, tried_steep = select_exits(cache, max_drop=1.0, costs=steep_head)
    with_one = min((t for t in tried_steep if 1 in t.exits), key=lambda t: t.mean_ms)
    without_one = min((t for t in tried_steep if 1 not in t.exits), key=lambda t: t.mean_ms)
    assert without_one.mean_ms < with_one.mean_ms  # a 2 ms head is never worth it here
    nothing = next(t for t in tried if t.exits == ())
    assert nothing.mean_ms == pytest.approx(4.0) and nothing.accuracy == pytest.approx(cache.step_accuracy()[-1])


def test_measured_costs_pay_every_earlier_head_and_clip_noise():
    from anytime.calibrate import measured_costs

    step, through = measured_costs([1.0, 2.0, 3.0], [1.0, 1.5, 1.5])
    assert step.tolist() == [1.0, 2.0, 3.0] and through.tolist() == [1.0, 2.5, 4.0]
    step, through = measured_costs([1.0, 2.2, 3.0], [1.0, 1.0, 1.5])  # noise: exit 1 through = 2.0 < alone 2.2
    assert (through >= step).all() and torch.all(torch.diff(through - step) >= 0)


def test_selecting_exits_needs_an_accuracy_target_and_matching_latencies():
    from anytime.calibrate import measured_costs, select_exits

    with pytest.raises(AnytimeError, match="profile this run again"):
        select_exits(random_cache(k=4), max_drop=1.0, costs=measured_costs([1.0, 2.0], [1.0, 1.0]))


def test_combined_exits_are_the_weighted_sum_of_log_probabilities():
    from anytime.calibrate.combine import combine_logits

    cache = random_cache(k=3, n=20)
    weights = ((1.0,), (0.5, 2.0), (0.0, 0.25, 1.5))
    got = combine_logits(torch.from_numpy(cache.logits), weights)
    lp = torch.log_softmax(torch.from_numpy(cache.logits).double(), dim=-1)
    expected = torch.stack([lp[0], 0.5 * lp[0] + 2.0 * lp[1], 0.25 * lp[1] + 1.5 * lp[2]]).float()
    assert torch.allclose(got, expected, atol=1e-6)


def test_fitted_combination_weights_lower_each_exits_nll_and_respect_members():
    from anytime.calibrate.combine import combine_logits, fit_weights

    cache = random_cache(seed=3, k=4, n=2000)
    logits, labels = torch.from_numpy(cache.logits), torch.from_numpy(cache.labels)
    weights = fit_weights(logits, labels)
    assert [len(row) for row in weights] == [1, 2, 3, 4] and all(w >= 0 for row in weights for w in row)
    combined = combine_logits(logits, weights).double()
    nll = torch.nn.functional.cross_entropy
    for k in range(4):
        assert nll(combined[k], labels) <= nll(logits[k].double(), labels) + 1e-9
    # independent noise per exit: an ensemble of exits is better than the last alone
    assert nll(combined[3], labels) < nll(logits[3].double(), labels) - 0.01
    only = fit_weights(logits, labels, members=[1])
    assert only[0] == (0.0,) and only[2] == (0.0, 0.0, 0.0) and only[3][0] == only[3][2] == 0
    assert only[1][1] > 0 and only[3][1] > 0 and only[3][3] > 0


def test_combined_calibration_meets_the_plain_last_exits_target_and_pays_every_weighed_head():
    cache = random_cache(seed=5, k=4, n=2000)
    cache = dataclasses.replace(cache, step_flops=np.array([10, 20, 30, 40]), cost_flops=np.array([10, 22, 34, 46]),
                                base_flops=40)  # every head costs 2  # fmt: skip
    plain_last = float(cache.step_accuracy()[-1])
    result = calibrate_max_drop(cache, max_drop=2.0, combine=True)
    assert result.policy.combine is not None and result.policy.temperatures is None
    assert result.fit.accuracy >= plain_last - 0.02 - 1e-12
    assert result.fit.flops_ratio < calibrate_max_drop(cache, max_drop=0.0, combine=True).fit.flops_ratio
    seen = result.policy.seen_by(cache)
    assert np.array_equal(seen.step_flops, seen.cost_flops)
    assert seen.step_flops.tolist() == (cache.cost_flops).tolist()  # every head weighs in here, so every one is paid
    budget = calibrate_budget(cache, budget=0.6, combine=True)
    assert budget.policy.combine is not None and budget.fit.flops_ratio <= 0.6 + 1e-9


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ExitPolicy("entropy", (0.1,), combine=((1.0,),)), "rows for 2 exits"),
        (lambda: ExitPolicy("entropy", (0.1,), combine=((1.0,), (1.0,))), "needs 2"),
        (lambda: ExitPolicy("entropy", (0.1,), combine=((1.0,), (-1.0, 1.0))), ">= 0"),
        (lambda: ExitPolicy("entropy", (0.1,), combine=((1.0,), (1.0, 0.0))), "must be positive"),
        (lambda: ExitPolicy("entropy", (0.1, None), combine=((1.0,), (1.0, 0.0), (1.0, 1.0, 1.0))), "must be positive"),
        (lambda: ExitPolicy("entropy", (0.1,), combine=((0.0,), (1.0, 1.0))), "no combination weights"),
        (lambda: ExitPolicy("entropy", (0.1,), (1.0, 1.0), combine=((1.0,), (1.0, 1.0))), "no temperatures"),
        (lambda: ExitPolicy("patience", (1.0,), combine=((1.0,), (1.0, 1.0))), "does not combine"),
        (lambda: calibrate_max_drop(random_cache(), max_drop=1, temperature=True, combine=True), "--temperature"),
    ],
)
def test_malformed_combinations_are_refused(make, message):
    with pytest.raises(AnytimeError, match=message):
        make()


def test_a_combining_policy_round_trips_through_json_values():
    policy = ExitPolicy("margin", (0.3, None), combine=((1.0,), (0.5, 1.0), (0.1, 0.2, 1.3)))
    assert ExitPolicy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    assert ExitPolicy.from_dict(ExitPolicy("margin", (0.3, None)).to_dict()).combine is None


def test_exit_selection_with_combined_exits_weighs_only_the_kept_exits_and_pays_their_heads():
    from anytime.calibrate import measured_costs, select_exits

    cache = random_cache(seed=3, k=4, n=600)
    steep_head = measured_costs([1.0, 2.0, 3.0, 4.0], [1.0, 1.05, 3.05, 1.05])  # exit 1's head: 2 ms
    calibration, tried = select_exits(cache, max_drop=1.0, costs=steep_head, combine=True)
    assert len(tried) == 8
    policy = calibration.policy
    kept = min(tried, key=lambda t: t.mean_ms).exits
    for k in range(3):  # a dropped exit has no threshold, no weight anywhere and no head run
        dropped = k not in kept
        assert (policy.thresholds[k] is None) >= dropped
        assert policy.runs_head(k) is not dropped
        assert all(policy.combine[row][k] == 0 for row in range(k, 4)) is dropped
    nothing = next(t for t in tried if t.exits == ())
    assert nothing.mean_ms == pytest.approx(4.0)  # no early head: the backbone alone
    assert calibration.fit.accuracy >= float(cache.step_accuracy()[-1]) - 0.01 - 1e-12


def test_combination_weights_stay_finite_and_bounded():
    from anytime.calibrate.combine import fit_weights

    cache = random_cache(seed=3, k=4, n=600)  # unbounded, the line search's steps overflowed to NaN on exit 1 here
    weights = fit_weights(torch.from_numpy(cache.logits), torch.from_numpy(cache.labels), members=(0, 1))
    assert all(math.isfinite(w) and 0 <= w <= math.exp(4) + 1e-6 for row in weights for w in row)
    assert weights[1][0] > 0 and weights[1][1] > 0
