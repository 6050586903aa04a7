"""Evaluate a run: real early exit on a split with its calibrated policy, and the latency per sample at batch 1."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
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
from anytime.train.folder import RunFolder, open_run
from anytime.train.runs import LoadedRun, require_images
from anytime.train.splits import run_splits
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.memory import hold_freed_memory
from anytime.utils.outputs import check_output_file, output_lock
from anytime.utils.stats import PairedRatio, paired_ratio


@dataclass(frozen=True)
class LatencyFigures:
    """One way of answering's batch-1 latency over the samples timed (milliseconds; the medians' and p99s' 95%
    bootstrap intervals)."""

    mean_ms: float
    std_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int
    p50_ci95_ms: tuple[float, float]
    p99_ci95_ms: tuple[float, float]

    @classmethod
    def of(cls, seconds: np.ndarray) -> LatencyFigures:
        """The figures of a sample of latencies in seconds."""
        from anytime.profile import latency_summary

        d: dict[str, Any] = latency_summary(seconds)
        return cls(**{**d, "p50_ci95_ms": tuple(d["p50_ci95_ms"]), "p99_ci95_ms": tuple(d["p99_ci95_ms"])})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as ``latency_summary`` writes it."""
        return {**asdict(self), "p50_ci95_ms": list(self.p50_ci95_ms), "p99_ci95_ms": list(self.p99_ci95_ms)}


