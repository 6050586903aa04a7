"""Plot a run: accuracy against cost, thresholds, exits, training, deadlines and latency (``RUN/plots/``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.calibrate import (
    SweepResult,
    oracle,
    sweep,
)
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache
from anytime.scheduler import DeadlineScheduler
from anytime.scheduler.query import (
    CALIBRATION,
    load_calibration,
    scheduler_for_run,
)  # fmt: skip
from anytime.tasks.collect import run_cache
from anytime.train.folder import RunFolder, open_run
from anytime.train.records import class_names, run_title, step_labels
from anytime.utils.outputs import check_output_file, output_lock, staged_files


@dataclass(frozen=True)
class PlotReport:
    """The figures ``plot_run`` wrote, and each section it could not draw with the reason."""

    paths: list[Path]
    skipped: list[str]


def plot_run(
    run: RunFolder | str | Path, *, criteria: list[str] | None = None, settings: int = 400,
    profile: str | Path | None = None, figure_size: str = "screen",
) -> PlotReport:  # fmt: skip
    """The run's figures into ``RUN/plots/``: accuracy vs mean FLOPs (Pareto per criterion, the oracle and
    every exit alone), accuracy vs threshold, each exit's reliability diagram and its accuracy per class, the
    calibrated exit histogram, per-exit accuracy by epoch, and, once the run is profiled, accuracy vs deadline and
    the latency distributions.

    Everything that can refuse (the caches, the calibration, the profile) is read before any figure is drawn,
    and the figures replace the old ones all together or not at all. A section that cannot be drawn is named
    in ``skipped`` with the reason (by the rule ``schedule`` follows for profiles); a ``profile`` given
    explicitly must be usable. At a paper's ``figure_size`` (``page`` or ``column``) the figures go to
    ``RUN/plots/SIZE/`` instead, beside the screen-sized ones the report page shows.
    """
    from anytime.calibrate import CRITERIA
    from anytime.plotting.layout import figure_size as sized
    from anytime.train import read_metrics
    from anytime.utils.figure_sizes import FIGURE_SIZES

    if figure_size not in FIGURE_SIZES:
        raise AnytimeError(f"unknown figure size '{figure_size}'; choose one of: {', '.join(FIGURE_SIZES)}")
    opened = open_run(run)
    run_dir = opened.path
    val = run_cache(opened, "val")
    folder = run_dir / "plots" / ("" if figure_size == "screen" else figure_size)
    check_output_file(folder / "pareto.png", what="figure", flag="")
    skipped: list[str] = []
    report = None
    calibration = run_dir / CALIBRATION
    if calibration.is_file():
        _, report = load_calibration(calibration, fingerprint=val.model_fingerprint, num_steps=val.num_steps)
    else:
        skipped.append(f"exit histogram: no {CALIBRATION} in {run_dir}; run `anytime calibrate {run_dir} --max-drop 1`")
    rows = read_metrics(run_dir) if (run_dir / "metrics.csv").is_file() else []
    if not (rows and any(key.startswith("val_acc_exit") for key in rows[0])):
        skipped.append(f"accuracy by epoch: {run_dir} has no per-exit training metrics (a run made without training)")
        rows = []
    scheduler = None
    if profile is not None:
        scheduler, _ = scheduler_for_run(run_dir, profile)
    else:
        try:
            scheduler, _ = scheduler_for_run(run_dir, None)
        except AnytimeError as exc:
            skipped.append(f"deadline plots: {exc}")
    results = {name: sweep(val, name, settings=settings) for name in list(criteria or CRITERIA)}
    with output_lock(folder), staged_files(folder) as work, sized(figure_size):
        labels = list(step_labels(run_dir, val.step_names))
        classes = class_names(run_dir)
        names = _draw_run(run_title(run_dir), work, val, results, report, rows, scheduler, labels, classes)
    for stem, drawn in (("exit_histogram", report is not None), ("exit_accuracy", bool(rows)),
                        ("deadline_accuracy", scheduler is not None), ("latency", scheduler is not None),
                        ("energy", scheduler is not None and scheduler.profile.energy is not None)):  # fmt: skip
        if not drawn:  # an earlier figure of a section not drawn now would be mistaken for a current one
            for old in (folder / f"{stem}.png", folder / f"{stem}.svg", folder / f"{stem}.pdf"):
                old.unlink(missing_ok=True)
    return PlotReport([folder / name for name in names], skipped)


def _draw_run(
    title: str, work: Path, val: OutputCache, results: dict[str, SweepResult], report: dict[str, Any] | None,
    rows: list[dict[str, str]], scheduler: DeadlineScheduler | None, labels: list[str], classes: list[str] | None,
) -> list[str]:  # fmt: skip
    from anytime.plotting import (
        plot_class_accuracy,
        plot_deadline_accuracy,
        plot_energy_accuracy,
        plot_exit_accuracy_epochs,
        plot_exit_histogram,
        plot_exit_pareto,
        plot_latency_distributions,
        plot_reliability,
        plot_threshold_curves,
    )

    paths = plot_exit_pareto(results, val, oracle(val), work / "pareto", title, labels)
    paths += plot_threshold_curves(results, work / "threshold", title)
    paths += plot_reliability(val, labels, work / "reliability", title)
    paths += plot_class_accuracy(val, labels, classes, work / "class_accuracy", title)
    if report is not None:
        paths += plot_exit_histogram(report, labels, work / "exit_histogram", title)
    if rows:
        paths += plot_exit_accuracy_epochs(rows, labels, work / "exit_accuracy", title)
    if scheduler is not None:
        quantile = scheduler.profile.highest_quantile()
        batch = min(scheduler.profile.batch_sizes)
        paths += plot_deadline_accuracy(scheduler, work / "deadline_accuracy", title, quantile=quantile, batch_size=batch,
                                        samples=val.num_samples)  # fmt: skip
        paths += plot_latency_distributions(scheduler.profile, work / "latency", title, batch_size=batch)
        if scheduler.profile.energy is not None:
            paths += plot_energy_accuracy(scheduler, work / "energy", title, quantile=quantile, batch_size=batch)
    return [p.name for p in paths]
