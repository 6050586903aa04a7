"""Families of anytime steps compared on latency: timed side by side here, or read from saved profiles."""

from __future__ import annotations

import itertools
import json

import pytest

from anytime.errors import AnytimeError
from anytime.tasks.compare import matched_table, measured_side_by_side


def test_every_step_of_every_family_is_timed_in_one_measurement(exit_run):
    ticks = itertools.count()
    calls = []

    def clock() -> float:  # every call is timed between two consecutive readings: 1 ms each
        calls.append(1)
        return 0.001 * next(ticks)

    points = measured_side_by_side({"exits": exit_run, "the same again": exit_run}, repeats=6, warmup=2, turn=3,
                                   clock=clock)  # fmt: skip
    steps = json.loads((exit_run / "summary.json").read_text())["exits"]
    assert list(points) == ["exits", "the same again"]
    assert len(calls) == 2 * 6 * 2 * len(steps)
    for family, got in points.items():
        assert [p.name for p in got] == [s["name"] for s in steps]
        assert [p.test_acc for p in got] == [s["test_acc"] for s in steps]
        assert all(p.family == family and p.mean_ms == pytest.approx(1.0) for p in got)
    table = matched_table(points, [1.5])
    assert table[0]["exits_step"] == max(steps, key=lambda s: s["val_acc"])["name"]  # all fit; the first best


def test_side_by_side_measurement_refuses_bad_input_in_one_line(exit_run, tmp_path):
    for bad in ({"repeats": 0}, {"turn": 0}, {"processes": 0}, {"warmup": -1}):
        with pytest.raises(AnytimeError, match="at least"):
            measured_side_by_side({"exits": exit_run}, **bad)
    with pytest.raises(AnytimeError, match="no runs"):
        measured_side_by_side({})
    with pytest.raises(AnytimeError, match="no training summary"):
        measured_side_by_side({"exits": exit_run, "missing": tmp_path / "nothing"})


def test_fresh_processes_pool_their_timings(exit_run):
    points = measured_side_by_side({"exits": exit_run}, repeats=2, warmup=1, turn=1, processes=2)
    steps = json.loads((exit_run / "summary.json").read_text())["exits"]
    assert [p.name for p in points["exits"]] == [s["name"] for s in steps]
    assert all(p.mean_ms > 0 and p.p50_ms <= p.p99_ms for p in points["exits"])


def test_points_from_a_saved_profile_where_the_target_device_is_elsewhere(exit_run, tmp_path):
    from dataclasses import replace

    from anytime.tasks.compare import step_points
    from anytime.tasks.profiling import ProfileSettings, profile_run

    profile, _ = profile_run(
        exit_run,
        ProfileSettings(batch_sizes=(1,), repeats=3, warmup=0, memory=False, steady_within=None),
        out=tmp_path / "profile.json",
    )
    points = step_points(exit_run, profile, family="exits")
    steps = json.loads((exit_run / "summary.json").read_text())["exits"]
    assert [p.name for p in points] == [s["name"] for s in steps] and all(p.mean_ms > 0 for p in points)
    with pytest.raises(AnytimeError, match="another model"):
        step_points(exit_run, replace(profile, model_fingerprint="0" * 16), family="exits")
