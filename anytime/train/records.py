"""What a run folder records about itself (``config.json``'s entries, the fingerprint of its weights), read
with the standard library alone: the scheduler's query path needs these and not torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError

WEIGHTS = "model.safetensors"
CHECKPOINT = "checkpoint.pt"  # the latest epoch's state, written by the trainer after every epoch
QUANT_STATE = "quant.safetensors"  # a quantized run's int8 calibration statistics


def read_record(run_dir: str | Path) -> dict[str, Any]:
    """A run's ``config.json`` (with its ``train`` and ``dataset`` tables), refused in one line when there is no
    folder, no record, or a malformed one."""
    run = Path(run_dir)
    path = run / "config.json"
    if not run.is_dir():
        raise AnytimeError(f"no run directory at {run_dir}; train one with `anytime train --out {run_dir}`")
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise AnytimeError(
            f"{run_dir} is not a run (no config.json); point at a folder `anytime train` wrote"
        ) from None
    except (OSError, ValueError):
        raise AnytimeError(f"{path} is not a valid run record; was it edited or truncated?") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("train"), dict)
        or not isinstance(record.get("dataset"), dict)
    ):
        raise AnytimeError(f"{path} is not a valid run record; was it edited or truncated?")
    return record


def require_run(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's record (:func:`read_record`), refused as well when its final weights are not there yet."""
    record = read_record(run_dir)
    if not (Path(run_dir) / WEIGHTS).is_file():
        raise AnytimeError(unfinished(run_dir))
    return record


def unfinished(run_dir: str | Path) -> str:
    """What to say of a run without its final weights: resume it where a checkpoint was kept, else train it again
    (training stopped before its first epoch ended, which leaves no checkpoint)."""
    if (Path(run_dir) / CHECKPOINT).is_file():
        return f"{run_dir} has no {WEIGHTS}: its training has not finished; continue it with `anytime train --out {run_dir} --resume`"
    return (f"{run_dir} has no {WEIGHTS}: its training has not finished and left no checkpoint (it stopped before "
            f"its first epoch ended); train it again with `anytime train --out {run_dir}` and the options it was "
            "started with")  # fmt: skip


def weights_fingerprint(path: str | Path) -> str:
    """A short SHA-256 of a weights file: two runs share it only if their weights are byte-identical."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _table(run_dir: str | Path, key: str) -> dict[str, Any] | None:
    """One table of the run's record, or None where there is no readable record or no such table (for labels and
    kinds, where a missing record is not an error)."""
    try:
        found = read_record(run_dir).get(key)
    except AnytimeError:
        return None
    return found if isinstance(found, dict) else None


def precision_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A converted run's precision record (``config.json``'s ``precision``), or None for a float run."""
    return _table(run_dir, "precision")


def baseline_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A torchensemble baseline run's record (``config.json``'s ``baseline``: method, estimators), or None."""
    return _table(run_dir, "baseline")


def ensemble_record(run_dir: str | Path) -> dict[str, Any] | None:
    """An ensemble run's record (``config.json``'s ``ensemble``: members, order, fuser), or None."""
    return _table(run_dir, "ensemble")


def run_weights_fingerprint(run_dir: str | Path) -> str:
    """The fingerprint of what a run computes with: its weights and, for a converted run, its precision and
    calibration statistics too (so a profile or calibration of the float run is refused for it)."""
    run = Path(run_dir)
    plain = weights_fingerprint(run / WEIGHTS)
    members = ensemble_record(run)
    if members is not None:  # an ensemble computes with its fusers and with its members' weights
        digest = hashlib.sha256(plain.encode())
        digest.update(json.dumps([m.get("fingerprint") for m in members.get("members", [])]).encode())
        return digest.hexdigest()[:16]
    record = precision_record(run)
    if record is None:
        return plain
    digest = hashlib.sha256(plain.encode())
    digest.update(json.dumps({k: record.get(k) for k in ("precision", "backend", "compile")}, sort_keys=True).encode())
    if (run / QUANT_STATE).is_file():
        digest.update(weights_fingerprint(run / QUANT_STATE).encode())
    return digest.hexdigest()[:16]


def run_title(run_dir: str | Path) -> str:
    """What a run is, for figure titles and pages: ``resnet32 on cifar10`` (the folder's name if unreadable)."""
    train, dataset = _table(run_dir, "train"), _table(run_dir, "dataset")
    if train is None or dataset is None or "model" not in train or "name" not in dataset:
        return Path(run_dir).name
    model, data = train["model"], dataset["name"]
    converted = precision_record(run_dir)
    return f"{model}{' ' + converted['precision'] if converted else ''} on {data}"


def step_labels(run_dir: str | Path, names: Sequence[str]) -> tuple[str, ...]:
    """The names figures and tables give a run's steps, the ones its profile uses: ``exit0``, ``exit1``... for early
    exits (whose own names are points in the backbone, ``stages.0.1``), the family's names otherwise."""
    exits = bool((_table(run_dir, "train") or {}).get("exits"))
    return tuple(f"exit{k}" for k in range(len(names))) if exits else tuple(names)


def class_names(run_dir: str | Path) -> list[str] | None:
    """The class names a run's dataset recorded, or None."""
    classes = (_table(run_dir, "dataset") or {}).get("classes")
    return [str(c) for c in classes] if isinstance(classes, list) else None
