"""``anytime seeds RUN RUN ...``: several seeds of one recipe summarised with their spread.

The runs must share their recipe (every training option but the seed and the speed-only ones) and their data;
each step's validation and test accuracy, and the training time, are given as mean, sample standard deviation,
minimum and maximum over the seeds. Reads the runs' records only (no torch).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError
from anytime.train.records import require_run, step_labels

# Options that do not change what is learned (as TrainConfig.RUNTIME_FIELDS), and the seed itself.
_FREE = ("seed", "device", "workers", "prefetch_factor", "pin_memory", "eval_batch_size")


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation (0 for one run), minimum and maximum of one figure over the seeds."""

    mean: float
    std: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one)."""
        n = len(values)
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        return cls(mean, std, min(values), max(values))


@dataclass(frozen=True)
class StepSpread:
    """One step over the seeds: its validation and test accuracy."""

    step: int
    name: str
    val_acc: Spread
    test_acc: Spread


@dataclass(frozen=True)
class SeedSummary:
    """Several seeds of one recipe: the runs, their seeds, every step's spread and the training time's."""

    runs: tuple[str, ...]
    seeds: tuple[int, ...]
    model: str
    data: str
    steps: tuple[StepSpread, ...]
    train_time_s: Spread


def _record(run: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    config = require_run(run)
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        raise AnytimeError(f"{run} has no readable summary.json: its training has not finished") from None
    return config["train"], config.get("dataset", {}), summary


def _accuracies(run: Path, summary: dict[str, Any]) -> list[tuple[float, float]]:
    try:
        rows = summary.get("exits") or [summary["final"]]
        return [(float(r["val_acc"]), float(r["test_acc"])) for r in rows]
    except (KeyError, TypeError, ValueError):
        raise AnytimeError(f"{run}/summary.json does not hold every step's validation and test accuracy") from None


def summarise_seeds(runs: Sequence[str | Path]) -> SeedSummary:
    """The spread over ``runs``, refused in one line unless they are one recipe on one dataset, seeds apart."""
    folders = [Path(r) for r in runs]
    if len(folders) < 2:
        raise AnytimeError("give at least two runs of one recipe (trained with different --seed)")
    records = [_record(f) for f in folders]
    base_train, base_data, _ = records[0]
    for folder, (train, data, _) in zip(folders[1:], records[1:]):
        differs = sorted(
            k for k in set(base_train) | set(train) if k not in _FREE and base_train.get(k) != train.get(k)
        )
        if differs:
            key = differs[0]
            raise AnytimeError(f"{folder} differs from {folders[0]} in {key} ({train.get(key)!r} vs "
                               f"{base_train.get(key)!r}); seeds summarise one recipe")  # fmt: skip
        if data.get("fingerprint") != base_data.get("fingerprint"):
            raise AnytimeError(f"{folder} was trained on other data than {folders[0]}; seeds summarise one dataset")
    seeds = [int(train.get("seed", 0)) for train, _, _ in records]
    if len(set(seeds)) < len(seeds):
        raise AnytimeError(f"two runs have the same seed ({seeds}); a seed's run counts once")
    accuracies = [_accuracies(f, summary) for f, (_, _, summary) in zip(folders, records)]
    count = len(accuracies[0])
    names = ("model",) if count == 1 else step_labels(folders[0], [f"step{k}" for k in range(count)])
    steps = tuple(
        StepSpread(k, names[k], Spread.of([a[k][0] for a in accuracies]), Spread.of([a[k][1] for a in accuracies]))
        for k in range(len(accuracies[0]))
    )  # fmt: skip
    times = [float(summary.get("train_time_s", math.nan)) for _, _, summary in records]
    return SeedSummary(tuple(str(f) for f in folders), tuple(seeds), str(base_train.get("model")),
                       str(base_data.get("name")), steps, Spread.of(times))  # fmt: skip
