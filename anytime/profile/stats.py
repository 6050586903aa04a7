"""Latency statistics on numpy alone: the scheduler's query path reads them without importing torch."""

from __future__ import annotations

import math

import numpy as np


def quantile_of(samples: np.ndarray, q: float, weights: np.ndarray | None = None) -> float:
    """The ``q`` quantile of a (weighted) sample: the smallest value with at least ``q`` of the mass at or
    below it (the inverted empirical CDF, so a p99 of 100 samples is the 99th smallest, never an
    interpolation below an observed value)."""
    order = np.argsort(samples, kind="stable")
    values = np.asarray(samples, dtype=np.float64)[order]
    if weights is None:
        index = max(0, math.ceil(q * values.size - 1e-9) - 1)
        return float(values[min(index, values.size - 1)])
    mass = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    index = int(np.searchsorted(mass, q * mass[-1] - 1e-12, side="left"))
    return float(values[min(index, values.size - 1)])


def latency_summary(seconds: np.ndarray) -> dict[str, float | list[float]]:
    """Mean, std, p50, p90, p99 (milliseconds, quantiles as :func:`quantile_of`), count, and 95% bootstrap
    intervals of the p50 and p99 of a latency sample."""
    from anytime.utils.stats import bootstrap_quantile

    ms = 1000 * np.asarray(seconds, dtype=np.float64)
    return {"mean_ms": float(ms.mean()), "std_ms": float(ms.std()), "p50_ms": quantile_of(ms, 0.5),
            "p90_ms": quantile_of(ms, 0.9), "p99_ms": quantile_of(ms, 0.99), "count": int(ms.size),
            "p50_ci95_ms": list(bootstrap_quantile(ms, 0.5)), "p99_ci95_ms": list(bootstrap_quantile(ms, 0.99))}  # fmt: skip
