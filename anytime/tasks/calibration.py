"""Calibrate a run: thresholds fit on its validation cache, reported on validation and test (``RUN/calibration.json``)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from anytime.calibrate import (
    Calibration,
    ExitPolicy,
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
    run_fingerprint,
)  # fmt: skip
from anytime.tasks.sweep import oracle_dict, steps_table
from anytime.utils.io import write_json
from anytime.utils.outputs import check_output_file, output_lock


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
        "oracle": {"validation": oracle_dict(val), "test": None if test is None else oracle_dict(test)},
        "steps": steps_table({"val": val, "test": test}), **extra,
    }  # fmt: skip
    if calibration.policy.combine is not None:
        report["combined_steps"] = steps_table(
            {"val": calibration.policy.seen_by(val), "test": None if test is None else calibration.policy.seen_by(test)}
        )
    return report
