"""The pipeline on a run directory: collect, sweep, calibrate, evaluate (real early exit), plot, then
profile on the device, schedule against deadlines and serve with the anytime runtime.

Each function reads what the previous one wrote into the run and writes its own results there
(atomically); the CLI commands of the same names print what these return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.backbones.footprint import check_forward_memory
from anytime.calibrate import (
    Calibration,
    ExitPolicy,
    SweepResult,
    calibrate_budget,
    calibrate_max_drop,
    oracle,
    select_exits,
    sweep,
)
from anytime.data import make_loader
from anytime.errors import AnytimeError
from anytime.families import EnsembleModel
from anytime.outputs import SPLITS, OutputCache, cache_path, collect, load_cache
from anytime.profile.energy import EnergySettings, open_energy_reader
from anytime.profile.store import PROFILE_FORMAT, STEADY_WITHIN, DeviceProfile, Steadiness, device_slug
from anytime.scheduler import DeadlineScheduler
from anytime.scheduler.pricing import DEFAULT_GAP_MS, price_answers
from anytime.scheduler.query import (
    CALIBRATION,
    CALIBRATION_FORMAT,
    find_profile,
    load_calibration,
    run_fingerprint,
    scheduler_for_run,
)  # fmt: skip
from anytime.train.records import class_names, run_title, step_labels
from anytime.train.runs import LoadedRun, dataset_input_shape, load_run, require_images
from anytime.train.splits import load_splits, run_splits
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.memory import hold_freed_memory
from anytime.utils.outputs import check_output_file, output_lock, staged_files
from anytime.utils.threads import set_threads


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise AnytimeError(f"unknown split '{split}'; choose one of {', '.join(SPLITS)}")


def collect_run(
    run_dir: str | Path, split: str, *, device: str = "cpu", batch_size: int = 512, progress: bool = False
) -> OutputCache:
    """Run a trained multi-exit model once over ``split`` and save every exit's logits to ``RUN/outputs/``
    (a progress bar on stderr with ``progress``)."""
    _check_split(split)
    run = load_run(run_dir, device)
    if run.num_steps < 2:
        raise AnytimeError(f"{run_dir} holds a plain model; train it with --exits to collect exits' outputs")
    target = check_output_file(cache_path(run_dir, split), what="output cache", flag="")
    check_forward_memory(run.model, _input_shape(run), batch_size, what=f"collecting at batch {batch_size}",
                         hint="lower --batch-size")  # fmt: skip
    with output_lock(target):
        splits = run_splits(run)
        data = splits.split(split)
        loader = make_loader(data, splits.info, batch_size=batch_size, train=False, seed=run.config.seed)
        model = run.model
        if split == "val" and isinstance(model, EnsembleModel):  # its fusers were fit on this split: cross-fitted
            model = model.heldout_view()
        cache = collect(
            model, loader, split=split, model_fingerprint=run.fingerprint, device=run.device,
            meta={"dataset_fingerprint": splits.info.fingerprint, "model": run.name, "run": str(run.run_dir)},
            progress=progress,
        )  # fmt: skip
        cache.save(target)
    return cache


def _input_shape(run: LoadedRun) -> tuple[int, ...]:
    return dataset_input_shape(run.dataset)


def _cache(run_dir: str | Path, split: str) -> OutputCache:
    return load_cache(run_dir, split, fingerprint=run_fingerprint(run_dir))


def _steps_table(caches: dict[str, OutputCache | None]) -> list[dict[str, Any]]:
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


def _oracle_dict(cache: OutputCache) -> dict[str, Any]:
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


def sweep_run(run_dir: str | Path, criteria: list[str], *, settings: int = 1000, split: str = "val") -> SweepReport:
    """Sweep shared thresholds for each criterion over a run's cache; write ``RUN/sweep-SPLIT.csv`` (every
    setting, with its Pareto flag) and ``RUN/sweep-SPLIT.json`` (the fronts, the oracle, the exits)."""
    _check_split(split)
    cache = _cache(run_dir, split)
    csv_target = check_output_file(Path(run_dir) / f"sweep-{split}.csv", what="sweep", flag="")
    check_output_file(Path(run_dir) / f"sweep-{split}.json", what="sweep", flag="")
    with output_lock(csv_target):
        return _sweep(run_dir, cache, criteria, settings, split)


def _sweep(run_dir: str | Path, cache: OutputCache, criteria: list[str], settings: int, split: str) -> SweepReport:
    # Learned gates are fit on validation only; on another split they score what they never saw.
    val = _cache(run_dir, "val") if split != "val" and "learned" in criteria else None
    results = {name: sweep(cache, name, settings=settings, val=val) for name in criteria}
    rows = []
    fronts: dict[str, list[dict[str, float]]] = {}
    for name, result in results.items():
        front = set(result.pareto().tolist())
        for i, row in enumerate(result.rows()):
            rows.append({"criterion": name, "setting": i, "pareto": int(i in front), **row})
        fronts[name] = result.rows(result.pareto())
    steps = _steps_table({split: cache})
    report = {"split": split, "settings": settings, "base_flops": cache.base_flops, "steps": steps,
              "oracle": _oracle_dict(cache), "pareto": fronts,
              "area_under_curve": {name: result.area() for name, result in results.items()}}  # fmt: skip
    csv_path = write_csv(Path(run_dir) / f"sweep-{split}.csv", rows)
    json_path = write_json(Path(run_dir) / f"sweep-{split}.json", report)
    return SweepReport(split, results, report["oracle"], steps, csv_path, json_path)


def calibrate_run(
    run_dir: str | Path, *, max_drop: float | None = None, budget: float | None = None, criterion: str = "entropy",
    rule: str = "search", temperature: bool = False, out: str | Path | None = None, select: bool = False,
    profile: str | Path | None = None, combine: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Fit thresholds on the validation cache; report validation and (if collected) test side by side.

    The test cache is opened only after the thresholds are fixed, to report them. With ``select`` (and
    ``max_drop``), exits are also selected: every subset of the early exits is costed in the time the run's
    device ``profile`` measured at batch 1 (:func:`~anytime.calibrate.select_exits`). With ``combine``, every
    exit answers with a weighted ensemble of itself and the earlier exits, weights fit on validation
    (:mod:`anytime.calibrate.combine`).
    """
    if (max_drop is None) == (budget is None):
        raise AnytimeError("give exactly one target: --max-drop POINTS or --budget-flops FRACTION")
    if select and max_drop is None:
        raise AnytimeError("--select-exits chooses exits for an accuracy target: give --max-drop POINTS")
    fingerprint = run_fingerprint(run_dir)
    target = check_output_file(Path(out) if out else Path(run_dir) / CALIBRATION, what="calibration",
                               format_tag=CALIBRATION_FORMAT, create_parents=out is None, example=CALIBRATION)  # fmt: skip
    timed = _measured_costs(run_dir, profile, fingerprint) if select else None
    with output_lock(target):
        report = _calibrate(run_dir, fingerprint, max_drop, budget, criterion, rule, temperature, timed, combine)
        write_json(target, report)
    return report


