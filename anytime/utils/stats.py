"""Uncertainty and summary numbers on numpy alone: a proportion's Wilson interval, a quantile's bootstrap interval
and distribution-free upper bound, a paired ratio's median over rounds with its interval, and the area under an
accuracy-vs-cost curve."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairedRatio:
    """A ratio of two ways of answering timed in interleaved rounds: the rounds' median ratio, a distribution-free
    95% interval of that median (``-inf, inf`` when there are too few rounds for one: under 6), and the rounds."""

    median: float
    low: float
    high: float
    rounds: int


def paired_ratio(numerator: np.ndarray, denominator: np.ndarray, per_round: int, level: float = 0.95) -> PairedRatio:
    """``numerator``'s time over ``denominator``'s, round by round: both hold per-batch times in the order they ran
    (turns of ``per_round`` batches taken in alternation, as ``per_sample_latency`` times them), a round's ratio is
    of the two turns' means, and the interval of the rounds' median is read from their order statistics (the
    binomial), so no round's noise needs a model. ``ValueError`` when there is not one round."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    rounds = min(a.size, b.size) // per_round if per_round >= 1 else 0
    if rounds < 1:
        raise ValueError(f"{min(a.size, b.size)} timings make no round of {per_round}")
    ratios = np.sort(a[: rounds * per_round].reshape(rounds, per_round).mean(axis=1)
                     / b[: rounds * per_round].reshape(rounds, per_round).mean(axis=1))  # fmt: skip
    # The largest j with P(Binomial(n, 1/2) < j) <= (1 - level) / 2: ratios[j - 1] .. ratios[n - j] cover the median.
    tail, below, j = (1 - level) / 2, 0.0, 0
    while j < rounds and below + math.comb(rounds, j) / 2.0**rounds <= tail:
        below += math.comb(rounds, j) / 2.0**rounds
        j += 1
    low, high = (float(ratios[j - 1]), float(ratios[rounds - j])) if j >= 1 else (-math.inf, math.inf)
    return PairedRatio(float(np.median(ratios)), low, high, rounds)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default); ``(0, 1)`` when there is no sample."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_quantile(
    samples: np.ndarray, q: float, *, resamples: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of the ``q`` quantile of ``samples`` (seeded, so a profile reads the same
    twice). Quantiles as :func:`anytime.profile.stats.quantile_of`: the inverted empirical CDF."""
    values = np.asarray(samples, dtype=np.float64)
    if values.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    index = min(values.size - 1, max(0, math.ceil(q * values.size - 1e-9) - 1))
    draws = values[rng.integers(0, values.size, size=(resamples, values.size))]
    estimates = np.partition(draws, index, axis=1)[:, index]
    tail = (1 - level) / 2
    return (float(np.quantile(estimates, tail)), float(np.quantile(estimates, 1 - tail)))


def quantile_upper_bound(samples: np.ndarray, q: float, *, confidence: float = 0.95) -> float:
    """A distribution-free upper confidence bound of the ``q`` quantile of ``samples``: the smallest order
    statistic that lies at or above the true quantile with probability at least ``confidence`` (the r-th smallest
    of n, where fewer than r of n draws falling below the quantile has that probability: a binomial tail). Infinite
    when the sample is too small for any (a p99 from fewer than 299 samples at 95%)."""
    values = np.sort(np.asarray(samples, dtype=np.float64))
    n = values.size
    if n == 0:
        return math.inf
    k = np.arange(n + 1)
    log_pmf = (math.lgamma(n + 1) - np.array([math.lgamma(i + 1) + math.lgamma(n - i + 1) for i in k])
               + k * math.log(q) + (n - k) * math.log1p(-q))  # fmt: skip
    below = np.cumsum(np.exp(log_pmf))  # below[r - 1]: P(at most r - 1 of n draws fall below the quantile)
    reached = np.nonzero(below[:n] >= confidence)[0]
    return float(values[reached[0]]) if reached.size else math.inf


def area_under_front(cost: np.ndarray, accuracy: np.ndarray, *, high: float = 1.0) -> float:
    """The mean best accuracy over cost budgets from the cheapest point's cost to ``high``: for each budget, the most
    accurate point that costs no more (a step curve), integrated and divided by the budgets' range. One number per
    curve (1 would be perfect accuracy at every budget); 0 when the range is empty."""
    order = np.argsort(cost, kind="stable")
    c = np.asarray(cost, dtype=np.float64)[order]
    best = np.maximum.accumulate(np.asarray(accuracy, dtype=np.float64)[order])
    low = float(c[0])
    if high <= low:
        return 0.0
    edges = np.append(np.clip(c, low, high), high)
    return float(np.sum(best * np.diff(edges)) / (high - low))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64."""
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reliability(
    probabilities: np.ndarray, labels: np.ndarray, bins: int = 15
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width confidence bin: the mean confidence, the accuracy and the count (NaN for an empty bin)."""
    confidence = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == labels
    which = np.clip(np.digitize(confidence, np.linspace(0.0, 1.0, bins + 1)[1:-1]), 0, bins - 1)
    counts = np.bincount(which, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(which, weights=confidence, minlength=bins) / counts
        accuracy = np.bincount(which, weights=correct.astype(np.float64), minlength=bins) / counts
    return mean_conf, accuracy, counts


def expected_calibration_error(probabilities: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """ECE: the mean |accuracy - confidence| over equal-width confidence bins, weighted by their counts."""
    mean_conf, accuracy, counts = reliability(probabilities, labels, bins)
    filled = counts > 0
    return float(np.sum(counts[filled] * np.abs(accuracy[filled] - mean_conf[filled])) / max(int(counts.sum()), 1))


def class_accuracy(logits: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``[K, C]``: the accuracy of every step on the samples of every class (NaN for a class with no sample)."""
    correct = np.asarray(logits).argmax(axis=-1) == labels[None, :]
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.stack([np.bincount(labels, weights=c.astype(np.float64), minlength=num_classes) / counts
                         for c in correct])  # fmt: skip
