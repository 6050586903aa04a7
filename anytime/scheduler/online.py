"""Following the device's drift: how much slower (or faster) it runs now than when it was profiled.

Every measured latency is turned into a ratio to the profiled median of what was measured (a step, a
stage, a policy). The last ``window`` ratios are kept sorted. At quantile q the drift factor compares
them with the profile's own ratios: ``max(median_now / median_profiled, q_now / q_profiled)``. The first
term follows a device that got uniformly slower or faster; the second, a device whose tail got heavier
(another process on the cores, throttling bursts), which a mean or a Kalman-filtered mean would miss.
Scaling every profiled quantile by one factor keeps the order of the options, so a query stays a binary
search.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.store import quantile_of


class DriftEstimator:
    """A sliding window of observed/profiled latency ratios against the profile's own ratios.

    ``reference`` holds the profile's samples divided by their medians (pooled). Until
    ``min_observations`` ratios have been seen the factor is 1 (the profile is trusted as measured).
    """

    def __init__(self, reference: np.ndarray, *, window: int = 200, min_observations: int = 20) -> None:
        if window < 1 or not 1 <= min_observations <= window:
            raise AnytimeError(f"need window >= 1 and 1 <= min_observations <= window (got {window}, {min_observations})")
        ref = np.sort(np.asarray(reference, dtype=np.float64))
        if ref.size == 0 or not np.isfinite(ref).all() or (ref <= 0).any():
            raise AnytimeError("the drift reference needs positive, finite latency ratios")
        self._reference = ref
        self._ref_quantiles: dict[float, float] = {}
        self.window = window
        self.min_observations = min_observations
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    @property
    def observations(self) -> int:
        """How many ratios the window holds now."""
        return len(self._recent)

    def observe(self, ratio: float) -> None:
        """Add one observed/profiled ratio (ignored if it is not a positive finite number)."""
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        if len(self._recent) == self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(ratio)
        bisect.insort(self._sorted, ratio)

    def factor(self, q: float) -> float:
        """How much to multiply a profiled q-quantile by to estimate it now (1 before enough observations)."""
        n = len(self._sorted)
        if n < self.min_observations:
            return 1.0
        ref_q = self._ref_quantiles.get(q)
        if ref_q is None:
            ref_q = self._ref_quantiles[q] = quantile_of(self._reference, q)
            self._ref_quantiles.setdefault(0.5, quantile_of(self._reference, 0.5))
        now_q = self._sorted[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]
        now_median = self._sorted[max(0, math.ceil(0.5 * n - 1e-9) - 1)]
        return max(now_median / self._ref_quantiles[0.5], now_q / ref_q)

    def reset(self) -> None:
        """Forget every observation (back to trusting the profile)."""
        self._recent.clear()
        self._sorted.clear()


def ratios_to_median(samples: list[np.ndarray]) -> np.ndarray:
    """Each sample divided by its own set's median, pooled: the reference for :class:`DriftEstimator`."""
    return np.concatenate([np.asarray(s, dtype=np.float64) / max(quantile_of(s, 0.5), 1e-9) for s in samples])
