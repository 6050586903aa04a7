"""The demo: the main job on the embedded digits, with no files needed.

It trains a multi-exit CIFAR-style ResNet on scikit-learn's handwritten digits, caches every exit's
outputs, sweeps the exit thresholds, calibrates them on validation for at most one point of accuracy
below the last exit, runs real early exit on the test split, profiles every exit's latency on this
machine, asks the deadline scheduler what fits a few deadlines and serves test images with the anytime
runtime against them, plots the run, and times one training mini-batch at several batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from anytime.backbones import create_model
from anytime.calibrate import CRITERIA
from anytime.data import make_loader
from anytime.pipeline import (
    calibrate_run,
    collect_run,
    evaluate_run,
    plot_run,
    profile_run,
    runner_for_run,
    scheduler_for_run,
    sweep_run,
)
from anytime.plotting import plot_batch_time, plot_training_curves
from anytime.profile import measure_train_step
from anytime.train import TrainConfig, Trainer, load_splits, read_metrics
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, git_sha
from anytime.utils.outputs import staged_dir

DEMO_CONFIG = TrainConfig(
    model="resnet20", data="digits", epochs=8, batch_size=64, lr=0.05, schedule="cosine", exits="auto"
)
DEMO_MAX_DROP = 1.0  # accuracy points below the last exit that calibration may give up
DEMO_BATCH_SIZES: tuple[int, ...] = (8, 16, 32, 64)
DEMO_REQUESTS = 200  # test images served one at a time at each deadline
DEMO_TIMINGS = 200  # repetitions per exit and batch size in the profile, and samples in the latency evaluation


@dataclass(frozen=True)
class DemoResult:
    """Where the demo wrote its results, and the headline figures."""

    out_dir: Path
    summary: dict[str, Any]
    batch_time: list[dict[str, float]]
    calibration: dict[str, Any]
    evaluation: dict[str, Any]
    deadlines: list[dict[str, Any]]
    files: list[Path]


def run_demo(
    out_dir: str | Path, *, config: TrainConfig = DEMO_CONFIG, progress: bool = False, overwrite: bool = False,
    create_parents: bool = True,
) -> DemoResult:  # fmt: skip
    """Run the demo into ``out_dir`` (new, empty, or with ``overwrite`` an earlier demo's folder); earlier demo
    results there are replaced only once the new ones are complete."""
    target = Path(out_dir)
    with staged_dir(target, "demo", overwrite=overwrite, create_parents=create_parents) as work:
        result = _run(work, config, progress)
    files = sorted(p for p in target.rglob("*") if p.is_file() and p.suffix in {".png", ".svg", ".pdf", ".csv", ".json"}
                   and not p.name.startswith("."))  # fmt: skip
    summary, batch_rows, calibration, evaluation, deadlines = result
    return DemoResult(target, summary, batch_rows, calibration, evaluation, deadlines, files)


def _deadlines(run_dir: Path, images: torch.Tensor, labels: torch.Tensor) -> list[dict[str, Any]]:
    """Profile the exits here, then at a few deadlines: the scheduler's choice, and the anytime runtime
    serving test images one at a time (its accuracy, exits and how many answers came late)."""
    profile, _ = profile_run(run_dir, batch_sizes=[1, 8], repeats=DEMO_TIMINGS, memory=False)
    scheduler, _ = scheduler_for_run(run_dir)
    runner, _ = runner_for_run(run_dir)
    p99 = [profile.step_quantile(k, 0.99) for k in range(profile.num_steps)]
    rows = []
    for deadline in sorted({0.5 * p99[0], 1.1 * p99[0], p99[len(p99) // 2], 1.2 * max(p99)}):
        choice = scheduler.select(deadline)
        answers = [runner.predict(images[i : i + 1], deadline) for i in range(len(images))]
        rows.append({
            "deadline_ms": deadline, "choice": choice.to_dict(),
            "runtime_accuracy": sum(int(a.predictions[0] == y) for a, y in zip(answers, labels)) / len(answers),
            "runtime_miss_rate": sum(a.missed for a in answers) / len(answers),
            "runtime_mean_step": sum(a.step for a in answers) / len(answers),
        })  # fmt: skip
    return rows


def _run(
    work: Path, config: TrainConfig, progress: bool
) -> tuple[dict[str, Any], list[dict[str, float]], dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    run_dir = work / "run"
    splits = load_splits(config)
    summary = Trainer(config, run_dir, progress=progress).fit(splits=splits)
    plot_training_curves(read_metrics(run_dir), f"{config.model} on {config.data}", work / "training_curves")
    for split in ("val", "test"):
        collect_run(run_dir, split)
    sweep_run(run_dir, list(CRITERIA))
    calibration = calibrate_run(run_dir, max_drop=DEMO_MAX_DROP)
    evaluation = evaluate_run(run_dir, latency_samples=DEMO_TIMINGS)
    info = splits.info
    test = make_loader(splits.test, info, batch_size=DEMO_REQUESTS, train=False, seed=config.seed)
    images, labels = next(iter(test))
    deadlines = _deadlines(run_dir, images, labels)
    plot_run(run_dir)

    loader = make_loader(splits.train, info, batch_size=max(DEMO_BATCH_SIZES), train=True, seed=config.seed)
    images, labels = next(iter(loader))
    batch_rows = []
    for batch_size in DEMO_BATCH_SIZES:
        torch.manual_seed(config.seed)
        model = create_model(config.model, num_classes=info.num_classes, in_channels=info.in_channels)
        timing = measure_train_step(model, images[:batch_size], labels[:batch_size], warmup=2, repeats=8)
        batch_rows.append(timing.summary())
    machine = describe_machine()
    plot_batch_time(config.model, batch_rows, work / "batch_time", machine["cpu_model"])
    write_json(
        work / "demo.json",
        {"config": config.to_dict(), "summary": summary, "batch_time": batch_rows, "deadlines": deadlines,
         "machine": machine, "git_sha": git_sha()},
    )  # fmt: skip
    return summary, batch_rows, calibration, evaluation, deadlines
