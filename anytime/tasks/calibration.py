"""Calibrate a run: thresholds fit on its validation cache, reported on validation and test (``RUN/calibration.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from anytime.calibrate import (
    Calibration,
    ExitPolicy,
    PolicyResult,
    SubsetChoice,
    calibrate_budget,
    calibrate_max_drop,
    select_exits,
)
from anytime.errors import AnytimeError
from anytime.outputs import cache_path, load_cache
from anytime.profile.store import DeviceProfile
from anytime.scheduler.query import (
    CALIBRATION,
    CALIBRATION_FORMAT,
    find_profile,
)  # fmt: skip
from anytime.tasks.sweep import oracle_dict, steps_table
from anytime.train.folder import RunFolder, open_run
from anytime.utils.io import write_json
from anytime.utils.outputs import check_output_file, output_lock


@dataclass(frozen=True)
class SplitFigures:
    """The calibrated policy on one split, beside the split's last exit alone."""

    result: PolicyResult
    last_exit_accuracy: float

    @property
    def accuracy(self) -> float:
        """The policy's accuracy on the split."""
        return self.result.accuracy

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as the calibration file holds it."""
        return {**self.result.to_dict(), "last_exit_accuracy": self.last_exit_accuracy}


@dataclass(frozen=True)
class ExitSelection:
    """Exit selection (``--select-exits``): the exits kept and every subset tried, costed in the time the profile
    measured at batch 1; on test, the mean time the kept exits take (when the test split was collected)."""

    profile: Path
    backbone_ms: float
    exits: tuple[int, ...]
    subsets: tuple[SubsetChoice, ...]
    test_mean_ms: float | None = None

    @property
    def test_speedup(self) -> float | None:
        """The backbone's time over the kept exits' mean time on test."""
        return None if self.test_mean_ms is None else self.backbone_ms / self.test_mean_ms

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as the calibration file holds it."""
        d: dict[str, Any] = {
            "profile": str(self.profile), "cost": "mean ms at batch 1, measured", "backbone_ms": self.backbone_ms,
            "exits": list(self.exits),
            "subsets": [{"exits": list(t.exits), "val_accuracy": t.accuracy, "val_mean_ms": t.mean_ms,
                         "val_speedup": self.backbone_ms / t.mean_ms, "reaches_target": t.reaches_target}
                        for t in self.subsets],
        }  # fmt: skip
        if self.test_mean_ms is not None:
            d.update(test_mean_ms=self.test_mean_ms, test_speedup=self.test_speedup)
        return d


