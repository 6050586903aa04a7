"""Promised vs delivered: replay test inputs one at a time at a set of deadlines and hold every answer to the promise
it was made under.

For each request the anytime runtime says what it promises before it runs (``AnytimePrediction.option``,
``promised_ms`` and ``fits``): an option whose price fits the deadline, at the validation accuracy of that option.
A request whose option fitted was promised on time; one for which nothing fitted was answered by the cheapest option
and is counted as infeasible, never as a broken promise. A deadline's promise is broken when its promised requests
were late more often than a late share of ``1 - quantile`` explains (the exact binomial test at 5%), or when their
delivered accuracy is below the promised one by more than ``accuracy_tolerance`` beyond its 95% interval. The replay
keeps Python's garbage collector out of the requests, as a serving loop does
(:func:`anytime.utils.collector.serving_gc`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.utils.collector import collect_due, serving_gc
from anytime.utils.stats import wilson

if TYPE_CHECKING:
    from anytime.train.folder import RunFolder

DEFAULT_DEADLINES = 20  # spaced log-uniformly from half the cheapest step's price to 1.5x the deepest
DEFAULT_REQUESTS = 300
DEFAULT_GAP_MS = 5.0  # mean of the exponential idle gaps between requests (Poisson arrivals)


@dataclass(frozen=True)
class PromiseRow:
    """One deadline: what was promised and what was delivered to the requests that were promised.

    ``promised`` requests had an option that fitted (the others, ``requests - promised``, were infeasible);
    ``late`` of them answered after the deadline. Accuracies are over the promised requests; intervals are
    Wilson's at 95%. ``kept`` is None where no request was promised.
    """

    deadline_ms: float
    option: str
    price_ms: float
    requests: int
    promised: int
    late: int
    late_low: float
    late_high: float
    promised_accuracy: float
    delivered_accuracy: float
    delivered_low: float
    delivered_high: float
    mean_step: float
    kept: bool | None

    @property
    def late_rate(self) -> float:
        """The late share of the promised requests (0 where none was promised)."""
        return self.late / self.promised if self.promised else 0.0


@dataclass(frozen=True)
class PromiseCheck:
    """The promise check of a run: one row per deadline and the settings it ran with."""

    run: str
    split: str
    quantile: float
    accuracy_tolerance: float
    gap_ms: float
    rows: tuple[PromiseRow, ...]

    @property
    def broken(self) -> tuple[PromiseRow, ...]:
        """The deadlines whose promise was broken."""
        return tuple(r for r in self.rows if r.kept is False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, each row with its late rate."""
        return {"run": self.run, "split": self.split, "quantile": self.quantile,
                "accuracy_tolerance": self.accuracy_tolerance, "gap_ms": self.gap_ms,
                "rows": [{**asdict(r), "late_rate": r.late_rate} for r in self.rows],
                "broken": len(self.broken)}  # fmt: skip


def default_deadlines(cheapest_ms: float, deepest_ms: float, count: int = DEFAULT_DEADLINES) -> list[float]:
    """``count`` deadlines spaced log-uniformly from half the cheapest price to 1.5 times the deepest."""
    if count < 1:
        raise AnytimeError(f"the number of deadlines must be at least 1 (got {count})")
    return np.geomspace(0.5 * cheapest_ms, 1.5 * deepest_ms, count).tolist()


def late_p_value(late: int, promised: int, rate: float) -> float:
    """The chance of ``late`` or more late answers among ``promised`` if each is late with probability ``rate``
    (the exact one-sided binomial tail)."""
    if late <= 0:
        return 1.0
    if rate <= 0:
        return 0.0
    log_rate, log_rest = math.log(rate), math.log1p(-rate)
    log_n = math.lgamma(promised + 1)
    return min(1.0, math.fsum(
        math.exp(log_n - math.lgamma(i + 1) - math.lgamma(promised - i + 1) + i * log_rate + (promised - i) * log_rest)
        for i in range(late, promised + 1)))  # fmt: skip


def judge(late: int, promised: int, correct: int, promised_accuracy: float, quantile: float,
          accuracy_tolerance: float) -> bool | None:  # fmt: skip
    """Whether a deadline's promise held (None: nothing was promised): neither more late answers than a late share
    of ``1 - quantile`` explains (the exact binomial test at 5%) nor an accuracy more than ``accuracy_tolerance``
    below the promised one, beyond its 95% interval."""
    if promised == 0:
        return None
    _, accuracy_high = wilson(correct, promised)
    return (
        late_p_value(late, promised, 1 - quantile) >= 0.05 and accuracy_high >= promised_accuracy - accuracy_tolerance
    )


@dataclass(frozen=True)
class PromiseSettings:
    """What a promise check (:func:`check_promises`) replays and how it judges.

    ``deadlines`` (ms; default: ``deadline_count`` of :func:`default_deadlines` between the cheapest and the dearest
    price of every option the runtime may answer with, so that the lowest lies below every promise and the highest
    above) are each replayed with ``count`` inputs of ``split`` (``val`` or ``test``, sampled with ``seed``) one at a
    time, spaced by exponential idle gaps of mean ``gap_ms`` (ms, 0 to 60000; as Poisson arrivals, drawn with
    ``seed``), through the run's anytime runtime at ``quantile``. A deadline's promise is broken when its promised
    requests are late more often than ``1 - quantile`` explains, or when their accuracy falls below the promised one
    by more than ``accuracy_tolerance`` (a share below 1) beyond its 95% interval."""

    deadlines: tuple[float, ...] | None = None
    deadline_count: int = DEFAULT_DEADLINES
    count: int = DEFAULT_REQUESTS
    split: str = "test"
    quantile: float = 0.99
    gap_ms: float = DEFAULT_GAP_MS
    accuracy_tolerance: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.split not in ("val", "test"):
            raise AnytimeError(f"split '{self.split}' is not one of val, test")
        if self.count < 1:
            raise AnytimeError(f"--requests must be at least 1 (got {self.count})")
        if not 0 <= self.gap_ms < 60_000 or not 0 <= self.accuracy_tolerance < 1:
            raise AnytimeError(f"the gap is 0 to 60000 ms and the accuracy tolerance a share below 1 "
                               f"(got {self.gap_ms}, {self.accuracy_tolerance})")  # fmt: skip


