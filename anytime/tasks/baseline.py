"""torchensemble's classic ensembles trained on the framework's data (``anytime ensemble-baseline``), written as a
run whose steps are the first k members fused as the method fuses them, so the pipeline and the scheduler take it.

Methods and their fusion (what torchensemble 0.2.0's ``forward`` computes): ``voting``, ``bagging`` and
``snapshot`` average the members' probabilities; ``fusion`` averages their logits; ``gradient-boosting`` sums
their logits times the shrinkage rate. Members are fresh copies of one zoo model, trained on the training split
only (on the CPU unless ``--device cuda``); the test split is only reported.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from anytime.backbones import create_model
from anytime.data import make_loader
from anytime.data.augment import apply_augment, default_augment, normalize
from anytime.data.base import DatasetInfo, Split
from anytime.errors import AnytimeError
from anytime.families import EnsembleModel, FuserBank, MemberInfo
from anytime.precision.model import float_flops
from anytime.train.checkpoint import save_weights
from anytime.train.config import TrainConfig
from anytime.train.evaluation import evaluate_exits
from anytime.train.records import WEIGHTS
from anytime.train.splits import load_splits
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.outputs import RUN, RUN_ENTRIES, check_replaceable, staged_dir
from anytime.utils.timer import monotonic

METHODS: dict[str, str] = {
    "fusion": "FusionClassifier", "voting": "VotingClassifier", "bagging": "BaggingClassifier",
    "gradient-boosting": "GradientBoostingClassifier", "snapshot": "SnapshotEnsembleClassifier",
}  # fmt: skip


def fuser_of(method: str, shrinkage: float) -> tuple[str, float]:
    """The fuser kind and scale that reproduce a method's own fusion (see the module docstring)."""
    if method == "fusion":
        return "logits", 0.0
    if method == "gradient-boosting":
        return "logits", shrinkage
    return "mean", 0.0


