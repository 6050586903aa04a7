"""Uncertainty and summary numbers (anytime.utils.stats) on cases whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from anytime.profile.stats import latency_summary, quantile_of
from anytime.utils.stats import area_under_front, bootstrap_quantile, quantile_upper_bound, wilson


def test_wilson_matches_the_textbook_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    assert wilson(9000, 10000)[1] - wilson(9000, 10000)[0] < wilson(90, 100)[1] - wilson(90, 100)[0]


def test_bootstrap_intervals_are_seeded_and_hold_the_estimate():
    samples = np.random.default_rng(1).lognormal(0.0, 0.3, 500)
    for q in (0.5, 0.99):
        lo, hi = bootstrap_quantile(samples, q)
        assert lo <= quantile_of(samples, q) <= hi and lo < hi
        assert bootstrap_quantile(samples, q) == (lo, hi)  # the same profile reads the same twice
    constant = np.full(50, 2.0)
    assert bootstrap_quantile(constant, 0.99) == (2.0, 2.0)
    summary = latency_summary(samples / 1000)
    assert summary["p99_ci95_ms"][0] <= summary["p99_ms"] <= summary["p99_ci95_ms"][1]


def test_a_quantiles_upper_bound_is_an_order_statistic_that_covers_it():
    ranks = np.arange(1.0, 1001.0)
    # Of 1,000 draws, fewer than 996 fall below the p99 with probability >= 95% (binomial, mean 990, sd 3.1).
    assert quantile_upper_bound(ranks, 0.99) == 996.0 and quantile_of(ranks, 0.99) == 990.0
    assert quantile_upper_bound(ranks[:299], 0.99) == 299.0  # the largest of 299: 1 - 0.99**299 >= 95%
    assert quantile_upper_bound(ranks[:298], 0.99) == np.inf and quantile_upper_bound(ranks[:0], 0.5) == np.inf
    rng = np.random.default_rng(0)  # over 500 samples of 1,000 exponential draws, the bound covers the p99 >= 95%
    true_p99 = -np.log(0.01)
    covered = np.mean([quantile_upper_bound(rng.exponential(size=1000), 0.99) >= true_p99 for _ in range(500)])
    assert 0.95 <= covered < 1.0


def test_area_under_a_front_is_the_mean_best_accuracy_over_budgets():
    # One point at cost 0.5 (accuracy 0.6) and one at 1.0 (0.9): 0.6 across the whole range [0.5, 1].
    assert area_under_front(np.array([0.5, 1.0]), np.array([0.6, 0.9])) == pytest.approx(0.6)
    # Points at 0.2 (0.5) and 0.6 (0.8): 0.5 over [0.2, 0.6), 0.8 over [0.6, 1] -> (0.4*0.5 + 0.4*0.8) / 0.8.
    assert area_under_front(np.array([0.6, 0.2]), np.array([0.8, 0.5])) == pytest.approx(0.65)
    # A dominated point changes nothing; a point at the top of the range adds nothing.
    assert area_under_front(np.array([0.2, 0.4, 0.6]), np.array([0.5, 0.4, 0.8])) == pytest.approx(0.65)
    assert area_under_front(np.array([1.0]), np.array([0.9])) == 0.0


def test_reliability_calibration_error_and_class_accuracy_on_known_cases():
    from anytime.utils.stats import class_accuracy, expected_calibration_error, reliability, softmax

    labels = np.array([0, 1, 0, 1])
    assert expected_calibration_error(np.eye(2)[labels], labels) == 0.0  # sure and right
    unsure = np.array([[0.8, 0.2], [0.2, 0.8], [0.2, 0.8], [0.8, 0.2]])  # 80% sure, half right
    assert expected_calibration_error(unsure, labels) == pytest.approx(0.3)
    conf, acc, counts = reliability(unsure, labels)
    assert counts.sum() == 4 and np.nanmax(conf) == pytest.approx(0.8) and np.nanmax(acc) == pytest.approx(0.5)
    np.testing.assert_allclose(softmax(np.array([[0.0, np.log(3.0)]])), [[0.25, 0.75]])
    logits = np.stack([np.eye(3)[[0, 1, 1, 2]], np.eye(3)[[0, 1, 2, 0]]])  # two steps, four samples
    table = class_accuracy(logits, np.array([0, 1, 2, 2]), 4)
    np.testing.assert_allclose(table[:, :3], [[1, 1, 0.5], [1, 1, 0.5]])
    assert np.isnan(table[:, 3]).all()  # a class with no sample


def test_a_paired_ratio_is_the_rounds_median_with_an_order_statistic_interval():
    from anytime.utils.stats import paired_ratio

    rng = np.random.default_rng(0)
    base = rng.normal(1.0, 0.05, 1000)
    slower = base * 1.03 + rng.normal(0.0, 0.02, 1000)
    paired = paired_ratio(slower, base, 50)
    assert paired.rounds == 20 and paired.low <= paired.median <= paired.high and paired.low > 1.0
    assert abs(paired.median - 1.03) < 0.01
    ratios = sorted(slower[i * 50 : (i + 1) * 50].mean() / base[i * 50 : (i + 1) * 50].mean() for i in range(20))
    assert (paired.low, paired.high) == pytest.approx((ratios[5], ratios[14]))  # 20 rounds: the 6th and 15th
    few = paired_ratio(slower[:250], base[:250], 50)
    assert few.rounds == 5 and (few.low, few.high) == (-math.inf, math.inf)  # 5 rounds cannot give 95%
    with pytest.raises(ValueError):
        paired_ratio(slower[:10], base[:10], 50)


def test_an_evaluations_paired_speedup_is_written_as_standard_json():
    import json

    from anytime.tasks.evaluation import LatencyComparison, LatencyFigures
    from anytime.utils.stats import paired_ratio

    rng = np.random.default_rng(2)
    backbone, early = rng.normal(2e-3, 1e-4, 250), rng.normal(1e-3, 1e-4, 250)
    figures = LatencyFigures.of(early), LatencyFigures.of(backbone)
    few = LatencyComparison(*figures, turn=50, paired=paired_ratio(backbone, early, 50)).to_dict()["paired_speedup"]
    assert few["rounds"] == 5 and few["low"] is None and few["high"] is None and few["median"] > 1.5
    json.dumps(few, allow_nan=False)
    many = LatencyComparison(*figures, turn=10, paired=paired_ratio(backbone, early, 10)).to_dict()["paired_speedup"]
    assert many["rounds"] == 25 and many["low"] <= many["median"] <= many["high"]