@dataclass(frozen=True)
class AlternativeRule:
    """A FLOP budget met by the other rule (``search`` or ``msdnet``), for comparison."""

    rule: str
    policy: ExitPolicy
    validation: PolicyResult
    test: PolicyResult | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as the calibration file holds it."""
        d = {"rule": self.rule, "policy": self.policy.to_dict(), "validation": self.validation.to_dict()}
        return d if self.test is None else {**d, "test": self.test.to_dict()}


@dataclass(frozen=True)
class CalibrationReport:
    """A calibration (``RUN/calibration.json``): the policy fit on validation and how it was fit, its figures on
    validation and (if collected) test beside the last exit's, the oracle, every step alone, and what exit
    selection or the other budget rule found."""

    run: str
    fingerprint: str
    created: str
    calibration: Calibration
    base_flops: int
    validation: SplitFigures
    test: SplitFigures | None
    oracle: dict[str, dict[str, Any] | None]  # "validation" and "test": each the oracle's figures, or None
    steps: list[dict[str, Any]]
    selection: ExitSelection | None = None
    alternative: AlternativeRule | None = None
    combined_steps: list[dict[str, Any]] | None = None  # every step's combined answer alone, under --combine-exits

    @property
    def policy(self) -> ExitPolicy:
        """The calibrated policy."""
        return self.calibration.policy

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the calibration file."""
        c = self.calibration
        d: dict[str, Any] = {
            "format": CALIBRATION_FORMAT, "run": self.run, "model_fingerprint": self.fingerprint,
            "created": self.created, "rule": c.rule, "target": c.target, "policy": c.policy.to_dict(),
            "base_flops": self.base_flops, "validation": self.validation.to_dict(),
            "test": None if self.test is None else self.test.to_dict(), "oracle": self.oracle, "steps": self.steps,
        }  # fmt: skip
        if self.selection is not None:
            d["selection"] = self.selection.to_dict()
        if self.alternative is not None:
            d["alternative"] = self.alternative.to_dict()
        if self.combined_steps is not None:
            d["combined_steps"] = self.combined_steps
        return d


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration aims at and how it fits its thresholds (:func:`calibrate_run`).

    Exactly one target: ``max_drop`` (accuracy points below the last exit, on validation) or ``budget`` (mean
    FLOPs as a fraction of the backbone's). ``criterion`` scores a sample's confidence at an exit; ``rule`` fits a
    FLOP budget (``search``, or MSDNet's ``msdnet``); ``temperature`` scales each exit's logits first. ``select``
    (with ``max_drop``) also chooses which exits to keep, costed in the time the run's device profile measured at
    batch 1; ``combine`` has every exit answer with a weighted ensemble of itself and the earlier exits."""

    max_drop: float | None = None
    budget: float | None = None
    criterion: str = "entropy"
    rule: str = "search"
    temperature: bool = False
    select: bool = False
    combine: bool = False

    def __post_init__(self) -> None:
        if (self.max_drop is None) == (self.budget is None):
            raise AnytimeError("give exactly one target: --max-drop POINTS or --budget-flops FRACTION")
        if self.select and self.max_drop is None:
            raise AnytimeError("--select-exits chooses exits for an accuracy target: give --max-drop POINTS")


def calibrate_run(
    run: RunFolder | str | Path, settings: CalibrationSettings, *, out: str | Path | None = None,
    profile: str | Path | None = None,
) -> CalibrationReport:  # fmt: skip
    """Fit thresholds on the validation cache as ``settings`` say; report validation and (if collected) test side
    by side, and write them to ``out`` (default ``RUN/calibration.json``).

    The test cache is opened only after the thresholds are fixed, to report them. With ``settings.select``, exits
    are also selected: every subset of the early exits is costed in the time the run's device ``profile`` (default:
    its only one) measured at batch 1 (:func:`~anytime.calibrate.select_exits`). With ``settings.combine``, every
    exit answers with a weighted ensemble of itself and the earlier exits, weights fit on validation
    (:mod:`anytime.calibrate.combine`).
    """
    folder = open_run(run)
    target = check_output_file(Path(out) if out else folder.path / CALIBRATION, what="calibration",
                               format_tag=CALIBRATION_FORMAT, create_parents=out is None, example=CALIBRATION)  # fmt: skip
    timed = _measured_costs(folder, profile) if settings.select else None
    with output_lock(target):
        report = _calibrate(folder, settings, timed)
        write_json(target, report.to_dict())
    return report


def _measured_costs(folder: RunFolder, profile: str | Path | None) -> tuple[Path, tuple[torch.Tensor, torch.Tensor]]:
    from anytime.calibrate import measured_costs

    path = find_profile(folder.path, profile)
    loaded = DeviceProfile.load(path, fingerprint=folder.fingerprint)
    batch = loaded.at(1)
    if batch.stages is None:
        raise AnytimeError(f"{path} has no stage latencies (the model is not incremental): exits cannot be selected")
    costs = measured_costs([float(s.mean()) for s in batch.steps], [float(s.mean()) for s in batch.stages])
    return path, costs


def _calibrate(
    folder: RunFolder, settings: CalibrationSettings, timed: tuple[Path, tuple[torch.Tensor, torch.Tensor]] | None
) -> CalibrationReport:
    run_dir, fingerprint = folder.path, folder.fingerprint
    max_drop, budget, criterion, rule = settings.max_drop, settings.budget, settings.criterion, settings.rule
    temperature, combine = settings.temperature, settings.combine
    val = load_cache(run_dir, "val", fingerprint=fingerprint)
    calibration: Calibration
    tried: list[SubsetChoice] = []
    alt: Calibration | None = None
    if timed is not None:
        assert max_drop is not None
        calibration, tried = select_exits(val, max_drop=max_drop, costs=timed[1], criterion=criterion,
                                          temperature=temperature, combine=combine)  # fmt: skip
    elif max_drop is not None:
        calibration = calibrate_max_drop(val, max_drop=max_drop, criterion=criterion, temperature=temperature,
                                         combine=combine)  # fmt: skip
    else:
        assert budget is not None
        calibration = calibrate_budget(val, budget=budget, criterion=criterion, rule=rule, temperature=temperature,
                                       combine=combine)  # fmt: skip
        alt = calibrate_budget(val, budget=budget, criterion=criterion, rule="msdnet" if rule == "search" else "search",
                               temperature=temperature, combine=combine)  # fmt: skip
    # the test cache is opened only now that the thresholds are fixed, to report them
    test = load_cache(run_dir, "test", fingerprint=fingerprint) if cache_path(run_dir, "test").is_file() else None
    selection, alternative = None, None
    if timed is not None:
        path, costs = timed
        kept = tuple(k for k, t in enumerate(calibration.policy.thresholds) if t is not None)
        test_ms = None
        if test is not None:
            share = torch.tensor([calibration.policy.evaluate(test).exit_share], dtype=torch.float64)
            test_ms = float((share * calibration.policy.leave_costs(*costs)).sum())
        selection = ExitSelection(path, float(costs[0][-1]), kept, tuple(tried), test_ms)
    if alt is not None:
        alternative = AlternativeRule(
            alt.rule, alt.policy, alt.fit, None if test is None else alt.policy.evaluate(test)
        )
    policy = calibration.policy
    return CalibrationReport(
        run=str(run_dir), fingerprint=fingerprint, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        calibration=calibration, base_flops=val.base_flops,
        validation=SplitFigures(calibration.fit, float(val.step_accuracy()[-1])),
        test=None if test is None else SplitFigures(policy.evaluate(test), float(test.step_accuracy()[-1])),
        oracle={"validation": oracle_dict(val), "test": None if test is None else oracle_dict(test)},
        steps=steps_table({"val": val, "test": test}), selection=selection, alternative=alternative,
        combined_steps=None if policy.combine is None else steps_table(
            {"val": policy.seen_by(val), "test": None if test is None else policy.seen_by(test)}),
    )  # fmt: skip
