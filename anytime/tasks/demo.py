"""The demo: the main job on the embedded digits, with no files needed.

It trains a multi-exit CIFAR-style ResNet on scikit-learn's handwritten digits, caches every exit's
outputs, sweeps the exit thresholds, calibrates them on validation for at most one point of accuracy
below the last exit, runs real early exit on the test split, profiles every exit's latency on this
machine with the runtime's own answer prices, replays test images one at a time through the anytime runtime at a
few deadlines and sets what it promised beside what it delivered, plots the run, and times one training mini-batch
at several batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from anytime.backbones import create_model
from anytime.calibrate import CRITERIA
from anytime.data import make_loader
from anytime.plotting import plot_batch_time, plot_training_curves
from anytime.profile import measure_train_step
from anytime.tasks.calibration import CalibrationReport, CalibrationSettings, calibrate_run
from anytime.tasks.collect import collect_run
from anytime.tasks.evaluation import EvaluationReport, EvaluationSettings, evaluate_run
from anytime.tasks.plots import plot_run
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.tasks.promises import PromiseCheck, PromiseSettings, check_promises
from anytime.tasks.sweep import sweep_run
from anytime.train import TrainConfig, Trainer, load_splits, read_metrics
from anytime.train.folder import RunFolder
from anytime.train.summary import RunSummary
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, git_sha
from anytime.utils.outputs import staged_dir

DEMO_CONFIG = TrainConfig(
    model="resnet20", data="digits", epochs=8, batch_size=64, lr=0.05, schedule="cosine", exits="auto"
)
DEMO_MAX_DROP = 1.0  # accuracy points below the last exit that calibration may give up
DEMO_BATCH_SIZES: tuple[int, ...] = (8, 16, 32, 64)
DEMO_REQUESTS = 200  # test images served one at a time at each deadline
DEMO_DEADLINES = 8  # log-spaced from half the cheapest step's price to 1.5x the deepest
DEMO_QUANTILE = 0.99  # the latency quantile a promise is made at
DEMO_TIMINGS = 200  # repetitions per exit and batch size in the profile, and samples in the latency evaluation


@dataclass(frozen=True)
class DemoResult:
    """Where the demo wrote its results, and the headline figures."""

    out_dir: Path
    summary: RunSummary
    batch_time: list[dict[str, float]]
    calibration: CalibrationReport
    evaluation: EvaluationReport
    deadlines: PromiseCheck
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


def _deadlines(run: RunFolder) -> PromiseCheck:
    """Profile the exits here (the runtime's answer prices included), then replay test images one at a time at a
    few deadlines: the runtime's promise at each and what it delivered."""
    profile_run(run, ProfileSettings(batch_sizes=(1, 8), repeats=DEMO_TIMINGS, memory=False))
    return check_promises(
        run, PromiseSettings(deadline_count=DEMO_DEADLINES, count=DEMO_REQUESTS, quantile=DEMO_QUANTILE)
    )


def _run(
    work: Path, config: TrainConfig, progress: bool
) -> tuple[RunSummary, list[dict[str, float]], CalibrationReport, EvaluationReport, PromiseCheck]:
    run_dir = work / "run"
    splits = load_splits(config)
    summary = Trainer(config, run_dir, progress=progress).fit(splits=splits)
    plot_training_curves(read_metrics(run_dir), f"{config.model} on {config.data}", work / "training_curves")
    run = RunFolder.open(run_dir)  # once: every stage below reads the same record and fingerprint
    for split in ("val", "test"):
        collect_run(run, split)
    sweep_run(run, list(CRITERIA))
    calibration = calibrate_run(run, CalibrationSettings(max_drop=DEMO_MAX_DROP))
    evaluation = evaluate_run(run, EvaluationSettings(latency_samples=DEMO_TIMINGS))
    info = splits.info
    deadlines = _deadlines(run)
    plot_run(run)

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
        {"config": config.to_dict(), "summary": summary.to_dict(), "batch_time": batch_rows, "deadlines": deadlines.to_dict(),
         "machine": machine, "git_sha": git_sha()},
    )  # fmt: skip
    return summary, batch_rows, calibration, evaluation, deadlines
