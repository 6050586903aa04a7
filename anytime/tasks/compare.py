"""Comparing families of anytime steps (exits, slices, block-drop ladders) on one device: each step's
accuracy against its measured latency, and each family's best accuracy within a latency budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.store import DeviceProfile
from anytime.utils.io import read_json
from anytime.utils.timer import Clock, monotonic


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
    ``batch_size`` (from ``profile``, which must be of this run's weights and steps): the way to compare families
    profiled on a target device elsewhere (``anytime profile`` on the board). Where the runs can be timed here,
    :func:`measured_side_by_side` is the fairer measurement."""
    from anytime.scheduler.query import run_fingerprint

    steps = _summary_steps(run_dir)
    profile.check_model(run_fingerprint(run_dir), len(steps))
    return _points(run_dir, steps, profile.at(batch_size).steps, family)


def measured_side_by_side(
    runs: Mapping[str, str | Path], *, repeats: int = 300, warmup: int = 10, turn: int = 10, seed: int = 0,
    processes: int = 1, clock: Clock = monotonic,
) -> dict[str, list[StepPoint]]:  # fmt: skip
    """Every step of every run (a family label -> its run) timed alone at batch 1, in alternating turns
    (:func:`anytime.profile.per_sample_latency`), so that a machine whose speed drifts by 10-25%, as a shared
    virtual machine's does, moves every family alike: profiles taken one run after another can order two families
    by when each was measured. Each step runs ``turn`` images in a row per turn, ``repeats`` in all, after
    ``warmup`` untimed ones, on the same seeded random images. ``processes`` > 1 repeats that in as many fresh
    processes (the torch threads of this one) and pools their timings: within one process the same work can run
    10% or more slower in one model than in another for the process's whole life (most likely where its memory
    landed), which only other processes average out. ``clock`` (seconds) times the calls in this process: tests inject a fake one."""
    if repeats < 1 or warmup < 0 or turn < 1 or processes < 1:
        raise AnytimeError(f"repeats, turn and processes must be at least 1 and warmup at least 0 (got {repeats}, "
                           f"{turn}, {processes}, {warmup})")  # fmt: skip
    if not runs:
        raise AnytimeError("no runs to compare; give at least one family's run")
    steps = {label: _summary_steps(run_dir) for label, run_dir in runs.items()}
    if processes == 1:
        samples = _time_steps(dict(runs), steps, repeats, warmup, turn, seed, clock=clock)
    else:
        import torch

        from anytime.profile import run_isolated

        parts = [run_isolated(_time_steps, dict(runs), steps, repeats, warmup, turn, seed,
                              threads=torch.get_num_threads()) for _ in range(processes)]  # fmt: skip
        samples = {label: [np.concatenate([part[label][k] for part in parts]) for k in range(len(steps[label]))]
                   for label in runs}  # fmt: skip
    return {label: _points(runs[label], steps[label], samples[label], label) for label in runs}


def _time_steps(
    runs: dict[str, str | Path], steps: dict[str, list[dict[str, Any]]], repeats: int, warmup: int, turn: int,
    seed: int, *, clock: Clock = monotonic, threads: int | None = None,
) -> dict[str, list[np.ndarray]]:  # fmt: skip
    """Milliseconds of every step of every run at batch 1, timed in turns in this process."""
    import torch

    from anytime.backbones.base import example_input
    from anytime.contract import run_step
    from anytime.profile import per_sample_latency
    from anytime.train.runs import dataset_input_shape, load_run, require_images

    if threads is not None:
        torch.set_num_threads(threads)
    loaded, shapes = {}, {}
    for label, run_dir in runs.items():
        loaded[label] = load_run(run_dir)
        require_images(loaded[label], "the side-by-side comparison of families")
        shapes[label] = dataset_input_shape(loaded[label].dataset)
        if loaded[label].num_steps != len(steps[label]):
            raise AnytimeError(f"{run_dir}'s model has {loaded[label].num_steps} steps but its summary "
                               f"{len(steps[label])}; was the run edited?")  # fmt: skip
    if len(set(shapes.values())) > 1:
        seen = ", ".join(f"{label} {shape}" for label, shape in shapes.items())
        raise AnytimeError(f"the runs take inputs of different shapes ({seen}); compare runs of one dataset")
    shape = next(iter(shapes.values()))
    images = example_input(shape, repeats, generator=torch.Generator().manual_seed(seed))  # warm-up: the first ones
    order = [(label, k) for label in runs for k in range(len(steps[label]))]
    functions = {str(i): partial(run_step, loaded[label].model, k=k) for i, (label, k) in enumerate(order)}
    times = per_sample_latency(functions, images, warmup=warmup, turn=turn, clock=clock)
    samples: dict[str, list[np.ndarray]] = {label: [] for label in runs}
    for i, (label, _) in enumerate(order):
        samples[label].append(1000 * times[str(i)])
    return samples


def _summary_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "summary.json"
    summary = read_json(path, what="training summary", make="its training has not finished", redo="train it again")
    steps = summary.get("exits") if isinstance(summary, dict) else None
    if not steps:
        raise AnytimeError(f"{run_dir} has no steps in its summary; compare runs with exits, slices or a ladder")
    return list(steps)


def _points(run_dir: str | Path, steps: Sequence[dict[str, Any]], samples_ms: Sequence[np.ndarray],
            family: str) -> list[StepPoint]:  # fmt: skip
    from anytime.profile import quantile_of

    return [StepPoint(
        family=family, run=str(run_dir), step=k, name=str(step["name"]), flops=int(step["flops"]),
        mean_ms=float(np.mean(samples)), p50_ms=quantile_of(samples, 0.5), p99_ms=quantile_of(samples, 0.99),
        val_acc=float(step["val_acc"]), test_acc=float(step["test_acc"]),
    ) for k, (step, samples) in enumerate(zip(steps, samples_ms))]  # fmt: skip


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
