"""Comparing families of anytime steps (exits, slices, block-drop ladders) on one device: each step's
accuracy against its measured latency, and each family's best accuracy within a latency budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.store import DeviceProfile
from anytime.utils.io import read_json


@dataclass(frozen=True)
class StepPoint:
    """One step of one run: its cost (FLOPs, latency on the profiled device) and its accuracy."""

    family: str
    run: str
    step: int
    name: str
    flops: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    val_acc: float
    test_acc: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def step_points(run_dir: str | Path, profile: DeviceProfile, *, family: str, batch_size: int = 1) -> list[StepPoint]:
    """Every step of a finished run with its accuracies (from the summary) and its latency alone at
    ``batch_size`` (from ``profile``, which must be of this run's weights and steps)."""
    from anytime.scheduler.query import run_fingerprint
    from anytime.profile import quantile_of

    path = Path(run_dir) / "summary.json"
    summary = read_json(path, what="training summary", make="its training has not finished", redo="train it again")
    steps = summary.get("exits") if isinstance(summary, dict) else None
    if not steps:
        raise AnytimeError(f"{run_dir} has no steps in its summary; compare runs with exits, slices or a ladder")
    profile.check_model(run_fingerprint(run_dir), len(steps))
    latency = profile.at(batch_size)
    points = []
    for k, step in enumerate(steps):
        samples = latency.steps[k]
        points.append(StepPoint(
            family=family, run=str(run_dir), step=k, name=str(step["name"]), flops=int(step["flops"]),
            mean_ms=float(np.mean(samples)), p50_ms=quantile_of(samples, 0.5), p99_ms=quantile_of(samples, 0.99),
            val_acc=float(step["val_acc"]), test_acc=float(step["test_acc"]),
        ))  # fmt: skip
    return points


def best_within(points: Sequence[StepPoint], budget_ms: float) -> StepPoint | None:
    """The step with the best validation accuracy (the cheaper on a tie) whose *mean* latency fits
    ``budget_ms``; None if none fits. (The deadline scheduler compares a tail quantile instead.)"""
    fitting = [p for p in points if p.mean_ms <= budget_ms]
    if not fitting:
        return None
    return max(fitting, key=lambda p: (p.val_acc, -p.mean_ms))


def matched_table(families: Mapping[str, Sequence[StepPoint]], budgets_ms: Sequence[float]) -> list[dict[str, Any]]:
    """For each budget of mean latency, each family's chosen step (best validation accuracy within it) and
    its test accuracy: the families compared at matched mean latency."""
    rows = []
    for budget in budgets_ms:
        row: dict[str, Any] = {"budget_ms": float(budget)}
        for label, points in families.items():
            best = best_within(points, budget)
            row[f"{label}_step"] = None if best is None else best.name
            row[f"{label}_ms"] = None if best is None else best.mean_ms
            row[f"{label}_acc"] = None if best is None else best.test_acc
        rows.append(row)
    return rows