def check_promises(
    run: RunFolder | str | Path,
    settings: PromiseSettings | None = None,
    *,
    sleep: Callable[[float], None] | None = None,
) -> PromiseCheck:
    """Replay inputs one at a time at every deadline, as ``settings`` say (default :class:`PromiseSettings`),
    through the run's anytime runtime, and hold each answer to its promise. ``sleep`` waits out the idle gaps
    (tests inject one)."""
    # torch comes in here, not at import: `anytime schedule` reads this module's rows without a network
    from anytime.data import make_loader
    from anytime.scheduler.runs import runner_for_run
    from anytime.train.folder import open_run
    from anytime.train.splits import run_splits

    settings = settings or PromiseSettings()
    quantile, gap_ms, seed = settings.quantile, settings.gap_ms, settings.seed
    folder = open_run(run)
    runner, loaded = runner_for_run(folder, quantile=quantile)
    splits = run_splits(loaded)
    chosen = splits.split(settings.split).sample(settings.count, seed=seed)
    loader = make_loader(chosen, splits.info, batch_size=1, train=False, seed=seed)
    inputs = [(x.to(loaded.device), int(y)) for x, y in loader]
    deadlines: Sequence[float] | None = settings.deadlines
    if deadlines is None:
        prices = [runner.scheduler.latency(o, quantile) for o in runner.scheduler.options.values()]
        deadlines = default_deadlines(min(prices), max(prices), settings.deadline_count)
    wait = sleep or time.sleep
    rng = np.random.default_rng(seed)
    accuracy_of = {name: o.accuracy for name, o in runner.scheduler.options.items()}
    rows = []
    with serving_gc():
        for deadline in deadlines:
            runner.drift.reset()
            outcomes = []
            for x, y in inputs:
                collect_due()
                if gap_ms:
                    wait(float(rng.exponential(gap_ms / 1000.0)))
                out = runner.predict(x, float(deadline))
                outcomes.append((out.option, out.fits, out.missed, int(out.predictions[0]) == y, out.step,
                                 out.promised_ms))  # fmt: skip
            rows.append(_row(float(deadline), outcomes, accuracy_of, quantile, settings.accuracy_tolerance))
    return PromiseCheck(str(folder.path), settings.split, quantile, settings.accuracy_tolerance, gap_ms, tuple(rows))


def _row(deadline: float, outcomes: list[tuple[str, bool, bool, bool, int, float]], accuracy_of: dict[str, float],
         quantile: float, tolerance: float) -> PromiseRow:  # fmt: skip
    promised = [o for o in outcomes if o[1]]
    option = Counter(o[0] for o in (promised or outcomes)).most_common(1)[0][0]
    price = float(np.median([o[5] for o in (promised or outcomes)]))
    late = sum(o[2] for o in promised)
    correct = sum(o[3] for o in promised)
    expected = float(np.mean([accuracy_of[o[0]] for o in promised])) if promised else math.nan
    late_low, late_high = wilson(late, len(promised))
    low, high = wilson(correct, len(promised))
    return PromiseRow(
        deadline_ms=deadline, option=option, price_ms=price, requests=len(outcomes), promised=len(promised),
        late=late, late_low=late_low, late_high=late_high, promised_accuracy=expected,
        delivered_accuracy=correct / len(promised) if promised else math.nan, delivered_low=low, delivered_high=high,
        mean_step=float(np.mean([o[4] for o in outcomes])),
        kept=judge(late, len(promised), correct, expected, quantile, tolerance),
    )  # fmt: skip


def promise_lines(check: PromiseCheck) -> list[str]:
    """The check as a table a person reads: promise and delivery side by side, one line per deadline."""
    q = f"p{100 * check.quantile:g}"
    lines = [f"{'deadline':>9}  {'promise (' + q + ', validation accuracy)':<44} {'delivered':<40} verdict"]
    for r in check.rows:
        if r.kept is None:
            lines.append(f"{r.deadline_ms:7.2f}ms  {'nothing fits: ' + r.option + f' answers ({r.price_ms:.2f} ms)':<44} "
                         f"{'':<40} infeasible")  # fmt: skip
            continue
        promise = f"{r.option} in {r.price_ms:.2f} ms at {100 * r.promised_accuracy:.1f}%"
        if r.promised < r.requests:
            promise += f" ({r.promised}/{r.requests})"
        delivered = (f"{100 * r.late_rate:.1f}% late (<= {100 * r.late_high:.1f}%), "
                     f"{100 * r.delivered_accuracy:.1f}% [{100 * r.delivered_low:.1f}, {100 * r.delivered_high:.1f}]")  # fmt: skip
        lines.append(f"{r.deadline_ms:7.2f}ms  {promise:<44} {delivered:<40} {'kept' if r.kept else 'BROKEN'}")
    return lines
