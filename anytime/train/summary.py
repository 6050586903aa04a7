"""A finished run's summary (its ``summary.json``) as a frozen result: what every run reports (its model, data,
final accuracies and every step's cost and accuracy) typed, beside the whole record as written (a trained run adds
its timing and memory, a ticket its sparsity, a converted run its precision)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from anytime.errors import AnytimeError
from anytime.train.linear_baseline import Baseline

SUMMARY = "summary.json"


@dataclass(frozen=True)
class StepResult:
    """One step of a multi-step run (an exit, a slice, a ladder rung): its FLOPs and its accuracy."""

    index: int
    name: str
    flops: int
    val_acc: float
    test_acc: float


@dataclass(frozen=True)
class RunSummary:
    """A finished run: ``steps`` is empty for a plain model; ``epochs``, ``train_time_s`` and ``baseline`` are a
    trained run's (None for a converted or cut one); ``record`` is the whole ``summary.json``, read-only."""

    run_dir: Path
    model: str
    data: str
    val_acc: float
    test_acc: float
    steps: tuple[StepResult, ...]
    backbone_flops: int | None
    epochs: int | None
    train_time_s: float | None
    baseline: Baseline | None
    record: Mapping[str, Any]

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], *, where: str = SUMMARY) -> RunSummary:
        """The summary a run wrote; a one-line error for a record that is not one."""
        try:
            final = record["final"]
            steps = tuple(StepResult(int(e["index"]), str(e["name"]), int(e["flops"]), float(e["val_acc"]),
                                     float(e["test_acc"])) for e in record.get("exits") or [])  # fmt: skip
            baseline = record.get("baseline")
            return cls(
                run_dir=Path(record["run_dir"]), model=str(record["model"]), data=str(record["data"]),
                val_acc=float(final["val_acc"]), test_acc=float(final["test_acc"]), steps=steps,
                backbone_flops=None if record.get("backbone_flops") is None else int(record["backbone_flops"]),
                epochs=None if record.get("epochs") is None else int(record["epochs"]),
                train_time_s=None if record.get("train_time_s") is None else float(record["train_time_s"]),
                baseline=None if baseline is None else Baseline.from_dict(baseline),
                record=MappingProxyType(dict(record)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise AnytimeError(
                f"{where} is not a run's summary ({type(exc).__name__}: {exc}); was it edited?"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """The record as written: a JSON-able copy."""
        return copy.deepcopy(dict(self.record))
