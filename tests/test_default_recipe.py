"""`anytime train` with no model or card named: the default image recipe, its least number of steps."""

from __future__ import annotations

import json

import pytest

from anytime.cli import main
from anytime.train import defaults


def _trained(out):
    return json.loads((out / "config.json").read_text())["train"], json.loads((out / "summary.json").read_text())


def test_no_model_trains_the_image_card_for_at_least_its_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(defaults, "DEFAULT_IMAGE_MIN_STEPS", 30)
    out = tmp_path / "run"
    # 128 training digits in batches of 64: 2 steps an epoch, so 15 epochs (more than the card's 10) for 30 steps
    assert main(["train", "--limit-train", "128", "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "card image-lenet" in err and "2 steps an epoch: 15 epochs" in err
    config, summary = _trained(out)
    assert (config["model"], config["lr"], config["batch_size"], config["epochs"]) == ("lenet", 0.05, 64, 15)
    assert summary["epochs"] == 15


def test_epochs_given_are_kept_and_a_named_model_keeps_the_generic_defaults(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(defaults, "DEFAULT_IMAGE_MIN_STEPS", 30)
    out = tmp_path / "given"
    assert main(["train", "--limit-train", "128", "--epochs", "1", "--out", str(out), "--no-progress"]) == 0
    assert "steps an epoch" not in capsys.readouterr().err
    assert _trained(out)[0]["epochs"] == 1
    named = tmp_path / "named"
    assert main(["train", "--model", "lenet", "--limit-train", "128", "--out", str(named), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "image-lenet" not in err
    config, _ = _trained(named)
    assert (config["lr"], config["batch_size"], config["epochs"]) == (0.01, 128, 10)


@pytest.mark.parametrize("argv", [["--data", "cifar10", "--data-root", "/nonexistent/cifar"]])
def test_a_bad_data_path_is_still_one_line(argv, tmp_path, capsys):
    assert main(["train", *argv, "--out", str(tmp_path / "r")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "/nonexistent/cifar" in err[0]


def test_without_out_the_run_is_named_by_model_and_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--limit-train", "128", "--epochs", "1", "--no-progress"]) == 0
    assert json.loads((tmp_path / "runs" / "lenet-digits" / "config.json").read_text())["train"]["lr"] == 0.05
