"""Learned exit gates (``--criterion learned``): what they see, that their thresholds never see their own fit,
that labels which carry nothing buy nothing, and that real early exit answers as the offline sweep does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_calibrate import _Pick

from anytime.calibrate import CRITERIA, ExitPolicy, calibrate_budget, calibrate_max_drop
from anytime.calibrate.gates import (
    GATE_FEATURES,
    ExitGates,
    cross_fit_scores,
    exit_features,
    fit_gates,
    gate_features,
    row_features,
    shuffled_correctness,
)
from anytime.calibrate.sweeps import learned_scores, scores_of, sweep
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache


def _cache(seed: int, n: int = 1200, k: int = 3, c: int = 10, split: str = "val") -> OutputCache:
    """Exits that grow more often right; a sample is easy or hard throughout (so agreement between exits tells
    something that one exit's confidence does not), and some confident answers are wrong."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, n)
    hardness = rng.uniform(0, 1, n)
    logits = rng.normal(size=(k, n, c)).astype(np.float32) * 1.5
    for step in range(k):
        signal = (1.0 + 1.2 * step) * (1.2 - hardness)
        logits[step, np.arange(n), labels] += (signal * 2.5).astype(np.float32)
    cost = np.array([20, 50, 100][:k], dtype=np.int64)
    return OutputCache(logits, labels, tuple(f"e{i}" for i in range(k)), cost, cost + np.arange(k), 100, split, "m")


def test_the_features_at_an_exit_read_that_exit_and_the_earlier_ones_only():
    logits = torch.randn(3, 50, 6, generator=torch.Generator().manual_seed(0))
    features = gate_features(logits)
    assert features.shape == (3, 50, len(GATE_FEATURES))
    changed = logits.clone()
    changed[2] = torch.randn(50, 6)
    assert torch.equal(gate_features(changed)[:2], features[:2])
    first, state = exit_features(logits[0], None)
    second, _ = exit_features(logits[1][10:], state.keep(torch.arange(10, 50)))  # samples that stayed, as at run time
    assert torch.equal(first, features[0]) and torch.allclose(second, features[1][10:])
    broken = logits.clone()
    broken[0, 3, 2] = float("nan")
    assert torch.isnan(gate_features(broken)[0, 3]).all()
    assert row_features(broken[0, 3].tolist(), None)[0] is None


def test_one_sample_in_python_floats_scores_as_its_row_of_the_batch():
    cache = _cache(10, n=200)
    logits = torch.from_numpy(cache.logits)
    gates = fit_gates(logits, torch.from_numpy(cache.correct()))
    batch = gates.score(logits)
    for n in range(0, 200, 7):
        state = None
        for k in range(2):
            row, state = row_features(logits[k, n].tolist(), state)
            assert row == pytest.approx(gate_features(logits)[k, n].tolist(), abs=1e-12)
            assert gates.score_row(k, row) == pytest.approx(float(batch[k, n]), abs=1e-12)


def test_gates_round_trip_through_json_and_refuse_anything_malformed():
    cache = _cache(0)
    gates = fit_gates(torch.from_numpy(cache.logits), torch.from_numpy(cache.correct()))
    assert gates.num_steps == 3 and ExitGates.from_dict(json.loads(json.dumps(gates.to_dict()))) == gates
    doc = gates.to_dict()
    for broken in ({**doc, "features": ["confidence"]}, {**doc, "bias": [1.0]}, {**doc, "weights": "x"},
                   {k: v for k, v in doc.items() if k != "scale"}):  # fmt: skip
        with pytest.raises(AnytimeError, match="gates"):
            ExitGates.from_dict(broken)


def test_a_samples_cross_fitted_score_never_depends_on_its_own_label():
    cache = _cache(1, n=300)
    logits, correct = torch.from_numpy(cache.logits), torch.from_numpy(cache.correct())
    scores = cross_fit_scores(logits, correct)
    flipped = correct.clone()
    flipped[:, 7] = ~flipped[:, 7]
    again = cross_fit_scores(logits, flipped)
    assert torch.equal(again[:, 7], scores[:, 7])  # sample 7's gates never saw it
    assert not torch.equal(again, scores)  # the others' did
    with pytest.raises(AnytimeError, match="larger validation split"):
        cross_fit_scores(logits[:, :6], correct[:, :6])


def test_learned_gates_beat_the_hand_made_criteria_here_and_shuffled_labels_buy_nothing():
    val, test = _cache(2), _cache(3, split="test")
    hand = {name: calibrate_max_drop(val, max_drop=1.0, criterion=name).policy.evaluate(test)
            for name in CRITERIA if name != "learned"}  # fmt: skip
    best = min(r.mean_flops for r in hand.values())
    learned = calibrate_max_drop(val, max_drop=1.0, criterion="learned").policy.evaluate(test)
    control = calibrate_max_drop(val, max_drop=1.0, criterion="learned", shuffled_gates=True).policy.evaluate(test)
    last = float(test.step_accuracy()[-1])
    assert learned.accuracy >= last - 0.03 and learned.mean_flops < 0.97 * best
    assert control.mean_flops >= 0.98 * best  # no gain from labels that carry nothing
    with pytest.raises(AnytimeError, match="control of the learned"):
        calibrate_max_drop(val, max_drop=1.0, criterion="entropy", shuffled_gates=True)


def test_a_learned_policy_runs_as_its_offline_assignment_and_round_trips():
    val = _cache(4)
    calibration = calibrate_budget(val, budget=0.6, criterion="learned")
    policy = calibration.policy
    assert policy.gates is not None and policy.temperatures is None
    assert ExitPolicy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    test = _cache(5, n=400, split="test")
    x = torch.from_numpy(test.logits).permute(1, 0, 2).contiguous()  # [N, K, C]: exit k answers x[:, k]
    model = _ThreeExits().eval()
    answer = policy.run(model, x)
    assert answer.exits.tolist() == policy.assign(test).tolist()
    assert 0 < int(answer.exits.eq(0).sum()) < 400
    assert torch.equal(answer.predictions, x[torch.arange(400), answer.exits].argmax(1))
    one = [policy.run(model, x[i : i + 1]).exits.item() for i in range(0, 400, 37)]
    assert one == answer.exits[::37].tolist()


def test_every_head_is_paid_under_a_criterion_that_compares_exits():
    val = _cache(6)
    scores, _ = learned_scores(val)
    nobody = torch.full((1, 2), -float("inf"), dtype=torch.float64)
    share = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    assert float(scores.mean_cost(share, nobody != nobody)[0]) == float(val.cost_flops[-1])


def test_a_learned_policy_needs_its_gates_and_only_it_has_them():
    cache = _cache(7)
    gates = fit_gates(torch.from_numpy(cache.logits), torch.from_numpy(cache.correct()))
    with pytest.raises(AnytimeError, match="needs its gates"):
        ExitPolicy("learned", (0.5, 0.5))
    with pytest.raises(AnytimeError, match="needs its gates"):
        ExitPolicy("entropy", (0.5, 0.5), gates=gates)
    with pytest.raises(AnytimeError, match="gates for 3 exits"):
        ExitPolicy("learned", (0.5,), gates=gates)
    with pytest.raises(AnytimeError, match="gates fit on validation"):
        scores_of(cache, "learned")
    with pytest.raises(AnytimeError, match="--temperature"):
        calibrate_max_drop(cache, max_drop=1.0, criterion="learned", temperature=True)


def test_a_sweep_of_the_test_split_fits_the_gates_on_validation():
    val, test = _cache(8), _cache(9, split="test")
    on_test = sweep(test, "learned", settings=50, val=val)
    gates = fit_gates(torch.from_numpy(val.logits), torch.from_numpy(val.correct()))
    assert on_test.criterion == "learned" and on_test.accuracy[0] == pytest.approx(float(test.step_accuracy()[-1]))
    assert np.array_equal(ExitPolicy("learned", (None, None), gates=gates).assign(test), np.full(test.num_samples, 2))
    assert shuffled_correctness(torch.from_numpy(val.correct())).sum(1).tolist() == val.correct().sum(1).tolist()


class _ThreeExits(torch.nn.Module):
    """Exit k answers with ``x[:, k]``: every answer is chosen by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList([_Pick(0), _Pick(1)])
        self.segments = (torch.nn.Identity(), torch.nn.Identity(), _Pick(2))