class _Member(nn.Module):
    """What torchensemble instantiates per estimator: a fresh zoo model (its own random initialisation)."""

    def __init__(self, model: str, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.net = create_model(model, num_classes=num_classes, in_channels=in_channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _Images(Dataset):
    """A split's uint8 images with their labels; ``classes`` tells torchensemble the label set."""

    def __init__(self, split: Split, info: DatasetInfo) -> None:
        self.split = split
        self.classes = info.classes

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.split.images[i], self.split.labels[i]


class _Collate:
    """Stack a batch, augment it (training: the dataset's default, as the framework's loader) and normalise it."""

    def __init__(self, info: DatasetInfo, train: bool, seed: int) -> None:
        self.info, self.train = info, train
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        images = torch.stack([image for image, _ in items])
        if self.train:
            images = apply_augment(images, default_augment(self.info.hflip), self.generator)
        return normalize(images, self.info.mean, self.info.std), torch.stack([label for _, label in items])


@dataclass(frozen=True)
class BaselineReport:
    """A torchensemble baseline: test accuracy by torchensemble's own ``evaluate``, training and evaluation
    time (s), and every step's (first k members') validation and test accuracy in the framework's run."""

    out: Path
    method: str
    model: str
    estimators: int
    epochs: int
    test_acc: float
    train_time_s: float
    eval_time_s: float
    step_val_acc: tuple[float, ...]
    step_test_acc: tuple[float, ...]


def _ensemble_class(method: str) -> Any:
    if method not in METHODS:
        raise AnytimeError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    import torchensemble

    return getattr(torchensemble, METHODS[method])


def _check_baseline(method: str, config: TrainConfig, estimators: int, shrinkage: float) -> Any:
    """One-line errors for a method or option ``train_baseline`` cannot take; returns the method's torchensemble
    class."""
    cls = _ensemble_class(method)
    if estimators < 2:
        raise AnytimeError(f"an ensemble needs at least 2 estimators (got {estimators})")
    if method == "snapshot" and config.epochs % estimators:
        raise AnytimeError(f"a snapshot ensemble takes one snapshot every epochs/estimators epochs: --epochs "
                           f"{config.epochs} is not a multiple of --estimators {estimators}")  # fmt: skip
    if not 0 < shrinkage <= 1:
        raise AnytimeError(f"--shrinkage must be in (0, 1] (got {shrinkage})")
    return cls


def _make_ensemble(cls: Any, method: str, config: TrainConfig, estimators: int, shrinkage: float, info: DatasetInfo,
                   device: torch.device) -> Any:  # fmt: skip
    """The untrained torchensemble ensemble, with the recipe's optimizer and (but for snapshots) cosine schedule."""
    member = {"model": config.model, "num_classes": info.num_classes, "in_channels": info.in_channels}
    args = {"estimator": _Member, "n_estimators": estimators, "cuda": device.type == "cuda", "estimator_args": member}
    if method in ("voting", "bagging"):
        args["n_jobs"] = 1  # members one after another: parallel workers would fight over the cores
    if method == "gradient-boosting":
        args["shrinkage_rate"] = shrinkage
    ensemble = cls(**args)
    ensemble.set_optimizer("SGD", lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if method != "snapshot":
        ensemble.set_scheduler("CosineAnnealingLR", T_max=config.epochs)
    return ensemble


def _fit_ensemble(ensemble: Any, loader: DataLoader, method: str, config: TrainConfig) -> tuple[dict[str, Any], float]:
    """Train ``ensemble`` quietly; returns the arguments it was fit with and the training time (s)."""
    fit: dict[str, Any] = {"epochs": config.epochs, "save_model": False, "log_interval": 10**9}
    if method == "gradient-boosting":  # its default sums the residual loss over the batch: divergent at usual lrs
        fit["use_reduction_sum"] = False
    start = monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per estimator and epoch; a library is quiet
        ensemble.fit(loader, **fit)
    train_time = monotonic() - start
    if not all(torch.isfinite(p).all() for p in ensemble.parameters()):
        raise AnytimeError(f"the {method} ensemble diverged (its weights hold NaN or infinity) at learning rate "
                           f"{config.lr}; train it again with a lower --lr")  # fmt: skip
    return fit, train_time


def _write_baseline(work: Path, report: BaselineReport, config: TrainConfig, info: DatasetInfo,
                    record: dict[str, Any], model: EnsembleModel, device: torch.device, now: str) -> None:  # fmt: skip
    """Write the baseline run's config, weights and summary into the staged folder ``work``."""
    method, members = report.method, report.estimators
    val_accs, test_accs = report.step_val_acc, report.step_test_acc
    write_json(work / "config.json", {
        "train": config.to_dict(), "dataset": info.to_dict(), "baseline": record, "device": str(device),
        "machine": describe_machine(), "git_sha": git_sha(), "created": now,
    })  # fmt: skip
    save_weights(model, work / WEIGHTS)
    write_json(work / "summary.json", {
        "run_dir": str(report.out), "model": f"{method}({members} x {config.model})", "data": config.data,
        "baseline": record,
        "dataset": {k: info.to_dict().get(k) for k in ("name", "num_classes", "in_channels", "image_size", "source")},
        "final": {"val_acc": val_accs[-1], "test_acc": test_accs[-1]},
        "exits": [{**e.to_dict(), "val_acc": val_accs[e.index], "test_acc": test_accs[e.index]} for e in model.exit_info],
        "backbone_flops": model.backbone_flops, "device": device_label(device), "created": now,
    })  # fmt: skip


def train_baseline(
    method: str, config: TrainConfig, *, estimators: int, out: str | Path, shrinkage: float = 1.0,
    overwrite: bool = False, progress: Callable[[str], None] | None = None,
) -> BaselineReport:  # fmt: skip
    """Train ``estimators`` copies of ``config.model`` with torchensemble's ``method`` for ``config.epochs``
    epochs (SGD with the recipe's learning rate, momentum and weight decay; cosine schedule, except for
    snapshot ensembles, whose cyclic schedule is torchensemble's own) and write the run ``out``."""
    say = progress or (lambda _: None)
    cls = _check_baseline(method, config, estimators, shrinkage)
    target = Path(out)
    check_replaceable(target, RUN, overwrite=overwrite, create_parents=False)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    splits = load_splits(config)
    info = splits.info
    shuffle = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(_Images(splits.train, info), batch_size=config.batch_size, shuffle=True, generator=shuffle,
                        collate_fn=_Collate(info, True, config.seed))  # fmt: skip
    test_loader = DataLoader(_Images(splits.test, info), batch_size=config.eval_batch_size,
                             collate_fn=_Collate(info, False, config.seed))  # fmt: skip
    ensemble = _make_ensemble(cls, method, config, estimators, shrinkage, info, device)
    say(
        f"training {estimators} x {config.model} by torchensemble {METHODS[method]} for {config.epochs} epochs "
        f"on {device}..."
    )
    fit, train_time = _fit_ensemble(ensemble, loader, method, config)
    start = monotonic()
    with torch.no_grad():
        test_acc = float(ensemble.evaluate(test_loader)) / 100
    eval_time = monotonic() - start
    members = [e.net for e in ensemble.estimators_]
    kind, scale = fuser_of(method, shrinkage)
    flops = float_flops(members[0].eval(), (info.in_channels, *info.image_size), 1)[-1]
    params = sum(p.numel() for p in members[0].parameters())
    infos = [MemberInfo(f"{config.model}#{i}", None, flops, params) for i in range(len(members))]
    model = (
        EnsembleModel(members, infos, FuserBank(kind, len(members), info.num_classes, scale=scale)).to(device).eval()
    )
    eval_kw = {"batch_size": config.eval_batch_size, "train": False, "seed": config.seed}
    _, val_accs = evaluate_exits(model, make_loader(splits.val, info, **eval_kw), device)
    _, test_accs = evaluate_exits(model, make_loader(splits.test, info, **eval_kw), device)
    report = BaselineReport(target, method, config.model, len(members), config.epochs, test_acc, train_time, eval_time,
                            tuple(val_accs), tuple(test_accs))  # fmt: skip
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {"method": method, "torchensemble_class": METHODS[method], "estimators": len(members),
              "fuser": kind, "scale": scale, "shrinkage": shrinkage if method == "gradient-boosting" else None,
              "fit": {k: v for k, v in fit.items() if k != "log_interval"},
              "torchensemble": metadata.version("torchensemble"), "test_acc": test_acc, "train_time_s": train_time,
              "eval_time_s": eval_time, "eval_images": len(splits.test), "member_flops": flops,
              "member_params": params}  # fmt: skip
    with staged_dir(target, RUN, overwrite=overwrite, create_parents=False, entries=RUN_ENTRIES) as work:
        _write_baseline(work, report, config, info, record, model, device, now)
    return report
