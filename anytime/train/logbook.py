"""What a training run writes beside its weights: ``config.json`` (the recipe, the data, the machine),
``metrics.csv`` (one row per epoch), ``iterations.csv`` (the phases of every iteration) and the summary."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytime.data import Augment, DatasetSplits
from anytime.train.config import TrainConfig
from anytime.train.timing import PHASES, PhaseLog
from anytime.utils.io import read_csv, write_csv, write_json
from anytime.utils.machine import describe_machine, device_label, git_sha

METRICS_COLUMNS: tuple[str, ...] = (
    "epoch", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_s", "train_s", "eval_s", "elapsed_s",
    "data_s", "forward_s", "backward_s", "step_s", "images_per_s", "peak_rss_mb", "cuda_peak_mb",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunSetting:
    """Where and how a run trains, as its ``config.json`` records it beside the recipe."""

    dataset: dict[str, Any]
    device: torch.device
    processes: int = 1
    sync_bn: bool | None = None  # None: not a data-parallel run
    augment: Augment | None = None
    hf_config: dict[str, Any] | None = None  # a Hugging Face model's architecture: the run rebuilds from it
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def write_run_config(
    run_dir: Path, config: TrainConfig, setting: RunSetting, *, resumed_from: int | None,
    extensions: list[dict[str, Any]] | None = None,
) -> None:  # fmt: skip
    """Write the run's ``config.json``; a resumed run keeps its creation time and adds the epoch it resumed at."""
    path = run_dir / "config.json"
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload: dict[str, Any] = {
        "train": config.to_dict(),
        "dataset": setting.dataset,
        "device": str(setting.device),
        "machine": describe_machine(config.data_root),
        "git_sha": git_sha(),
        "processes": setting.processes,
        **({"sync_bn": setting.sync_bn} if setting.sync_bn is not None else {}),
        "created": now,
        **({"augment": dataclasses.asdict(setting.augment)} if setting.augment is not None else {}),
        **({"hf_config": setting.hf_config} if setting.hf_config is not None else {}),  # the run rebuilds from it
        **setting.extra,
    }
    if resumed_from is not None and path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}  # the checkpoint, not this record, is what the run resumes from
        payload["created"] = old.get("created", now)
        payload["resumed"] = [*old.get("resumed", []),
                              {"at_epoch": resumed_from, "time": now, "processes": payload["processes"]}]  # fmt: skip
    if extensions:
        payload["extended"] = extensions
    write_json(path, payload)


def write_tables(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Write ``metrics.csv`` and ``iterations.csv`` from the epochs trained so far."""
    rows = [entry["metrics"] for entry in history]
    exit_columns = [key for key in rows[-1] if key.startswith("val_acc_exit") or key == "train_objective"]
    write_csv(run_dir / "metrics.csv", rows, [*METRICS_COLUMNS, *exit_columns])
    iterations = [
        {"epoch": entry["metrics"]["epoch"], "iteration": i, "batch": int(batch),
         **{f"{p}_s": entry["phases"][p][i] for p in PHASES}}
        for entry in history
        for i, batch in enumerate(entry["phases"]["batch"])
    ]  # fmt: skip
    write_csv(run_dir / "iterations.csv", iterations, ["epoch", "iteration", "batch",
                                                       *(f"{p}_s" for p in PHASES)])  # fmt: skip


def _phase_summary(entries: list[dict[str, Any]]) -> dict[str, float] | None:
    if not entries:
        return None
    log = PhaseLog()
    for entry in entries:
        p = entry["phases"]
        for values in zip(p["data"], p["forward"], p["backward"], p["step"], p["batch"]):
            log.add(*values[:4], int(values[4]))
    return log.summary()


def train_summary(
    run_dir: Path, config: TrainConfig, history: list[dict[str, Any]], model: nn.Module, device: torch.device,
    test: tuple[float, list[float]], dataset: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The run's summary from its history and the final model's ``test`` loss and accuracy of every exit."""
    last = history[-1]["metrics"]
    test_loss, test_accs = test
    return {
        "run_dir": str(run_dir),
        "model": config.model,
        "data": config.data,
        "dataset": {k: dataset[k] for k in ("name", "num_classes", "in_channels", "image_size", "source")},
        "epochs": len(history),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final": {
            "train_acc": last["train_acc"],
            "val_acc": last["val_acc"],
            "val_loss": last["val_loss"],
            "test_acc": test_accs[-1],
            "test_loss": test_loss,
        },  # fmt: skip
        "best_val_acc": max(h["metrics"]["val_acc"] for h in history),
        "train_time_s": sum(h["metrics"]["train_s"] for h in history),
        "wall_time_s": last["elapsed_s"],
        "timing": {"epoch0": _phase_summary(history[:1]), "steady": _phase_summary(history[1:])},
        "peak_rss_mb": max(h["metrics"]["peak_rss_mb"] for h in history),
        "cuda_peak_mb": None if last["cuda_peak_mb"] is None else max(h["metrics"]["cuda_peak_mb"] for h in history),
        "device": device_label(device),
        "torch_threads": torch.get_num_threads(),
        **_exit_summary(model, last, test_accs),
    }


def _exit_summary(model: nn.Module, last: dict[str, Any], test_accs: list[float]) -> dict[str, Any]:
    info = getattr(model, "exit_info", None)
    if info is None:
        return {}
    return {
        "exits": [
            {**e.to_dict(), "val_acc": last[f"val_acc_exit{e.index}"], "test_acc": test_accs[e.index]} for e in info
        ],
        "backbone_flops": model.backbone_flops,  # type: ignore[union-attr]
    }


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """The rows of a run's ``metrics.csv`` (one per epoch), as strings."""
    return read_csv(Path(run_dir) / "metrics.csv")


def data_note(cfg: TrainConfig, splits: DatasetSplits, augment: Augment) -> str:
    """How the data is used, said when training starts: a text run's validation split (what its accuracies and
    promises are measured on); an image run's augmentation, and why it has no mirror flips when that is the
    dataset's default."""
    if splits.info.modality == "text":
        if splits.dev is not None:
            return "; validation: the dev file (held out, drawn like the test), the whole train file trained on"
        return "; validation: carved from the train file"
    if cfg.augment is not None or splits.info.hflip:
        return f"; augmentation {augment.describe()}"
    mirror = " (no mirror flips: a mirrored image may be another class here; --augment crop+flip adds them)"
    return f"; augmentation {augment.describe()}{mirror}"
