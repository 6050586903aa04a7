"""Following the device's drift: how much slower it runs now than when it was profiled, and how long its
current stalls are.

Each measured latency is compared with what the profile says of what was measured (a step, a stage, a
path to an exit): its median ``m`` and its quantile ``t`` at the tracked level (the runtime's, e.g. p99).
Two sliding windows are kept sorted: the ratio ``measured / m`` and the excess ``measured - level * t``,
where the level is the median ratio when the latency came in (excesses are kept once a level is known).
The estimate of a profiled q-quantile ``t_q`` is then

    level * t_q + max(0, excess_q)

The level follows a device that got uniformly slower or faster (throttling, DVFS): every latency is
scaled. The excess is near zero on such a device (the profile's own tail, scaled, already covers it),
and grows on a device that stalls, such as one where another process takes a core from one of torch's
threads for a time slice. A stall costs the same whether it hits a short stage or a long one, so it is
added, not multiplied: scaling a short stage by the ratio a stall gave, or adding the spread of a quiet
machine's pooled latencies to every stage, stopped the CIFAR-10 runtime long before it had to.

A profile's tail can also be too pessimistic: a p99 taken while a burst of other work ran (on a shared
VM the p99 of one exit moved by 40% between two measurements minutes apart) keeps the runtime one exit
short of what now fits. Given the tracked quantile, an estimate at that quantile then comes down as
well: when fewer than ``1 - q`` of the measured latencies exceed ``level * t`` (the excess quantile is
negative), the estimate is ``level * t_q * tail_q``, where ``tail_q`` is the q-quantile of the ratios
``measured / (level * t)``. Each ratio is below 1 exactly when its excess is below 0, so the two
windows agree on which way to correct; the ratio scales, since a tail that was inflated by a burst is
inflated in proportion to the work that was timed.

The tails of different things do not move together, though: on the CIFAR-10 runtime with one core busy,
the first stage's p99 came in 13-19% under its profile and the second exit timed alone 14% under in one
run and 2% over in another, so a come-down learned from the first stage sent requests straight to the
second exit, and they were late. So each observation may name what was measured (``key``), and an
estimate for a key comes down by that key's own ratios once it has ``min_observations`` of them. Before that it borrows the pooled ratios of
everything observed (``borrow``, the default: a stage on the runtime's path is timed as soon as it runs, so
a wrong loan corrects itself, and without it a stage whose profile is pessimistic would never run, and never
be timed), or keeps its profiled tail, scaled by the level (``borrow=False``: the runtime's straight jump to
an exit, which is timed only when taken, and whose every wrong loan is a late answer).

A key's own ratios only bring its estimate down, never above the profile's scaled tail: here the pooled excess says
that fewer than ``1 - q`` of the latencies overran, so a key whose own q-quantile ratio is above 1 got there by a
stall or two among its few timings. Multiplied into its tail, such a stall grew with the stage's length, and the key,
now estimated too slow to run, was timed less often, so its window kept the stall longer: quiet, on the fast CIFAR-10
card, the runtime stopped up to 3.9 points short of the static one, which was no more often late.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable

from anytime.errors import AnytimeError


class SortedWindow:
    """The last ``size`` values, kept in arrival order and in sorted order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        if len(self._order) == self.size:
            del self._sorted[bisect.bisect_left(self._sorted, self._order.popleft())]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float) -> float:
        n = len(self._sorted)
        return self._sorted[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()


class DriftEstimator:
    """Sliding windows of measured latencies against the profile; the profile is trusted as measured until
    ``min_observations`` ratios have given a level and as many excesses have been seen after it.

    ``tracked_quantile`` is the quantile of the ``tracked_ms`` each observation comes with (the runtime's,
    e.g. 0.99). Given it, an estimate at that quantile may come below the profile's scaled tail where the
    measured latencies show that tail to be pessimistic; without it, estimates never do. ``rise_only``: the level
    never comes below 1 either, so that no estimate is below the profile's figure."""

    def __init__(self, *, window: int = 200, min_observations: int = 20, tracked_quantile: float | None = None,
                 rise_only: bool = False) -> None:  # fmt: skip
        if window < 1 or not 1 <= min_observations <= window:
            raise AnytimeError(
                f"need window >= 1 and 1 <= min_observations <= window (got {window}, {min_observations})"
            )
        if tracked_quantile is not None and not 0 < tracked_quantile < 1:
            raise AnytimeError(f"the tracked quantile must lie between 0 and 1 (got {tracked_quantile})")
        self.window = window
        self.min_observations = min_observations
        self.tracked_quantile = tracked_quantile
        self.rise_only = rise_only
        self._ratios = SortedWindow(window)
        self._excess = SortedWindow(window)
        self._tail = SortedWindow(window)
        self._tails: dict[Hashable, SortedWindow] = {}  # the same ratios, per key observed
        self._reading: tuple[int, float, float, float] = (-1, math.nan, 1.0, 0.0)  # version, q, level, excess
        self.version = 0  # bumped by every observation, so callers can cache what they derive from it

    @property
    def observations(self) -> int:
        """How many latencies the window holds now."""
        return len(self._ratios)

    @property
    def ready(self) -> bool:
        """Whether enough latencies have been seen to depart from the profile."""
        return len(self._excess) >= self.min_observations

    def level(self) -> float:
        """The median of measured/profiled-median ratios (1 before enough observations)."""
        return self._ratios.quantile(0.5) if self.ready else 1.0

    def observe(self, measured_ms: float, median_ms: float, tracked_ms: float, key: Hashable | None = None) -> None:
        """Add one measured latency of something profiled with median ``median_ms`` and ``tracked_ms`` at the
        tracked quantile (ignored unless all are positive finite numbers); ``key`` names that something (a
        stage, a step), so that its estimates can come down by its own measurements."""
        if not all(v > 0 and math.isfinite(v) for v in (measured_ms, median_ms, tracked_ms)):
            return
        if len(self._ratios) >= self.min_observations:
            level = self._ratios.quantile(0.5)
            scaled = (max(1.0, level) if self.rise_only else level) * tracked_ms
            self._excess.add(measured_ms - scaled)
            self._tail.add(measured_ms / scaled)
            if key is not None:
                own = self._tails.get(key)
                if own is None:
                    own = self._tails[key] = SortedWindow(self.window)
                own.add(measured_ms / scaled)
        self._ratios.add(measured_ms / median_ms)
        self.version += 1

    def estimate(self, quantile_ms: float, q: float, key: Hashable | None = None, *, borrow: bool = True) -> float:
        """Today's q-quantile of something (named ``key`` when observed) whose profiled q-quantile is
        ``quantile_ms``; ``borrow``: whether a key measured too few times may come down by the pooled ratios."""
        factor, add = self.affine(q, key, borrow=borrow)
        return factor * quantile_ms + add

    def affine(self, q: float, key: Hashable | None = None, *, borrow: bool = True) -> tuple[float, float]:
        """:meth:`estimate` at ``q`` for ``key`` as ``t -> factor * t + add``. The shared windows are read once
        per observation and quantile, so a caller that estimates many latencies at one moment (every stage and
        exit of a request) pays for them once."""
        if not self.ready:
            return 1.0, 0.0
        version, read_q, level, excess = self._reading
        if version != self.version or read_q != q:
            level, excess = self._ratios.quantile(0.5), self._excess.quantile(q)
            if self.rise_only:
                level = max(1.0, level)
            self._reading = (self.version, q, level, excess)
        if excess >= 0.0 or q != self.tracked_quantile:
            return level, max(0.0, excess)
        tails = self._tail if key is None else self._tails.get(key)
        if tails is None or len(tails) < self.min_observations:
            if not borrow:
                return level, 0.0
            tails = self._tail
        return level * min(1.0, tails.quantile(q)), 0.0

    def reset(self) -> None:
        """Forget every observation (back to trusting the profile)."""
        self._ratios.clear()
        self._excess.clear()
        self._tail.clear()
        self._tails.clear()
        self.version += 1
