"""The scheduler's query path with numpy alone: a run folder's profile and options, the frontier, ``select``,
``observe`` and ``anytime schedule``. These tests import no torch (``make test`` also runs them under Python
3.10 in a venv that has numpy and pytest only), and one checks that the path never imports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.profile.store import BatchLatency, DeviceProfile
from anytime.scheduler.query import schedule_answer, scheduler_for_run
from anytime.train.records import run_weights_fingerprint

REPO = Path(__file__).resolve().parents[1]
STEP_MS = (1.0, 2.0, 4.0)
ACCURACY = (0.6, 0.8, 0.9)


def make_run(folder: Path, *, calibration: bool = True, energy_mj: tuple[float, ...] | None = None) -> Path:
    """A run folder as `anytime train --exits` and `anytime profile` leave it, written without torch: weights
    are opaque bytes (only their fingerprint is read), step k takes STEP_MS[k] * (1 + i/99) ms, i = 0..99."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"train": {"model": "toy", "exits": "auto"},
                                                    "dataset": {"name": "toy", "in_channels": 1}}))  # fmt: skip
    (folder / "model.safetensors").write_bytes(b"not really weights" * 10)
    (folder / "summary.json").write_text(json.dumps({"exits": [{"val_acc": a} for a in ACCURACY],
                                                     "final": {"val_acc": ACCURACY[-1]}}))  # fmt: skip
    fingerprint = run_weights_fingerprint(folder)
    ramp = 1 + np.arange(100) / 99
    stage_ms = np.diff(np.concatenate([[0.0], STEP_MS]))
    latency = {b: BatchLatency(b, tuple(b * v * ramp for v in STEP_MS), tuple(b * v * ramp for v in stage_ms))
               for b in (1, 4)}  # fmt: skip
    meter = None
    if energy_mj is not None:
        from anytime.profile.energy import BatchEnergy, EnergyMeter, EnergySettings, EnergyWindows
        from anytime.profile.energy_readers import EnergySource

        def windows(mj: float) -> EnergyWindows:
            return EnergyWindows(np.full(4, mj / 1000), np.full(4, 0.001), 50)

        figures = BatchEnergy(tuple(windows(v) for v in energy_mj), tuple(windows(v) for v in energy_mj))
        latency = {b: BatchLatency(b, at.steps, at.stages, energy=figures) for b, at in latency.items()}
        meter = EnergyMeter(EnergySource("rapl", "package-0", 2**-14, 1e-3, False), EnergySettings(windows=4), 2.0)
    DeviceProfile(
        model_fingerprint=fingerprint, model="toy", input_shape=(1, 8, 8), incremental=True,
        step_names=("exit0", "exit1", "exit2"), step_flops=(1, 2, 3), step_params=(1, 1, 1), model_bytes=4,
        latency=latency, device={"type": "cpu", "label": "test cpu"}, settings={"repeats": 100}, created="now",
        energy=meter,
    ).save(folder / "profile-cpu-test.json")  # fmt: skip
    if calibration:
        (folder / "calibration.json").write_text(json.dumps({
            "format": "anytime-calibration-v1", "model_fingerprint": fingerprint,
            "policy": {"criterion": "confidence", "thresholds": [0.9, 0.8], "temperatures": None},
            "validation": {"accuracy": 0.88, "flops_ratio": 0.5, "last_exit_accuracy": 0.9, "exit_share": [0.5, 0.3, 0.2]},
        }))  # fmt: skip
    return folder


def test_select_frontier_and_observe_from_a_run_folder(tmp_path):
    run = make_run(tmp_path / "run")
    scheduler, path = scheduler_for_run(run)
    assert path.name == "profile-cpu-test.json"
    names = set(scheduler.options)
    assert {"exit0", "exit1", "exit2"} <= names and any(n.startswith("calibration") for n in names)
    # p99 of step k is STEP_MS[k] * (1 + 98/99): exit1 fits 4 ms, exit2 needs 8 ms.
    assert scheduler.select(4.0, 0.99).option == "exit1"
    assert scheduler.select(8.0, 0.99).option == "exit2"
    low = scheduler.select(0.5, 0.99)
    assert not low.fits and low.option == scheduler.frontier(0.99, 1)[0][0].name
    latencies = [ms for _, ms in scheduler.frontier(0.99, 4)]
    assert latencies == sorted(latencies)
    # The device slows down threefold: after enough observations exit1 no longer fits 4 ms.
    for _ in range(60):
        scheduler.observe("exit1", 3 * 0.002, 1)
    assert scheduler.select(4.0, 0.99).option != "exit1"


def test_schedule_answer_is_what_the_command_prints(tmp_path, capsys):
    run = make_run(tmp_path / "run", calibration=False)
    scheduler, path = scheduler_for_run(run)
    expected = schedule_answer(scheduler, path, 5.0, 0.99, 1)
    assert main(["schedule", str(run), "--deadline-ms", "5"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(expected))
    assert expected["option"] == "exit1" and [f["option"] for f in expected["frontier"]] == ["exit0", "exit1", "exit2"]


def test_the_query_path_refuses_bad_input_in_one_line(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "model.safetensors").write_bytes(b"other weights")  # the profile and calibration now name other weights
    with pytest.raises(AnytimeError, match="another model"):
        scheduler_for_run(run)
    with pytest.raises(AnytimeError, match="not a run"):
        scheduler_for_run(tmp_path)
    broken = make_run(tmp_path / "broken")
    (broken / "config.json").write_text("{")
    with pytest.raises(AnytimeError, match="not a valid run record"):
        scheduler_for_run(broken)
    unfinished = make_run(tmp_path / "unfinished")
    (unfinished / "model.safetensors").unlink()
    with pytest.raises(AnytimeError, match="has not finished"):
        scheduler_for_run(unfinished)


def test_anytime_schedule_never_imports_torch(tmp_path):
    run = make_run(tmp_path / "run")
    code = ("import sys; from anytime.cli import main; status = main(['schedule', sys.argv[1], '--deadline-ms', '5']); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchvision', 'sklearn', 'matplotlib', "
            "'scipy', 'PIL', 'tqdm'}); print('HEAVY', heavy, file=sys.stderr); sys.exit(status or bool(heavy))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr and json.loads(done.stdout)["option"] == "exit1"


def test_an_energy_budget_from_a_run_folder(tmp_path, capsys):
    run = make_run(tmp_path / "run", calibration=False, energy_mj=(3.0, 9.0, 20.0))
    assert main(["schedule", str(run), "--deadline-ms", "8", "--energy-mj", "10"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["option"] == "exit1" and answer["energy_mj"] == pytest.approx(9.0) and answer["fits"]
    assert [f["energy_mj"] for f in answer["frontier"]] == pytest.approx([3.0, 9.0, 20.0])
    assert main(["schedule", str(run), "--deadline-ms", "8", "--energy-mj", "1"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["option"] == "exit0" and not answer["fits"] and "energy budget 1 mJ" in answer["note"]