def _measured_costs(
    run_dir: str | Path, profile: str | Path | None, fingerprint: str
) -> tuple[Path, tuple[torch.Tensor, torch.Tensor]]:
    from anytime.calibrate import measured_costs

    path = find_profile(run_dir, profile)
    loaded = DeviceProfile.load(path, fingerprint=fingerprint)
    batch = loaded.at(1)
    if batch.stages is None:
        raise AnytimeError(f"{path} has no stage latencies (the model is not incremental): exits cannot be selected")
    costs = measured_costs([float(s.mean()) for s in batch.steps], [float(s.mean()) for s in batch.stages])
    return path, costs


def _calibrate(
    run_dir: str | Path, fingerprint: str, max_drop: float | None, budget: float | None, criterion: str, rule: str,
    temperature: bool, timed: tuple[Path, tuple[torch.Tensor, torch.Tensor]] | None = None, combine: bool = False,
) -> dict[str, Any]:  # fmt: skip
    val = load_cache(run_dir, "val", fingerprint=fingerprint)
    calibration: Calibration
    extra: dict[str, Any] = {}
    if timed is not None:
        assert max_drop is not None
        path, costs = timed
        calibration, tried = select_exits(val, max_drop=max_drop, costs=costs, criterion=criterion,
                                          temperature=temperature, combine=combine)  # fmt: skip
        backbone_ms = float(costs[0][-1])
        kept = [k for k, t in enumerate(calibration.policy.thresholds) if t is not None]
        extra["selection"] = {
            "profile": str(path), "cost": "mean ms at batch 1, measured", "backbone_ms": backbone_ms, "exits": kept,
            "subsets": [{"exits": list(t.exits), "val_accuracy": t.accuracy, "val_mean_ms": t.mean_ms,
                         "val_speedup": backbone_ms / t.mean_ms, "reaches_target": t.reaches_target} for t in tried],
        }  # fmt: skip
    elif max_drop is not None:
        calibration = calibrate_max_drop(val, max_drop=max_drop, criterion=criterion, temperature=temperature,
                                         combine=combine)  # fmt: skip
    else:
        assert budget is not None
        calibration = calibrate_budget(val, budget=budget, criterion=criterion, rule=rule, temperature=temperature,
                                       combine=combine)  # fmt: skip
        other = "msdnet" if rule == "search" else "search"
        alt = calibrate_budget(val, budget=budget, criterion=criterion, rule=other, temperature=temperature,
                               combine=combine)  # fmt: skip
        extra["alternative"] = {"rule": alt.rule, "policy": alt.policy.to_dict(), "validation": alt.fit.to_dict()}
    test_path = cache_path(run_dir, "test")
    test = load_cache(run_dir, "test", fingerprint=fingerprint) if test_path.is_file() else None
    if test is not None and timed is not None:
        step_ms, cost_ms = timed[1]
        policy = calibration.policy
        share = torch.tensor([policy.evaluate(test).exit_share], dtype=torch.float64)
        test_ms = float((share * policy.leave_costs(step_ms, cost_ms)).sum())
        extra["selection"].update(test_mean_ms=test_ms, test_speedup=float(step_ms[-1]) / test_ms)
    if test is not None and "alternative" in extra:
        alt_policy = ExitPolicy.from_dict(extra["alternative"]["policy"])
        extra["alternative"]["test"] = alt_policy.evaluate(test).to_dict()
    report = {
        "format": CALIBRATION_FORMAT, "run": str(run_dir), "model_fingerprint": fingerprint,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rule": calibration.rule,
        "target": calibration.target, "policy": calibration.policy.to_dict(), "base_flops": val.base_flops,
        "validation": {**calibration.fit.to_dict(), "last_exit_accuracy": float(val.step_accuracy()[-1])},
        "test": None if test is None else {
            **calibration.policy.evaluate(test).to_dict(), "last_exit_accuracy": float(test.step_accuracy()[-1])},
        "oracle": {"validation": _oracle_dict(val), "test": None if test is None else _oracle_dict(test)},
        "steps": _steps_table({"val": val, "test": test}), **extra,
    }  # fmt: skip
    if calibration.policy.combine is not None:
        report["combined_steps"] = _steps_table(
            {"val": calibration.policy.seen_by(val), "test": None if test is None else calibration.policy.seen_by(test)}
        )
    return report