@dataclass(frozen=True)
class LatencyComparison:
    """Early exit against the plain backbone at batch 1, the same samples timed taking turns of ``turn``."""

    early_exit: LatencyFigures
    backbone: LatencyFigures
    turn: int
    batch_size: int = 1
    paired: PairedRatio | None = None  # the backbone's time over early exit's, turn by turn (the speed-up's rounds)

    @property
    def mean_ratio(self) -> float:
        """Early exit's mean latency over the backbone's."""
        return self.early_exit.mean_ms / self.backbone.mean_ms

    @property
    def speedup(self) -> float:
        """The backbone's mean latency over early exit's."""
        return self.backbone.mean_ms / self.early_exit.mean_ms if self.early_exit.mean_ms > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the ratio and the speed-up."""
        paired = None  # a bound too few rounds cannot give is written as null, not as JSON's non-standard Infinity
        if self.paired is not None:
            paired = {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(self.paired).items()
            }
        return {"batch_size": self.batch_size, "turn": self.turn, "early_exit": self.early_exit.to_dict(),
                "backbone": self.backbone.to_dict(), "mean_ratio": self.mean_ratio, "speedup": self.speedup,
                "paired_speedup": paired}  # fmt: skip


@dataclass(frozen=True)
class Agreement:
    """How often real early exit left where the cached sweep says it leaves, and answered as it says."""

    exits: float
    predictions: float


@dataclass(frozen=True)
class EvaluationReport:
    """Real early exit on a split with a calibrated policy (``RUN/evaluation-SPLIT.json``): accuracy, where
    samples left, mean FLOPs against the backbone's, agreement with the cached sweep (when the split was
    collected), the batch-1 latency against the backbone (when timed), and what ran where."""

    run: str
    split: str
    policy: ExitPolicy
    samples: int
    accuracy: float
    exit_share: tuple[float, ...]
    mean_flops: float
    base_flops: int
    form: str
    machine: dict[str, Any]
    device: str
    torch_threads: int
    git_sha: str | None
    agreement_with_cache: Agreement | None = None
    latency: LatencyComparison | None = None
    export: str | None = None  # the export folder that ran, if one did
    compiled_policy: bool | None = None  # an export's: whether the policy ran compiled into its graphs

    @property
    def flops_ratio(self) -> float:
        """Mean FLOPs per sample over the backbone's."""
        return self.mean_flops / self.base_flops

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as written to the evaluation file."""
        d: dict[str, Any] = {
            "run": self.run, "split": self.split, "policy": self.policy.to_dict(), "samples": self.samples,
            "accuracy": self.accuracy, "exit_share": list(self.exit_share), "mean_flops": self.mean_flops,
            "base_flops": self.base_flops, "flops_ratio": self.flops_ratio,
        }  # fmt: skip
        if self.agreement_with_cache is not None:
            d["agreement_with_cache"] = {"exits": self.agreement_with_cache.exits,
                                         "predictions": self.agreement_with_cache.predictions}  # fmt: skip
        if self.latency is not None:
            d["latency"] = self.latency.to_dict()
        d.update(machine=self.machine, device=self.device, torch_threads=self.torch_threads, git_sha=self.git_sha,
                 form=self.form)  # fmt: skip
        if self.export is not None:
            d.update(export=self.export, compiled_policy=self.compiled_policy)
        return d


@dataclass(frozen=True)
class EvaluationSettings:
    """What :func:`evaluate_run` measures: the ``split`` it answers, in batches of ``batch_size`` for accuracy,
    ``latency_samples`` of it timed one at a time (0: no timing), all in the inference ``form`` (``eager``, or e.g.
    ``fold+channels-last``)."""

    split: str = "test"
    latency_samples: int = 1000
    batch_size: int = 256
    form: str = "eager"


def evaluate_run(
    run: RunFolder | str | Path, settings: EvaluationSettings | None = None, *, calibration: str | Path | None = None,
    device: str = "cpu", progress: bool = False, export: str | Path | None = None,
) -> EvaluationReport:  # fmt: skip
    """Real early exit on ``settings.split`` with the calibrated policy (``calibration``, default the run's):
    accuracy, exit shares and FLOPs, agreement with the cached sweep's prediction, and the measured latency per
    sample at batch 1 against the plain backbone (the same samples, taking turns in runs of 50-100), both in the
    inference form. Written to ``RUN/evaluation-SPLIT.json`` (a progress bar on stderr with ``progress``).

    ``export``: a folder ``anytime export`` wrote from this run. Early exit then runs as deployed, on the CPU: an
    ONNX export with the policy compiled into its graphs (:meth:`~anytime.deploy.loader.ExportedModel.exit_program`),
    a ``.pt2`` one through its programs; the backbone it is timed against is the export's segments run in turn
    (no heads). Written to ``EXPORT/evaluation-SPLIT.json``."""
    settings = settings or EvaluationSettings()
    split, form = settings.split, settings.form
    check_split(split)
    hold_freed_memory()  # its latencies, as a profile's, are what the runtime meets
    if export is not None:
        if form != "eager":
            raise AnytimeError("an export runs as it was exported; --form applies to the run's own PyTorch model")
        device = "cpu" if device == "auto" else device
        if resolve_device(device).type != "cpu":
            raise AnytimeError(f"{export} is evaluated on the CPU here (ONNX Runtime, or the .pt2 programs); "
                               "pass --device cpu")  # fmt: skip
    opened = open_run(run)
    loaded = opened.load(device, form=form)
    if loaded.num_steps < 2:
        raise AnytimeError(f"{opened.path} holds a plain model; there is no early exit to evaluate")
    if export is not None:
        require_images(loaded, "anytime evaluate --export")
    policy, _ = load_calibration(
        calibration or opened.path / CALIBRATION, fingerprint=loaded.fingerprint, num_steps=loaded.num_steps
    )
    num_classes = int(loaded.dataset["num_classes"])
    policy.check(loaded.num_steps, num_classes)
    model = loaded.model if export is None else _export_of(loaded, Path(export))
    folder = opened.path if export is None else Path(export)
    target = check_output_file(folder / f"evaluation-{split}.json", what="evaluation", flag="")
    with output_lock(target):
        report = _evaluate(loaded, model, policy, settings, progress)
        if export is not None:
            manifest = model.manifest  # type: ignore[union-attr]
            report = replace(report, form=f"export: {manifest.format} {manifest.precision} ({model.backend})",  # type: ignore[union-attr]
                             export=str(export), compiled_policy=model.exit_program(policy) is not None)  # type: ignore[union-attr,operator]  # fmt: skip
        write_json(target, report.to_dict())
    return report


def _export_of(run: LoadedRun, folder: Path) -> torch.nn.Module:
    """The export in ``folder``, refused unless it was exported from ``run`` as it is now."""
    from anytime.deploy.loader import load_export

    exported = load_export(folder, threads=torch.get_num_threads())
    if exported.manifest.parent_fingerprint != run.fingerprint:
        raise AnytimeError(f"{folder} was not exported from {run.run_dir} as it is now (another run, or the run "
                           f"changed since); export it again: anytime export {run.run_dir} --format onnx --out DIR")  # fmt: skip
    return exported


def _evaluate(run: LoadedRun, model: torch.nn.Module, policy: ExitPolicy, settings: EvaluationSettings,
              progress: bool = False) -> EvaluationReport:  # fmt: skip
    from anytime.utils.progress import progress_bar

    run_dir, split = run.run_dir, settings.split
    latency_samples, batch_size = settings.latency_samples, settings.batch_size
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
    agreement = None
    if cache_path(run_dir, split).is_file():
        cache = load_cache(run_dir, split, fingerprint=run.fingerprint)
        cached_exit = policy.assign(cache)
        cache = policy.seen_by(cache)
        cached_pred = cache.logits[cached_exit, np.arange(cache.num_samples)].argmax(axis=1)
        agreement = Agreement(float((cached_exit == exit_of).mean()), float((cached_pred == pred).mean()))
    latency = None
    if latency_samples > 0:  # a random sample: an image folder's split is stored class by class
        chosen = data.sample(latency_samples, seed=run.config.seed)
        if splits.info.modality == "text":  # every sentence timed at its own length, unpadded
            timed = make_loader(chosen, splits.info, batch_size=1, train=False, seed=run.config.seed)
            latency = _latency(model, policy, [x.to(run.device) for x, _ in timed], progress)
        else:
            timed = make_loader(chosen, splits.info, batch_size=batch_size, train=False, seed=run.config.seed)
            latency = _latency(model, policy, torch.cat([x for x, _ in timed]).to(run.device), progress)
    return EvaluationReport(
        run=str(run_dir), split=split, policy=policy, samples=int(truth.size), accuracy=float((pred == truth).mean()),
        exit_share=tuple(float(v) for v in np.bincount(exit_of, minlength=run.num_steps) / truth.size),
        mean_flops=float(cost[exit_of].mean()), base_flops=base, form=run.form, machine=describe_machine(),
        device=device_label(run.device), torch_threads=torch.get_num_threads(), git_sha=git_sha(),
        agreement_with_cache=agreement, latency=latency,
    )  # fmt: skip


_LATENCY_CHUNK = 100  # samples timed between two moves of the progress bar
_LATENCY_TURN = 50  # per_sample_latency's turns: each way of answering then runs 50-100 samples in a row


def _latency(model: torch.nn.Module, policy: ExitPolicy, images: torch.Tensor | list[torch.Tensor],
             progress: bool = False) -> LatencyComparison:  # fmt: skip
    from anytime.profile import per_sample_latency
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
    paired = None
    if len(times["backbone"]) >= _LATENCY_TURN:
        paired = paired_ratio(times["backbone"], times["early_exit"], _LATENCY_TURN)
    return LatencyComparison(LatencyFigures.of(times["early_exit"]), LatencyFigures.of(times["backbone"]),
                             turn=_LATENCY_TURN, paired=paired)  # fmt: skip
