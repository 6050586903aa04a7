"""A run folder opened once (``RunFolder``): what it reads, what it refuses, and the workflows that take one."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from anytime.errors import AnytimeError


def test_a_folder_holds_the_record_recipe_and_fingerprint_of_its_run(exit_run):
    from anytime.train import RunFolder
    from anytime.train.records import read_record, run_weights_fingerprint
    from anytime.train.runs import run_config

    folder = RunFolder.open(exit_run)
    config, dataset = run_config(exit_run)
    assert folder.path == exit_run
    assert dict(folder.record) == read_record(exit_run)
    assert folder.config == config and dict(folder.dataset) == dataset
    assert folder.fingerprint == run_weights_fingerprint(exit_run)
    assert folder.modality == "image"
    summary = folder.summary()
    assert summary.model == "resnet8" and len(summary.steps) == folder.load().num_steps
    with pytest.raises(TypeError):
        folder.record["train"] = {}  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        folder.fingerprint = "other"  # type: ignore[misc]


def test_a_missing_or_unfinished_run_is_refused_in_one_line(exit_run, tmp_path):
    from anytime.train import RunFolder

    with pytest.raises(AnytimeError, match="no run directory"):
        RunFolder.open(tmp_path / "nothing")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(exit_run, unfinished)
    (unfinished / "model.safetensors").unlink()
    with pytest.raises(AnytimeError, match="has not finished"):
        RunFolder.open(unfinished)
    broken = tmp_path / "broken"
    shutil.copytree(exit_run, broken)
    (broken / "summary.json").write_text(json.dumps({"final": {}}))
    with pytest.raises(AnytimeError, match="is not a run's summary"):
        RunFolder.open(broken).summary()


def test_loading_weights_other_than_the_ones_opened_is_refused(exit_run):
    from anytime.train import RunFolder

    stale = dataclasses.replace(RunFolder.open(exit_run), fingerprint="0" * 16)
    with pytest.raises(AnytimeError, match="changed since it was opened"):
        stale.load()


def test_the_workflows_take_an_open_folder_and_never_open_it_again(exit_run, tmp_path, monkeypatch):
    from anytime.calibrate import CRITERIA
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run
    from anytime.tasks.evaluation import EvaluationSettings, evaluate_run
    from anytime.tasks.sweep import sweep_run
    from anytime.train import RunFolder, open_run

    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    folder = RunFolder.open(run)
    assert open_run(folder) is folder

    def opened_again(*args, **kwargs):
        raise AssertionError("the run folder was opened again")

    monkeypatch.setattr(RunFolder, "open", classmethod(opened_again))
    for split in ("val", "test"):
        collect_run(folder, split)
    swept = sweep_run(folder, list(CRITERIA))
    calibration = calibrate_run(folder, CalibrationSettings(max_drop=1.0))
    evaluation = evaluate_run(folder, EvaluationSettings(latency_samples=0))
    assert swept.csv.parent == run and (run / "calibration.json").is_file()
    assert calibration.fingerprint == folder.fingerprint and calibration.run == str(run)
    assert evaluation.run == str(run) and evaluation.samples > 0
