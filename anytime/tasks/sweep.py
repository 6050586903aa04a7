"""Sweeps of a run's cached outputs: every criterion's shared thresholds, the oracle and every exit alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.calibrate import (
    SweepResult,
    oracle,
    sweep,
)
from anytime.outputs import OutputCache
from anytime.tasks.collect import check_split, run_cache
from anytime.train.folder import RunFolder, open_run
from anytime.utils.io import write_csv, write_json
from anytime.utils.outputs import check_output_file, output_lock


def steps_table(caches: dict[str, OutputCache | None]) -> list[dict[str, Any]]:
    """Every step alone: its FLOPs and its accuracy on each split given (None where not collected)."""
    from anytime.utils.stats import wilson

    first = next(c for c in caches.values() if c is not None)
    accuracy = {split: None if c is None else c.step_accuracy() for split, c in caches.items()}
    sizes = {split: 0 if c is None else c.num_samples for split, c in caches.items()}

    def interval(split: str, acc: Any, k: int) -> list[float] | None:
        return None if acc is None else list(wilson(round(float(acc[k]) * sizes[split]), sizes[split]))

    return [
        {"step": k, "name": name, "flops": int(first.step_flops[k]),
         "flops_ratio": float(first.step_flops[k] / first.base_flops),
         **{f"{split}_acc": None if acc is None else float(acc[k]) for split, acc in accuracy.items()},
         **{f"{split}_acc_ci95": interval(split, acc, k) for split, acc in accuracy.items()}}
        for k, name in enumerate(first.step_names)
    ]  # fmt: skip


def oracle_dict(cache: OutputCache) -> dict[str, Any]:
    """The oracle on ``cache`` (every sample at its first correct exit) as JSON-able figures."""
    o = oracle(cache)
    return {"accuracy": o.accuracy, "mean_flops": o.mean_flops, "flops_ratio": o.flops_ratio,
            "flops_speedup": 1 / o.flops_ratio, "exit_share": o.exit_share.tolist()}  # fmt: skip


@dataclass(frozen=True)
class SweepReport:
    """Sweeps of one split, one per criterion, with the oracle and every exit on its own."""

    split: str
    results: dict[str, SweepResult]
    oracle: dict[str, Any]
    steps: list[dict[str, Any]]
    csv: Path
    json: Path


def sweep_run(
    run: RunFolder | str | Path, criteria: list[str], *, settings: int = 1000, split: str = "val"
) -> SweepReport:
    """Sweep shared thresholds for each criterion over a run's cache; write ``RUN/sweep-SPLIT.csv`` (every
    setting, with its Pareto flag) and ``RUN/sweep-SPLIT.json`` (the fronts, the oracle, the exits)."""
    check_split(split)
    folder = open_run(run)
    run_dir = folder.path
    cache = run_cache(folder, split)
    csv_target = check_output_file(run_dir / f"sweep-{split}.csv", what="sweep", flag="")
    check_output_file(run_dir / f"sweep-{split}.json", what="sweep", flag="")
    with output_lock(csv_target):
        return _sweep(folder, cache, criteria, settings, split)


def _sweep(folder: RunFolder, cache: OutputCache, criteria: list[str], settings: int, split: str) -> SweepReport:
    # Learned gates are fit on validation only; on another split they score what they never saw.
    val = run_cache(folder, "val") if split != "val" and "learned" in criteria else None
    results = {name: sweep(cache, name, settings=settings, val=val) for name in criteria}
    rows = []
    fronts: dict[str, list[dict[str, float]]] = {}
    for name, result in results.items():
        front = set(result.pareto().tolist())
        for i, row in enumerate(result.rows()):
            rows.append({"criterion": name, "setting": i, "pareto": int(i in front), **row})
        fronts[name] = result.rows(result.pareto())
    steps = steps_table({split: cache})
    report = {"split": split, "settings": settings, "base_flops": cache.base_flops, "steps": steps,
              "oracle": oracle_dict(cache), "pareto": fronts,
              "area_under_curve": {name: result.area() for name, result in results.items()}}  # fmt: skip
    csv_path = write_csv(folder.path / f"sweep-{split}.csv", rows)
    json_path = write_json(folder.path / f"sweep-{split}.json", report)
    return SweepReport(split, results, report["oracle"], steps, csv_path, json_path)
