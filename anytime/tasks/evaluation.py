"""Evaluate a run: real early exit on a split with its calibrated policy, and the latency per sample at batch 1."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.calibrate import (
    ExitPolicy,
)
from anytime.data import make_loader
from anytime.errors import AnytimeError
from anytime.outputs import cache_path, load_cache
from anytime.scheduler.query import (
    CALIBRATION,
    load_calibration,
)  # fmt: skip
from anytime.tasks.collect import check_split
from anytime.train.runs import LoadedRun, load_run, require_images
from anytime.train.splits import run_splits
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.memory import hold_freed_memory
from anytime.utils.outputs import check_output_file, output_lock


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
    ONNX export with the policy compiled into its graphs (:meth:`~anytime.deploy.loader.ExportedModel.exit_program`),
    a ``.pt2`` one through its programs; the backbone it is timed against is the export's segments run in turn
    (no heads). Written to ``EXPORT/evaluation-SPLIT.json``."""
    check_split(split)
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
    from anytime.deploy.loader import load_export

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
