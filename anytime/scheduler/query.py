"""The scheduler's query path for a run folder: its profile, its options (steps and calibrated policies) and a
deadline scheduler over them, read with numpy and the standard library alone (no torch), so that a board or a
service asks "what fits D ms?" without loading a network."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from anytime.calibrate.policy import ExitPolicy
from anytime.errors import AnytimeError
from anytime.profile.store import DeviceProfile
from anytime.scheduler.deadline import DeadlineScheduler, Option, PrecisionScheduler
from anytime.train.records import precision_record, read_record, require_run, run_weights_fingerprint
from anytime.utils.io import read_json

CALIBRATION = "calibration.json"
CALIBRATION_FORMAT = "anytime-calibration-v1"


def run_fingerprint(run_dir: str | Path) -> str:
    """The fingerprint of a finished run's weights (what its caches and calibrations must name)."""
    require_run(run_dir)
    return run_weights_fingerprint(run_dir)


def load_calibration(
    path: str | Path, *, fingerprint: str | None = None, num_steps: int | None = None
) -> tuple[ExitPolicy, dict[str, Any]]:
    """The policy saved by :func:`calibrate_run`, refused if it was fit on another model (or, given
    ``num_steps``, on a model with another number of exits) or if its figures are malformed."""
    target = Path(path)
    report = read_json(target, what="calibration", make="run `anytime calibrate RUN --max-drop 1` first",
                       redo="calibrate again")  # fmt: skip
    if not isinstance(report, dict) or report.get("format") != CALIBRATION_FORMAT:
        raise AnytimeError(f"{target} is not an anytime calibration (no '{CALIBRATION_FORMAT}' tag)")
    if fingerprint is not None and report.get("model_fingerprint") != fingerprint:
        raise AnytimeError(
            f"{target} was fit on another model (weights {report.get('model_fingerprint')}, this run's are "
            f"{fingerprint}); calibrate this run instead"
        )
    policy = ExitPolicy.from_dict(report.get("policy", {}), where=str(target))
    if num_steps is not None and policy.num_steps != num_steps:
        raise AnytimeError(
            f"{target} has thresholds for {policy.num_steps} exits but the model has {num_steps}; calibrate again"
        )
    for split in ("validation", "test"):
        figures = report.get(split)
        if split == "test" and figures is None:
            continue
        try:
            shares = [float(s) for s in figures["exit_share"]]
            ok = len(shares) == policy.num_steps and all(
                math.isfinite(float(figures[key])) for key in ("accuracy", "flops_ratio", "last_exit_accuracy")
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise AnytimeError(f"{target}: its {split} figures are malformed; calibrate again")
    return policy, report


def find_profile(run_dir: str | Path, profile: str | Path | None = None, *, length: int | None = None) -> Path:
    """The profile to schedule with: the one given, or the run's only ``profile-*.json``; for a text run and a
    request of ``length`` tokens, the run's profile of the shortest profiled length that holds it (its bucket)."""
    if profile is not None:
        return Path(profile)
    found = sorted(Path(run_dir).glob("profile-*.json"))
    if not found:
        raise AnytimeError(f"{run_dir} has no device profile; measure one with `anytime profile {run_dir}`")
    if length is not None:
        return _length_bucket(run_dir, found, length)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise AnytimeError(f"{run_dir} has several profiles ({names}); choose one with --profile FILE"
                           + (" or, for a text run, give the request's --length" if "-T" in names else ""))  # fmt: skip
    return found[0]


def profiled_lengths(paths: Sequence[Path]) -> dict[int, list[Path]]:
    """The profiles among ``paths`` that time sentences, by their length in tokens."""
    import json

    lengths: dict[int, list[Path]] = {}
    for path in paths:
        try:
            shape = json.loads(path.read_text())["input_shape"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a readable profile: loading it names the fault if it is chosen
        if isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int):
            lengths.setdefault(shape[0], []).append(path)
    return lengths


def _length_bucket(run_dir: str | Path, found: list[Path], length: int) -> Path:
    if not isinstance(length, int) or length < 1:
        raise AnytimeError(f"--length is a request's number of tokens, at least 1 (got {length})")
    lengths = profiled_lengths(found)
    try:  # the model reads at most its maximum length: a longer request is cut to it
        length = min(length, int(read_record(run_dir)["dataset"]["max_length"]))
    except (AnytimeError, KeyError, TypeError, ValueError):
        pass
    if not lengths:
        raise AnytimeError(f"{run_dir} has no profile of sentence lengths; --length is for text runs, profiled with "
                           f"`anytime profile {run_dir} --length T`")  # fmt: skip
    holding = [t for t in lengths if t >= length]
    if not holding:
        longest = max(lengths)
        raise AnytimeError(f"a request of {length} tokens is longer than every profiled length (at most {longest}); "
                           f"profile `anytime profile {run_dir} --length {length}`, or cut requests to {longest}")  # fmt: skip
    bucket = lengths[min(holding)]
    if len(bucket) > 1:
        names = ", ".join(p.name for p in bucket)
        raise AnytimeError(
            f"{run_dir} has several profiles of {min(holding)} tokens ({names}); choose one with --profile"
        )
    return bucket[0]


def run_options(run_dir: str | Path, step_names: Sequence[str]) -> list[Option]:
    """The scheduler's options for a run: every step (named as its profile names them) with its validation
    accuracy from the run's summary, and every early-exit policy calibrated in the run (``calibration*.json``)
    with its validation accuracy and exit shares."""
    num_steps = len(step_names)
    summary_path = Path(run_dir) / "summary.json"
    summary = read_json(summary_path, what="training summary", make="its training has not finished",
                        redo="train the run again")  # fmt: skip
    try:
        if num_steps > 1:
            accuracy = [float(e["val_acc"]) for e in summary["exits"]]
        else:
            accuracy = [float(summary["final"]["val_acc"])]
    except (KeyError, TypeError, ValueError):
        raise AnytimeError(f"{summary_path} does not hold every step's validation accuracy; was it edited?") from None
    if len(accuracy) != num_steps or not all(0 <= a <= 1 for a in accuracy):
        raise AnytimeError(f"{summary_path} has {len(accuracy)} valid step accuracies for {num_steps} steps")
    options = [Option(name, a, step=k) for k, (name, a) in enumerate(zip(step_names, accuracy))]
    if num_steps > 1:
        fingerprint = run_fingerprint(run_dir)
        for path in sorted(Path(run_dir).glob("calibration*.json")):
            policy, report = load_calibration(path, fingerprint=fingerprint, num_steps=num_steps)
            figures = report["validation"]
            options.append(Option(f"{path.stem} ({policy.criterion})", float(figures["accuracy"]), policy=policy,
                                  exit_share=tuple(float(v) for v in figures["exit_share"])))  # fmt: skip
    return options


def scheduler_for_run(
    run_dir: str | Path, profile: str | Path | None = None, *, adapt: bool = True, length: int | None = None
) -> tuple[DeadlineScheduler, Path]:
    """A deadline scheduler for a run on a profiled device; the profile must name this run's weights. ``length``
    (a text request's tokens) picks the profile of its length bucket."""
    fingerprint = run_fingerprint(run_dir)
    path = find_profile(run_dir, profile, length=length)
    loaded = DeviceProfile.load(path, fingerprint=fingerprint)
    return DeadlineScheduler(loaded, run_options(run_dir, loaded.step_names), adapt=adapt), path


def _structured_ticket_of(run: Path, base: Path) -> str | None:
    """``channels-S`` when ``run`` is a structured ticket (``anytime ticket --unit channels``) whose chain of
    ``prune_from`` leads back to ``base``, else None (read from the runs' config.json alone)."""

    def recipe(folder: Path) -> dict[str, Any]:
        try:
            return dict(
                read_json(folder / "config.json", what="run record", make="train it", redo="train it again")["train"]
            )
        except (AnytimeError, KeyError, TypeError, ValueError):
            return {}

    own = recipe(run)
    if own.get("prune_unit") != "channels":
        return None
    current, seen = own, {run.resolve()}
    while current.get("prune_from") is not None:
        parent = Path(current["prune_from"])
        if parent.resolve() == base.resolve():
            return f"channels-{float(own.get('sparsity', 0)):g}"
        if parent.resolve() in seen:
            return None
        seen.add(parent.resolve())
        current = recipe(parent)
    return None


def precision_scheduler(
    runs: Sequence[str | Path], profile: str | Path | None = None
) -> tuple[PrecisionScheduler, dict[str, Path]]:
    """One frontier over the steps of a run and of its converted forms (``anytime quantize``) or structured
    tickets (``anytime ticket --unit channels``: smaller networks), each scheduled with its own profile
    (``profile`` names the first run's; the others use their only one). Returns the scheduler and the run of each
    variant (named by its precision, ``fp32`` for a float run, or ``channels-S`` for a ticket of channel sparsity S)."""
    schedulers: dict[str, DeadlineScheduler] = {}
    runs_of: dict[str, Path] = {}
    base = Path(runs[0])
    base_fingerprint = run_fingerprint(base)
    for i, run in enumerate(runs):
        record = precision_record(run)
        ticket = _structured_ticket_of(Path(run), base) if i > 0 and record is None else None
        name = ticket or (record["precision"] if record is not None else "fp32")
        again = name in runs_of and runs_of[name].resolve() == Path(run).resolve()
        if (
            not again
            and i > 0
            and ticket is None
            and (record is None or record.get("parent_fingerprint") != base_fingerprint)
        ):
            raise AnytimeError(f"{run} is neither a converted form of {base} (anytime quantize {base} --precision P) "
                               f"nor a structured ticket of it (anytime ticket {base} --unit channels); only one "
                               "model's variants share a frontier")  # fmt: skip
        if name in runs_of:
            raise AnytimeError(f"{runs_of[name]} and {run} are both {name}; give each variant once")
        schedulers[name], _ = scheduler_for_run(run, profile if i == 0 else None)
        runs_of[name] = Path(run)
    return PrecisionScheduler(schedulers), runs_of


def schedule_answer(
    scheduler: DeadlineScheduler, profile: Path, deadline_ms: float, quantile: float = 0.99, batch_size: int = 1, *,
    energy_mj: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What ``anytime schedule`` and ``GET /schedule`` answer: the choice, the profile and the whole frontier (with an
    energy budget, the two-dimensional frontier, each point with its mean millijoules per inference)."""
    choice = scheduler.select(deadline_ms, quantile, batch_size, energy_mj=energy_mj)
    frontier = [{"option": o.name, "kind": o.kind, "accuracy": o.accuracy, "latency_ms": latency,
                 **({} if energy is None else {"energy_mj": energy})}
                for o, latency, energy in scheduler.frontier_points(quantile, batch_size, energy=energy_mj is not None)]  # fmt: skip
    return {**choice.to_dict(), "profile": str(profile), "frontier": frontier}
