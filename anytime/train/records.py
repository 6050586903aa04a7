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
QUANT_STATE = "quant.safetensors"  # a quantized run's int8 calibration statistics


def require_run(run_dir: str | Path) -> None:
    """Refuse, in one line, a folder that is not a finished run: no folder, no ``config.json``, a malformed one,
    or no final weights yet."""
    run = Path(run_dir)
    path = run / "config.json"
    if not run.is_dir():
        raise AnytimeError(f"no run directory at {run_dir}; train one with `anytime train --out {run_dir}`")
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise AnytimeError(f"{run_dir} is not a run (no config.json); point at a folder `anytime train` wrote") from None
    except (OSError, ValueError):
        raise AnytimeError(f"{path} is not a valid run record; was it edited or truncated?") from None
    if not isinstance(record, dict) or not isinstance(record.get("train"), dict):
        raise AnytimeError(f"{path} is not a valid run record; was it edited or truncated?")
    if not (run / WEIGHTS).is_file():
        raise AnytimeError(f"{run_dir} has no {WEIGHTS}: its training has not finished")


def weights_fingerprint(path: str | Path) -> str:
    """A short SHA-256 of a weights file: two runs share it only if their weights are byte-identical."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _record_entry(run_dir: str | Path, key: str) -> dict[str, Any] | None:
    try:
        record = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = record.get(key) if isinstance(record, dict) else None
    return found if isinstance(found, dict) else None


def precision_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A converted run's precision record (``config.json``'s ``precision``), or None for a float run."""
    return _record_entry(run_dir, "precision")


def baseline_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A torchensemble baseline run's record (``config.json``'s ``baseline``: method, estimators), or None."""
    return _record_entry(run_dir, "baseline")


def ensemble_record(run_dir: str | Path) -> dict[str, Any] | None:
    """An ensemble run's record (``config.json``'s ``ensemble``: members, order, fuser), or None."""
    return _record_entry(run_dir, "ensemble")


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
    try:
        record = json.loads((Path(run_dir) / "config.json").read_text())
        model, data = record["train"]["model"], record["dataset"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return Path(run_dir).name
    converted = precision_record(run_dir)
    return f"{model}{' ' + converted['precision'] if converted else ''} on {data}"


def step_labels(run_dir: str | Path, names: Sequence[str]) -> tuple[str, ...]:
    """The names figures and tables give a run's steps, the ones its profile uses: ``exit0``, ``exit1``... for early
    exits (whose own names are points in the backbone, ``stages.0.1``), the family's names otherwise."""
    try:
        exits = bool(json.loads((Path(run_dir) / "config.json").read_text())["train"].get("exits"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        exits = False
    return tuple(f"exit{k}" for k in range(len(names))) if exits else tuple(names)


def class_names(run_dir: str | Path) -> list[str] | None:
    """The class names a run's dataset recorded, or None."""
    try:
        classes = json.loads((Path(run_dir) / "config.json").read_text())["dataset"].get("classes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return [str(c) for c in classes] if isinstance(classes, list) else None
