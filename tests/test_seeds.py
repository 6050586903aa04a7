"""`anytime seeds`: several seeds of one recipe summarised with their spread; other recipes refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.tasks.seeds import summarise_seeds


def _run(folder: Path, seed: int, accuracies: list[tuple[float, float]], **train: object) -> Path:
    folder.mkdir(parents=True)
    recipe = {"model": "resnet20", "exits": "auto", "lr": 0.05, "seed": seed, "device": "cpu", **train}
    (folder / "config.json").write_text(
        json.dumps({"train": recipe, "dataset": {"name": "digits", "fingerprint": "f"}})
    )
    (folder / "model.safetensors").write_bytes(b"w")
    exits = [{"val_acc": v, "test_acc": t} for v, t in accuracies]
    (folder / "summary.json").write_text(json.dumps({"exits": exits, "final": exits[-1], "train_time_s": 10.0 + seed}))
    return folder


def test_the_spread_of_every_step_over_the_seeds(tmp_path, capsys):
    runs = [_run(tmp_path / f"s{s}", s, [(0.5 + 0.1 * s, 0.4 + 0.1 * s), (0.8, 0.7 + 0.02 * s)]) for s in range(3)]
    summary = summarise_seeds(runs)
    assert summary.seeds == (0, 1, 2) and [s.name for s in summary.steps] == ["exit0", "exit1"]
    first = summary.steps[0].val_acc
    assert (
        first.mean == pytest.approx(0.6) and first.std == pytest.approx(0.1) and (first.low, first.high) == (0.5, 0.7)
    )
    last = summary.steps[1].val_acc
    assert (last.mean, last.std, last.low, last.high) == pytest.approx((0.8, 0.0, 0.8, 0.8))
    assert summary.train_time_s.mean == pytest.approx(11.0)
    assert main(["seeds", *map(str, runs), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"][0]["test_acc"]["mean"] == pytest.approx(0.5)


def test_seeds_of_other_recipes_or_data_are_refused(tmp_path, cli_error):
    a = _run(tmp_path / "a", 0, [(0.5, 0.5)])
    other_lr = _run(tmp_path / "b", 1, [(0.5, 0.5)], lr=0.1)
    same_seed = _run(tmp_path / "c", 0, [(0.5, 0.5)], device="cuda")  # a speed-only option may differ, not the seed
    cli_error(["seeds", str(a), str(other_lr)], "differs", "lr")
    cli_error(["seeds", str(a), str(same_seed)], "same seed")
    cli_error(["seeds", str(a)], "at least two runs")
    cli_error(["seeds", str(a), str(tmp_path / "nowhere")], "no run directory")
    other_data = _run(tmp_path / "d", 2, [(0.5, 0.5)])
    config = json.loads((other_data / "config.json").read_text())
    config["dataset"]["fingerprint"] = "g"
    (other_data / "config.json").write_text(json.dumps(config))
    with pytest.raises(AnytimeError, match="other data"):
        summarise_seeds([a, other_data])
