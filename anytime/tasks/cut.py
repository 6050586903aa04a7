"""Residual cutting on a trained run: the study (``anytime cut RUN``) and the block-drop ladder run
(``anytime cut RUN --ladder --out LADDER_RUN``).

The study cuts every block alone and the cumulative ladder from the top block down, for each kind of cut
(shortcut: the block keeps only its branch; branch: the block keeps only its shortcut), and records the
accuracy, FLOPs and measured batch-1 latency of each configuration; optionally after recomputing the batch-norm
statistics, or after a short fine-tune, of each configuration.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.data import make_loader
from anytime.errors import AnytimeError
from anytime.families import CUT_KINDS, apply_cuts, residual_blocks
from anytime.families.batchnorm import recompute_bn_statistics
from anytime.families.separate import count_flops
from anytime.train.checkpoint import save_weights
from anytime.train.evaluation import evaluate_exits
from anytime.train.folder import RunFolder, open_run, run_path
from anytime.train.multi_exit import build_model
from anytime.train.records import WEIGHTS
from anytime.train.runs import LoadedRun, require_images
from anytime.train.splits import run_splits
from anytime.train.summary import RunSummary
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import describe_machine, device_label, git_sha
from anytime.utils.outputs import RUN, RUN_ENTRIES, check_replaceable, staged_dir
from anytime.utils.progress import progress_bar

CUT_STUDY = "cut study"
CUT_COLUMNS: tuple[str, ...] = (
    "config", "kind", "scope", "blocks", "blocks_cut", "flops", "flops_ratio", "latency_p50_ms", "latency_p90_ms",
    "latency_ratio", "accuracy", "accuracy_recalibrated", "accuracy_finetuned",
)  # fmt: skip


def _plain_run(run_dir: RunFolder | str | Path, device: str) -> LoadedRun:
    run = open_run(run_dir).load(device)
    require_images(run, "anytime cut")
    if run.num_steps != 1:
        raise AnytimeError(f"{run_dir} is an anytime model ({run.num_steps} steps); cut the plain ResNet it came from")
    residual_blocks(run.model)  # a clear error for a model without residual blocks
    return run


def _tensors(loader: Any) -> tuple[Tensor, Tensor]:
    images, labels = [], []
    for x, y in loader:
        images.append(x)
        labels.append(y)
    return torch.cat(images), torch.cat(labels)


@torch.no_grad()
def _accuracy(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 500) -> float:
    model.eval()
    device = next(model.parameters()).device
    hits = 0
    for i in range(0, len(labels), batch_size):
        hits += int((model(images[i : i + batch_size].to(device)).argmax(1).cpu() == labels[i : i + batch_size]).sum())
    return hits / max(len(labels), 1)


def _latency(model: nn.Module, sample: Tensor, repeats: int) -> tuple[float, float]:
    """Batch-1 forward time, p50 and p90 in ms, after a warm-up (the profile's timer)."""
    from anytime.profile import per_sample_latency, quantile_of

    times = 1000 * per_sample_latency({"cut": model}, sample.expand(repeats, *sample.shape[1:]),
                                      warmup=max(3, repeats // 10))["cut"]  # fmt: skip
    return quantile_of(times, 0.5), quantile_of(times, 0.9)


def _finetune(model: nn.Module, loader: Any, epochs: int, lr: float, device: torch.device) -> None:
    """A short fine-tune with the cut in place: SGD with momentum, cosine decay to 0 over the epochs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    total = epochs * len(loader)
    step = 0
    model.train()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * lr * (1 + math.cos(math.pi * step / total))
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    model.eval()


@dataclass(frozen=True)
class CutStudy:
    """The study's table (one row per configuration) and where it was written."""

    rows: list[dict[str, Any]]
    csv: Path
    json: Path
    plots: list[Path]


def cut_configurations(num_blocks: int, kinds: Sequence[str]) -> list[tuple[str, str, dict[int, str]]]:
    """(name, scope, cuts) of the study: the whole network, every block alone and the cumulative ladder from
    the top block down, for each kind."""
    configs: list[tuple[str, str, dict[int, str]]] = [("none", "none", {})]
    for kind in kinds:
        configs += [(f"{kind}:{i}", "single", {i: kind}) for i in range(num_blocks)]
        configs += [(f"{kind}:top{n}", "ladder", {i: kind for i in range(num_blocks - n, num_blocks)})
                    for n in range(1, num_blocks + 1)]  # fmt: skip
    return configs


@dataclass(frozen=True)
class CutSettings:
    """What a cut study (:func:`cut_study`) cuts, where it scores each configuration and how.

    ``kinds`` are the cuts studied (``shortcut``, ``branch``). Each configuration is scored on ``split`` (``val``
    or ``test``), or on ``images`` of it drawn at random (seeded; None: all of it). ``recalibrate_bn`` adds the
    accuracy after recomputing every batch-norm statistic on ``recalibration_batches`` training batches (no
    augmentation); ``finetune_epochs`` adds the accuracy after that many epochs of fine-tuning (learning rate
    ``finetune_lr``; 0: none). ``latency_repeats`` batch-1 forwards are timed per configuration."""

    kinds: tuple[str, ...] = CUT_KINDS
    recalibrate_bn: bool = False
    finetune_epochs: int = 0
    finetune_lr: float = 0.01
    split: str = "test"
    images: int | None = None
    recalibration_batches: int = 20
    latency_repeats: int = 30

    def __post_init__(self) -> None:
        for kind in self.kinds:
            if kind not in CUT_KINDS:
                raise AnytimeError(f"unknown cut '{kind}'; choose one of {', '.join(CUT_KINDS)}")
        if self.finetune_epochs < 0 or self.recalibration_batches < 1 or self.latency_repeats < 1:
            raise AnytimeError("fine-tune epochs must be >= 0, recalibration batches and latency repeats >= 1")
        if self.split not in ("val", "test"):
            raise AnytimeError(f"unknown split '{self.split}'; choose val or test")


@dataclass(frozen=True)
class _Setup:
    """What the study measures each configuration on and how: the scored images and labels, the training loaders
    for recomputing batch norm (plain) and fine-tuning (augmented), and the study's settings."""

    x_eval: Tensor
    y_eval: Tensor
    plain_train: Any
    augmented: Any
    settings: CutSettings


def _study_data(run: LoadedRun, settings: CutSettings) -> _Setup:
    """The scored images and labels of the settings' split and the plain and augmented training loaders."""
    splits = run_splits(run)
    info = splits.info
    seed = run.config.seed
    scored = getattr(splits, settings.split).sample(settings.images, seed)
    x_eval, y_eval = _tensors(make_loader(scored, info, batch_size=500, train=False, seed=seed))
    # A random sample: the training split is stored class by class, and statistics of one class are wrong.
    plain_train = make_loader(splits.train.sample(128 * settings.recalibration_batches, seed), info, batch_size=128,
                              train=False, seed=seed)  # fmt: skip
    augmented = make_loader(splits.train, info, batch_size=128, train=True, seed=seed)
    return _Setup(x_eval, y_eval, plain_train, augmented, settings)


def _measure_configs(model: nn.Module, setup: _Setup, device: torch.device, *,
                     progress: Callable[[str], None] | None, bar: bool) -> list[dict[str, Any]]:  # fmt: skip
    """The study's rows: every configuration's accuracy (and after recomputing batch norm or fine-tuning, when
    asked), FLOPs and batch-1 latency. Leaves the last configuration's cuts in ``model``."""
    x_eval, y_eval, settings = setup.x_eval, setup.y_eval, setup.settings
    sample = x_eval[:1].to(device)
    num_blocks = len(residual_blocks(model))
    shape = tuple(sample.shape[1:])
    base_flops = count_flops(model, model, shape)
    rows: list[dict[str, Any]] = []
    configs = cut_configurations(num_blocks, settings.kinds)
    base_latency = None
    shown = progress_bar(len(configs), "cut", enabled=bar, unit="config")
    try:
        for index, (name, scope, cuts) in enumerate(configs):
            apply_cuts(model, cuts)
            flops = count_flops(model, model, shape)  # first: a configuration that does not run fails here, clearly
            p50, p90 = _latency(model, sample, settings.latency_repeats)
            base_latency = base_latency or p50
            row: dict[str, Any] = {
                "config": name, "kind": next(iter(cuts.values()), "none"), "scope": scope,
                "blocks": " ".join(str(i) for i in sorted(cuts)), "blocks_cut": len(cuts),
                "flops": flops, "latency_p50_ms": p50, "latency_p90_ms": p90,
                "accuracy": _accuracy(model, x_eval, y_eval), "accuracy_recalibrated": None, "accuracy_finetuned": None,
            }  # fmt: skip
            row["flops_ratio"] = row["flops"] / base_flops
            row["latency_ratio"] = p50 / base_latency
            if settings.recalibrate_bn and cuts:
                tuned = copy.deepcopy(model)
                recompute_bn_statistics(tuned, setup.plain_train, max_batches=settings.recalibration_batches)
                row["accuracy_recalibrated"] = _accuracy(tuned, x_eval, y_eval)
            if settings.finetune_epochs and cuts:
                tuned = copy.deepcopy(model)
                _finetune(tuned, setup.augmented, settings.finetune_epochs, settings.finetune_lr, device)
                row["accuracy_finetuned"] = _accuracy(tuned, x_eval, y_eval)
            rows.append(row)
            if progress is not None:
                progress(f"[{index + 1}/{len(configs)}] {name:<16} acc {100 * row['accuracy']:5.1f}%  "
                         f"latency {p50:.2f} ms  FLOPs {100 * row['flops_ratio']:.0f}%")  # fmt: skip
            shown.update()
    finally:
        shown.close()
    return rows


def cut_study(
    run_dir: RunFolder | str | Path, settings: CutSettings | None = None, *, device: str = "cpu",
    out: str | Path | None = None, overwrite: bool = False, progress: Callable[[str], None] | None = None,
    bar: bool = False,
) -> CutStudy:  # fmt: skip
    """Cut a trained ResNet's blocks one by one and cumulatively from the top, for each kind of ``settings``
    (default :class:`CutSettings`); measure each configuration's accuracy on the settings' split (or on ``images``
    of it drawn at random, seeded), FLOPs and batch-1 latency.

    ``recalibrate_bn`` adds the accuracy after recomputing every batch-norm statistic on
    ``recalibration_batches`` training batches (no augmentation) with the cut in place; ``finetune_epochs``
    adds the accuracy after that many epochs of fine-tuning each configuration (lr ``finetune_lr``).
    Written to ``OUT/cut.csv``, ``OUT/cut.json`` and plots in ``OUT`` (default ``RUN/cut``), all at once; an
    earlier study there is replaced only with ``overwrite``. ``progress`` gets a line per configuration; ``bar``
    shows a bar of the configurations on stderr.
    """
    settings = settings or CutSettings()
    split = settings.split
    folder = Path(out) if out is not None else run_path(run_dir) / "cut"
    run = _plain_run(run_dir, device)
    run_dir = run.run_dir
    check_replaceable(folder, CUT_STUDY, overwrite=overwrite, create_parents=out is None)
    setup = _study_data(run, settings)
    model = run.model
    rows = _measure_configs(model, setup, run.device, progress=progress, bar=bar)
    apply_cuts(model, {})
    recalibrate_bn, finetune_epochs = settings.recalibrate_bn, settings.finetune_epochs
    report = {
        "run": str(run_dir), "model": run.config.model, "split": split, "images": len(setup.y_eval),
        "blocks": [name for name, _ in residual_blocks(model)], "kinds": list(settings.kinds),
        "stochastic_depth": run.config.stochastic_depth, "recalibrate_bn": recalibrate_bn,
        "recalibration_batches": settings.recalibration_batches if recalibrate_bn else None,
        "finetune_epochs": finetune_epochs, "finetune_lr": settings.finetune_lr if finetune_epochs else None,
        "latency_repeats": settings.latency_repeats, "device": device_label(run.device),
        "torch_threads": torch.get_num_threads(),
        "machine": describe_machine(), "git_sha": git_sha(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows,
    }  # fmt: skip
    from anytime.plotting.cut import plot_cut_study

    with staged_dir(folder, CUT_STUDY, overwrite=overwrite, create_parents=out is None) as work:
        write_csv(work / "cut.csv", rows, CUT_COLUMNS)
        write_json(work / "cut.json", report)
        plots = plot_cut_study({run.config.model: rows}, work / "cut", title=f"{run.config.model}: {split} accuracy")
    return CutStudy(rows, folder / "cut.csv", folder / "cut.json", [folder / p.name for p in plots])


def make_ladder_run(
    run_dir: str | Path, out: str | Path, *, device: str = "cpu", overwrite: bool = False
) -> RunSummary:
    """Write ``out``, a run whose model is the cumulative block-drop ladder of the plain ResNet in ``run_dir``
    (step k keeps the first k blocks whole; the same weights), with every step's validation and test
    accuracy in its summary, so that collect, sweep, profile and schedule take it like a trained run."""
    target = Path(out)
    if target.exists() and target.resolve() == Path(run_dir).resolve():
        raise AnytimeError(f"--out {target} is the run being cut; give the ladder run a folder of its own")
    check_replaceable(target, RUN, overwrite=overwrite, create_parents=False)
    run = _plain_run(run_dir, device)
    config = run.config.replace(ladder="top-down")
    size = run.dataset.get("image_size") or [32, 32]
    ladder = build_model(config, num_classes=int(run.dataset["num_classes"]), in_channels=int(run.dataset["in_channels"]),
                         image_size=(int(size[0]), int(size[1])), load_init=False)  # fmt: skip
    ladder.backbone.load_state_dict(run.model.state_dict())  # type: ignore[union-attr]
    ladder = ladder.to(run.device).eval()
    splits = run_splits(run)
    loader_kw = {"batch_size": 500, "train": False, "seed": run.config.seed}
    _, val_accs = evaluate_exits(ladder, make_loader(splits.val, splits.info, **loader_kw), run.device)
    _, test_accs = evaluate_exits(ladder, make_loader(splits.test, splits.info, **loader_kw), run.device)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with staged_dir(target, RUN, overwrite=overwrite, create_parents=False, entries=RUN_ENTRIES) as staged:
        summary = _write_ladder(staged, target, run, config, ladder, val_accs, test_accs, now)
    return RunSummary.from_dict(summary)


def _write_ladder(folder: Path, target: Path, run: LoadedRun, config: Any, ladder: nn.Module, val_accs: list[float],
                  test_accs: list[float], now: str) -> dict[str, Any]:  # fmt: skip
    write_json(folder / "config.json", {
        "train": config.to_dict(), "dataset": run.dataset, "device": str(run.device), "machine": describe_machine(),
        "git_sha": git_sha(), "created": now, "source_run": str(run.run_dir), "source_fingerprint": run.fingerprint,
    })  # fmt: skip
    save_weights(ladder, folder / WEIGHTS)
    info = ladder.exit_info  # type: ignore[union-attr]
    summary = {
        "run_dir": str(target), "model": config.model, "data": config.data, "ladder": "top-down",
        "source_run": str(run.run_dir), "dataset": {k: run.dataset.get(k) for k in ("name", "num_classes", "in_channels", "image_size", "source")},
        "parameters": sum(p.numel() for p in ladder.parameters()),
        "final": {"val_acc": val_accs[-1], "test_acc": test_accs[-1]},
        "exits": [{**e.to_dict(), "val_acc": val_accs[e.index], "test_acc": test_accs[e.index]} for e in info],
        "backbone_flops": ladder.backbone_flops,  # type: ignore[union-attr]
        "device": device_label(run.device), "created": now,
    }  # fmt: skip
    write_json(folder / "summary.json", summary)
    return summary