def evaluate_run(
    run_dir: str | Path, *, calibration: str | Path | None = None, split: str = "test", device: str = "cpu",
    latency_samples: int = 1000, batch_size: int = 256, form: str = "eager", progress: bool = False,
    export: str | Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Real early exit on ``split`` with the calibrated policy: accuracy, exit shares and FLOPs, agreement
    with the cached sweep's prediction, and the measured latency per sample at batch 1 against the plain
    backbone (the same samples, taking turns in runs of 50-100), both in the inference ``form``. Written to
    ``RUN/evaluation-SPLIT.json`` (a progress bar on stderr with ``progress``).

    ``export``: a folder ``anytime export`` wrote from this run. Early exit then runs as deployed, on the CPU: an
    ONNX export with the policy compiled into its graphs (:meth:`~anytime.deploy.export.ExportedModel.exit_program`),
    a ``.pt2`` one through its programs; the backbone it is timed against is the export's segments run in turn
    (no heads). Written to ``EXPORT/evaluation-SPLIT.json``."""
    _check_split(split)
    hold_freed_memory()  # its latencies, as a profile's, are what the runtime meets
    if export is not None:
        if form != "eager":
            raise AnytimeError("an export runs as it was exported; --form applies to the run's own PyTorch model")
        device = "cpu" if device == "auto" else device
        if resolve_device(device).type != "cpu":
            raise AnytimeError(f"{export} is evaluated on the CPU here (ONNX Runtime, or the .pt2 programs); "
                               "pass --device cpu")  # fmt: skip
    run = load_run(run_dir, device, form=form)
    if run.num_steps < 2:
        raise AnytimeError(f"{run_dir} holds a plain model; there is no early exit to evaluate")
    if export is not None:
        require_images(run, "anytime evaluate --export")
    policy, _ = load_calibration(
        calibration or Path(run_dir) / CALIBRATION, fingerprint=run.fingerprint, num_steps=run.num_steps
    )
    num_classes = int(run.dataset["num_classes"])
    policy.check(run.num_steps, num_classes)
    model = run.model if export is None else _export_of(run, Path(export))
    folder = Path(run_dir) if export is None else Path(export)
    target = check_output_file(folder / f"evaluation-{split}.json", what="evaluation", flag="")
    with output_lock(target):
        report = _evaluate(run, model, policy, split, latency_samples, batch_size, progress)
        if export is None:
            report["form"] = run.form
        else:
            manifest = model.manifest  # type: ignore[union-attr]
            report["form"] = f"export: {manifest.format} {manifest.precision} ({model.backend})"  # type: ignore[union-attr]
            report["export"] = str(export)
            report["compiled_policy"] = model.exit_program(policy) is not None  # type: ignore[union-attr,operator]
        write_json(target, report)
    return report


def _export_of(run: LoadedRun, folder: Path) -> torch.nn.Module:
    """The export in ``folder``, refused unless it was exported from ``run`` as it is now."""
    from anytime.deploy.export import load_export

    exported = load_export(folder, threads=torch.get_num_threads())
    if exported.manifest.parent_fingerprint != run.fingerprint:
        raise AnytimeError(f"{folder} was not exported from {run.run_dir} as it is now (another run, or the run "
                           f"changed since); export it again: anytime export {run.run_dir} --format onnx --out DIR")  # fmt: skip
    return exported


def _evaluate(run: LoadedRun, model: torch.nn.Module, policy: ExitPolicy, split: str, latency_samples: int,
              batch_size: int, progress: bool = False) -> dict[str, Any]:  # fmt: skip
    from anytime.utils.progress import progress_bar

    run_dir = run.run_dir
    splits = run_splits(run)
    data = splits.split(split)
    loader = make_loader(data, splits.info, batch_size=batch_size, train=False, seed=run.config.seed)
    predictions, exits, labels = [], [], []
    bar = progress_bar(len(data), f"evaluate {split}", enabled=progress, unit="sample")
    try:
        for x, y in loader:
            out = policy.run(model, x.to(run.device))
            predictions.append(out.predictions.cpu())
            exits.append(out.exits.cpu())
            labels.append(y)
            bar.update(len(y))
    finally:
        bar.close()
    pred = torch.cat(predictions).numpy()
    exit_of = torch.cat(exits).numpy()
    truth = torch.cat(labels).numpy()
    info = run.model.exit_info  # type: ignore[union-attr]
    cost = policy.leave_costs(torch.tensor([e.flops for e in info], dtype=torch.float64),
                              torch.tensor([e.cost_flops for e in info], dtype=torch.float64)).numpy()  # fmt: skip
    base = int(run.model.backbone_flops)  # type: ignore[union-attr]
    report: dict[str, Any] = {
        "run": str(run_dir), "split": split, "policy": policy.to_dict(), "samples": int(truth.size),
        "accuracy": float((pred == truth).mean()),
        "exit_share": (np.bincount(exit_of, minlength=run.num_steps) / truth.size).tolist(),
        "mean_flops": float(cost[exit_of].mean()), "base_flops": base,
    }  # fmt: skip
    report["flops_ratio"] = report["mean_flops"] / base
    if cache_path(run_dir, split).is_file():
        cache = load_cache(run_dir, split, fingerprint=run.fingerprint)
        cached_exit = policy.assign(cache)
        cache = policy.seen_by(cache)
        cached_pred = cache.logits[cached_exit, np.arange(cache.num_samples)].argmax(axis=1)
        report["agreement_with_cache"] = {"exits": float((cached_exit == exit_of).mean()),
                                          "predictions": float((cached_pred == pred).mean())}  # fmt: skip
    if latency_samples > 0:  # a random sample: an image folder's split is stored class by class
        chosen = data.sample(latency_samples, seed=run.config.seed)
        if splits.info.modality == "text":  # every sentence timed at its own length, unpadded
            timed = make_loader(chosen, splits.info, batch_size=1, train=False, seed=run.config.seed)
            report["latency"] = _latency(model, policy, [x.to(run.device) for x, _ in timed], progress)
        else:
            timed = make_loader(chosen, splits.info, batch_size=batch_size, train=False, seed=run.config.seed)
            report["latency"] = _latency(model, policy, torch.cat([x for x, _ in timed]).to(run.device), progress)
    report["machine"] = describe_machine()
    report["device"] = device_label(run.device)
    report["torch_threads"] = torch.get_num_threads()
    report["git_sha"] = git_sha()
    return report


_LATENCY_CHUNK = 100  # samples timed between two moves of the progress bar
_LATENCY_TURN = 50  # per_sample_latency's turns: each way of answering then runs 50-100 samples in a row


def _latency(model: torch.nn.Module, policy: ExitPolicy, images: torch.Tensor | list[torch.Tensor],
             progress: bool = False) -> dict[str, Any]:  # fmt: skip
    from anytime.profile import latency_summary, per_sample_latency
    from anytime.utils.progress import progress_bar

    functions = {"early_exit": policy.runner(model), "backbone": lambda x: model.backbone(x)}  # type: ignore[union-attr]
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in functions}
    bar = progress_bar(len(images), "latency", enabled=progress, unit="sample")
    try:  # timed in chunks (an even count: the interleaving order alternates on), the bar moving between them
        for start in range(0, len(images), _LATENCY_CHUNK):
            chunk = images[start : start + _LATENCY_CHUNK]
            warmup = min(20, len(chunk)) if start == 0 else 0
            for name, values in per_sample_latency(functions, chunk, warmup=warmup, turn=_LATENCY_TURN).items():
                chunks[name].append(values)
            bar.update(len(chunk))
    finally:
        bar.close()
    times = {name: np.concatenate(values) for name, values in chunks.items()}
    early, plain = latency_summary(times["early_exit"]), latency_summary(times["backbone"])
    return {"batch_size": 1, "turn": _LATENCY_TURN, "early_exit": early, "backbone": plain,
            "mean_ratio": early["mean_ms"] / plain["mean_ms"],
            "speedup": plain["mean_ms"] / early["mean_ms"] if early["mean_ms"] > 0 else math.nan}  # fmt: skip


@dataclass(frozen=True)
class PlotReport:
    """The figures ``plot_run`` wrote, and each section it could not draw with the reason."""

    paths: list[Path]
    skipped: list[str]


def plot_run(
    run_dir: str | Path, *, criteria: list[str] | None = None, settings: int = 400, profile: str | Path | None = None,
    figure_size: str = "screen",
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
    val = _cache(run_dir, "val")
    folder = Path(run_dir) / "plots" / ("" if figure_size == "screen" else figure_size)
    check_output_file(folder / "pareto.png", what="figure", flag="")
    skipped: list[str] = []
    report = None
    calibration = Path(run_dir) / CALIBRATION
    if calibration.is_file():
        _, report = load_calibration(calibration, fingerprint=val.model_fingerprint, num_steps=val.num_steps)
    else:
        skipped.append(f"exit histogram: no {CALIBRATION} in {run_dir}; run `anytime calibrate {run_dir} --max-drop 1`")
    rows = read_metrics(run_dir) if (Path(run_dir) / "metrics.csv").is_file() else []
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


def default_profile_path(run_dir: str | Path, device: torch.device, *, length: int | None = None) -> Path:
    """Where ``anytime profile`` writes by default: ``RUN/profile-<device>.json``, named as the profile names
    the device (``-T<length>`` added for a text run's sentence length)."""
    bucket = "" if length is None else f"-T{length}"
    return Path(run_dir) / f"profile-{device_slug({'type': device.type, 'label': device_label(device)})}{bucket}.json"


PROFILE_IMAGES = 512  # validation images a data-dependent model is timed on


def _real_inputs(run: LoadedRun, model: torch.nn.Module) -> torch.Tensor | None:
    """The validation images to time a model whose cost depends on them (None for any other)."""
    if not getattr(model, "data_dependent_cost", False):
        return None
    from anytime.data.augment import normalize

    splits = load_splits(run.config, run.run_dir)
    count = min(PROFILE_IMAGES, len(splits.val))
    return normalize(splits.val.images[torch.arange(count)], splits.info.mean, splits.info.std)


def _pricing_policy(run_dir: str | Path, fingerprint: str | None, num_steps: int) -> ExitPolicy | None:
    """The run's calibrated policy, if it has one: what its requests consult on the way through the heads."""
    path = Path(run_dir) / CALIBRATION
    if num_steps < 2 or not path.is_file():
        return None
    policy, _ = load_calibration(path, fingerprint=fingerprint, num_steps=num_steps)
    return policy


def profile_run(
    run_dir: str | Path, *, batch_sizes: list[int] | None = None, repeats: int = 200, warmup: int = 10,
    device: str = "cpu", train: bool = False, memory: bool = True, out: str | Path | None = None,
    progress: bool = False, form: str = "eager", threads: int | str | None = None, energy: EnergySettings | None = None,
    execution: str | None = None, slowdown: float = 1.0, gap_ms: float = 0.0, suffixes: bool = False,
    length: int | None = None, steady_within: float | None = STEADY_WITHIN, attempts: int = 3,
    answer_gap_ms: float | None = DEFAULT_GAP_MS,
) -> tuple[DeviceProfile, Path]:  # fmt: skip
    """Profile a finished run's model, or an export's artifacts (``anytime export``), on this device (synthetic
    inputs, so no dataset is needed, except for SACT: see below) and save it. ``form`` is the inference form measured and ``threads`` the torch
    threads (a number, ``auto``: chosen from the cores the machine leaves free, or None: as they are); both are
    recorded in the profile, and the runtime runs with them. ``energy`` adds joules per inference, measured with the
    device's energy source (refused before any measurement when none is readable). A model whose cost depends on
    the image (SACT) is timed on the run's validation images instead (so its data must be on this machine), in its
    ``execution`` (``sparse`` or ``dense``; default the model's own), which the profile records and the runtime
    runs. ``slowdown`` > 1 profiles a slower board emulated here (:func:`anytime.profile.slowed.slowed_model`),
    recorded as ``emulated_slowdown``, for ``anytime split-run --emulate-slowdown``. ``gap_ms`` idles before every
    timed repetition, as a server idles between sporadic requests; ``suffixes`` also times what a split-computing
    server runs after each partition point (``anytime split`` prices the server's part from it). A text run is
    timed on sentences of ``length`` tokens (default its maximum length), as a sentence costs what its length
    costs; its default file is ``RUN/profile-<device>-T<length>.json``, one per length bucket.

    On a CPU the peak memory of each batch size is measured in a fresh process (random inputs, the model's default
    execution); on a GPU, by the allocator.

    A profile taken while other work came and went on the machine is taken again: where the tails of the
    repetitions' two halves part by more than ``steady_within`` (a share; :meth:`DeviceProfile.steadiness`), up to
    ``attempts`` profiles in all, and the steadiest is kept, its spread recorded (``settings.steadiness``).
    ``steady_within=None`` takes one profile, as does an energy measurement.

    Last, the runtime's answer prices are timed (:func:`anytime.scheduler.pricing.price_answers`, the run's
    calibrated policy consulted on the way through the heads where it has one), requests spaced by idle gaps of
    mean ``answer_gap_ms`` (0: back to back; None: no prices, the model's own latencies price the options).
    """
    from anytime.deploy.export import MANIFEST
    from anytime.profile import DEFAULT_BATCH_SIZES, profile_model, run_isolated
    from anytime.profile.memory import inference_memory

    if steady_within is not None and not (steady_within > 0 and math.isfinite(steady_within)):
        raise AnytimeError(f"--steady-within is a share above 0, e.g. 0.25, or off (got {steady_within})")
    if attempts < 1:
        raise AnytimeError(f"attempts must be at least 1 (got {attempts})")
    if not 0 <= gap_ms < 60_000:
        raise AnytimeError(f"--gap-ms is an idle time in milliseconds between 0 and 60000 (got {gap_ms:g})")
    choice = set_threads(threads)
    hold_freed_memory()  # the runtime holds it too (runner_for_run): both meet the same allocator
    if (Path(run_dir) / MANIFEST).is_file():
        if length is not None:
            raise AnytimeError(f"{run_dir} is an export of images; --length is a text run's sentence length")
        if form != "eager":
            raise AnytimeError(f"{run_dir} is an export: its artifacts run as exported; --form applies to a run")
        model, shape, name, fingerprint, classes, target_device = _export_target(run_dir, device, train)
        inputs = None
    else:
        if train and form != "eager":
            raise AnytimeError("--train times the training graph: profile it with --form eager")
        run = load_run(run_dir, device, form=form)
        model, shape, name, fingerprint = run.model, _input_shape(run), run.name, run.fingerprint
        if run.dataset.get("modality") == "text":
            if length is not None and not 2 <= length <= shape[0]:
                raise AnytimeError(f"--length {length}: {run_dir} reads sentences of 2 to {shape[0]} tokens "
                                   "([CLS] included; longer ones are cut to its maximum)")  # fmt: skip
            shape = (length or shape[0],)
        classes, target_device = int(run.dataset["num_classes"]), run.device
        inputs = _real_inputs(run, model)
    if execution is not None:
        if not hasattr(model, "execution"):
            raise AnytimeError("--execution chooses how a SACT run skips positions; this run has no such choice")
        model.execution = execution  # type: ignore[assignment]
    if slowdown != 1:
        from anytime.profile.slowed import slowed_model

        if train or energy is not None:
            raise AnytimeError("--emulate-slowdown emulates a board's inference time; profile --train or --energy "
                               "without it")  # fmt: skip
        model = slowed_model(model, slowdown)
    sizes = batch_sizes or list(DEFAULT_BATCH_SIZES)
    if length is not None and len(shape) != 1:
        raise AnytimeError(f"--length is a sentence length in tokens; {run_dir} is an image run")
    default = default_profile_path(run_dir, target_device, length=shape[0] if len(shape) == 1 else None)
    target = check_output_file(Path(out) if out else default, what="profile", format_tag=PROFILE_FORMAT, create_parents=out is None,
                               example="profile.json")  # fmt: skip
    largest = max(sizes)
    check_forward_memory(model, shape, largest, training=train, what=f"profiling at batch {largest}",
                         hint="profile smaller --batch-sizes, e.g. 1,8,16,32")  # fmt: skip

    def probe(sizes: list[int]) -> dict[int, dict[str, Any]]:
        threads = torch.get_num_threads()
        try:
            return {b: run_isolated(inference_memory, str(run_dir), b, threads=threads, timeout_s=600) for b in sizes}
        except RuntimeError as exc:
            raise AnytimeError(f"the peak-memory measurement failed ({exc}); profile with --no-memory") from None

    reader = None if energy is None else open_energy_reader(target_device.type, target_device.index)
    tries = 1 if steady_within is None or energy is not None else attempts
    try:
        with output_lock(target):
            profile: DeviceProfile | None = None
            kept: Steadiness | None = None
            for attempt in range(1, tries + 1):
                taken = profile_model(
                    model, shape, batch_sizes=sizes, repeats=repeats, warmup=warmup, device=target_device,
                    model_name=name, fingerprint=fingerprint, num_classes=classes, train=train,
                    memory=probe if memory and attempt == 1 else None, progress=progress, energy=reader,
                    energy_settings=energy or EnergySettings(), inputs=inputs,
                    inputs_label=f"{0 if inputs is None else inputs.shape[0]} validation images, in turn",
                    gap_s=gap_ms / 1000, suffixes=suffixes,
                )  # fmt: skip
                steady = taken.steadiness()
                if profile is None:
                    first = taken
                elif kept is not None and steady.spread >= kept.spread:
                    continue
                profile, kept = taken, steady
                if steady_within is not None and steady.spread <= steady_within:
                    break
            assert profile is not None
            if profile is not first:  # the peak memory was measured once, with the first attempt
                profile = replace(profile, latency={b: replace(at, memory=first.latency[b].memory)
                                                    for b, at in profile.latency.items()})  # fmt: skip
            profile = replace(
                profile,
                settings={
                    **profile.settings,
                    "steadiness": {
                        "spread": round(kept.spread, 4),
                        "where": kept.where,
                        "attempts": attempt,
                        "within": steady_within,
                    },
                },
            )
            if choice is not None:
                profile = replace(profile, settings={**profile.settings, "threads_chosen": choice.to_dict()})
            if slowdown != 1:
                profile = replace(profile, settings={**profile.settings, "emulated_slowdown": float(slowdown)})
            if answer_gap_ms is not None:
                profile = price_answers(model, profile, policy=_pricing_policy(run_dir, fingerprint, profile.num_steps),
                                        repeats=repeats, gap_ms=answer_gap_ms, inputs=inputs)  # fmt: skip
            path = profile.save(target)
    finally:
        if reader is not None:
            reader.close()
    return profile, path


def _export_target(
    folder: str | Path, device: str, train: bool
) -> tuple[torch.nn.Module, tuple[int, ...], str, str, int, torch.device]:
    """An export's artifacts as ``profile_run`` measures them: on the CPU (ONNX through ONNX Runtime)."""
    from anytime.deploy.export import load_export

    if train:
        raise AnytimeError(f"{folder} is an export (inference artifacts); profile training with its float run")
    if resolve_device(device).type != "cpu":
        raise AnytimeError(f"{folder} is profiled on the CPU here; on a GPU board build a TensorRT engine from the ONNX "
                           "export and time it with trtexec (see docs/guides/export.md, On a Jetson)")  # fmt: skip
    exported = load_export(folder)
    manifest = exported.manifest
    name = f"{manifest.model} ({manifest.format} {manifest.precision}, {exported.backend})"
    return exported, manifest.input_shape, name, manifest.fingerprint, manifest.num_classes, torch.device("cpu")
