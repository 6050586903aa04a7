"""The command line: help for every command, smoke runs, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from anytime.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _assert_one_line_error(code, err, *words):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name, (_, description) in COMMANDS.items():
        assert name in out and description in out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: anytime " + command in capsys.readouterr().out


def test_python_dash_m_and_console_script():
    script = Path(sys.executable).with_name("anytime")
    for argv in ([sys.executable, "-m", "anytime", "--help"], [str(script), "--help"]):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        assert done.returncode == 0 and "experiment" in done.stdout, argv


def test_models_lists_the_zoo_with_parameters(capsys):
    code, out, _ = _run(capsys, "models", "--no-torchvision", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {"lenet", "resnet18", "resnet20", "mobilenetv2", "resnext29_2x64d"} <= set(rows)
    assert 0.2e6 < rows["resnet20"]["parameters"] < 0.3e6
    code, out, _ = _run(capsys, "models")
    assert code == 0 and "tv:resnet18" in out and "tv:mobilenet_v2" in out


def test_train_digits_end_to_end(capsys, tmp_path):
    run = tmp_path / "run"
    code, out, err = _run(capsys, "train", "--model", "lenet", "--data", "digits", "--epochs", "2", "--batch-size",
                          "64", "--lr", "0.05", "--out", str(run), "--no-progress")  # fmt: skip
    assert code == 0
    assert "accuracy" in out and "iteration" in out and "memory" in out
    assert "augmentation crop (padding 4) (no mirror flips" in err  # said before training starts
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["final"]["test_acc"] > 0.5
    baseline = summary["baseline"]
    assert baseline["kind"] == "pixel-logistic" and baseline["test_acc"] > 0.9
    assert baseline["gap_to_last_exit"] == pytest.approx(summary["final"]["test_acc"] - baseline["test_acc"])
    assert f"test {100 * baseline['test_acc']:.2f}%" in out.split("baseline", 1)[1]
    code, _, err = _run(capsys, "train", "--model", "lenet", "--out", str(run))
    _assert_one_line_error(code, err, "--resume")
    code, out, _ = _run(capsys, "train", "--out", str(run), "--resume", "--no-progress")
    assert code == 0 and "2 epoch(s)" in out


def test_a_network_that_loses_to_the_baseline_says_so(capsys, tmp_path):
    code, out, _ = _run(capsys, "train", "--model", "lenet", "--data", "digits", "--epochs", "1", "--lr", "0.0001",
                        "--out", str(tmp_path / "run"), "--no-progress")  # fmt: skip
    assert code == 0 and "the network LOSES to it by" in out


def test_train_takes_the_fast_recipe_knobs_and_refuses_bad_ones(capsys, tmp_path):
    run = tmp_path / "run"
    code, out, _ = _run(capsys, "train", "--model", "lenet", "--epochs", "1", "--limit-train", "300", "--augment", "none",
                        "--cutout", "8", "--schedule", "onecycle", "--warmup", "0.3", "--label-smoothing", "0.1", "--ema",
                        "0.9", "--nesterov", "--tta", "--out", str(run), "--no-progress")  # fmt: skip
    assert code == 0 and "augment    none, cutout 8" in out and "test with mirror" in out
    train = json.loads((run / "config.json").read_text())["train"]
    assert (train["augment"], train["cutout"], train["schedule"], train["ema"], train["nesterov"]) == (
        "none",
        8,
        "onecycle",
        0.9,
        True,
    )
    code, _, err = _run(capsys, "train", "--model", "lenet", "--ema", "1.5", "--out", str(tmp_path / "bad"))
    _assert_one_line_error(code, err, "--ema", "0.999")
    code, _, err = _run(capsys, "train", "--model", "lenet", "--warmup", "1", "--out", str(tmp_path / "bad"))
    _assert_one_line_error(code, err, "warm-up")
    code, _, err = _run(capsys, "train", "--model", "lenet", "--gradient-equilibrium", "--out", str(tmp_path / "bad"))
    _assert_one_line_error(code, err, "--gradient-equilibrium", "--exits")
    assert not (tmp_path / "bad").exists()
    exits = tmp_path / "exits"
    code, _, _ = _run(capsys, "train", "--model", "resnet20", "--exits", "auto", "--exit-head", "scaled",
                      "--gradient-equilibrium", "--norm-bias-lr-scale", "4", "--epochs", "1", "--limit-train", "300",
                      "--out", str(exits), "--no-progress")  # fmt: skip
    train = json.loads((exits / "config.json").read_text())["train"]
    assert code == 0 and (train["exit_head"], train["gradient_equilibrium"], train["norm_bias_lr_scale"]) == (
        "scaled",
        True,
        4.0,
    )


def test_train_from_a_card_with_overrides(capsys, tmp_path):
    card = REPO / "models" / "digits-lenet.toml"
    run = tmp_path / "run"
    code, _, _ = _run(capsys, "train", "--card", str(card), "--epochs", "1", "--limit-train", "200", "--out",
                      str(run), "--no-progress")  # fmt: skip
    assert code == 0
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["epochs"] == 1 and config["train"]["lr"] == 0.05 and config["card"] == str(card)


def test_a_card_records_only_its_own_recipe(capsys, tmp_path):
    card = tmp_path / "digits-lenet.toml"
    shutil.copy(REPO / "models" / "digits-lenet.toml", card)
    code, _, err = _run(capsys, "train", "--card", str(card), "--epochs", "1", "--update-card", "--out",
                        str(tmp_path / "a"))  # fmt: skip
    _assert_one_line_error(code, err, "--epochs")
    code, out, _ = _run(capsys, "train", "--card", str(card), "--update-card", "--out", str(tmp_path / "b"),
                        "--no-progress")  # fmt: skip
    assert code == 0 and "results recorded" in out
    text = card.read_text()
    assert "[results]" in text and "test_acc = " in text and 'date = "' in text


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["train", "--model", "resnet2O", "--epochs", "1"], ["resnet2O", "resnet20"]),
        (["train", "--data", "cifar10", "--data-root", "/nonexistent/cifar"], ["/nonexistent/cifar"]),
        (["train", "--card", "/nonexistent/card.toml"], ["card"]),
        (["train", "--resume", "--out", "/nonexistent/run"], ["checkpoint"]),
        (["train", "--update-card"], ["--card"]),
        (["train", "--device", "tpu"], ["device"]),
        (["train", "--out", "/proc/version/run"], ["/proc/version"]),
        (["experiment", "nonsense"], ["nonsense", "batch-time"]),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, words):
    code, _, err = _run(capsys, *argv, *([] if "--out" in argv else ["--out", str(tmp_path / "r")]))
    _assert_one_line_error(code, err, *words)


def test_argument_errors_are_reported_by_argparse(capsys):
    for argv in (["train", "--epochs", "0"], ["train", "--lr", "nan"], ["train", "--data", "mnist"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error:" in err and len(err.strip().splitlines()) == 1, err


def _shorter_demo(monkeypatch, **changes) -> None:
    """Make `anytime demo` train a LeNet for one epoch on 256 images, with fewer timings and requests."""
    import functools

    import anytime.tasks.demo

    short = anytime.tasks.demo.DEMO_CONFIG.replace(**{"model": "lenet", "epochs": 1, "limit_train": 256, **changes})
    monkeypatch.setattr(anytime.tasks.demo, "run_demo", functools.partial(anytime.tasks.demo.run_demo, config=short))
    monkeypatch.setattr(anytime.tasks.demo, "DEMO_TIMINGS", 100)  # the fewest a p99 needs
    monkeypatch.setattr(anytime.tasks.demo, "DEMO_REQUESTS", 20)


def test_demo_writes_results_and_plots(capsys, tmp_path, monkeypatch):
    # A shorter demo: every file, the JSON, the scheduler's answers and the replacement of an earlier demo. What the
    # demo itself reaches is checked by the slow test below (and by CI).
    out_dir = tmp_path / "demo"
    _shorter_demo(monkeypatch)
    code, out, _ = _run(capsys, "demo", "--out", str(out_dir))
    assert code == 0
    assert "test accuracy" in out and str(out_dir) in out and "deadlines at batch 1" in out
    demo = json.loads((out_dir / "demo.json").read_text())
    assert [int(r["batch_size"]) for r in demo["batch_time"]] == [8, 16, 32, 64]
    # The lowest deadline is half the cheapest price of any option: nothing fits (no promise, none broken); the highest is
    # above every option's: every request there was promised.
    rows = demo["deadlines"]["rows"]
    assert rows[0]["promised"] == 0 and rows[0]["kept"] is None and rows[0]["requests"] == 20
    assert rows[-1]["promised"] == 20 and rows[-1]["kept"] is not None
    assert "infeasible" in out and "promise (p99" in out
    _shorter_demo(monkeypatch, limit_train=128)
    code, printed, _ = _run(capsys, "demo", "--out", str(out_dir), "--overwrite", "--json")
    assert code == 0 and set(json.loads(printed)) >= {"summary", "deadlines", "batch_time"}
    for name in ("demo.json", "training_curves.png", "training_curves.svg", "batch_time.png", "run/metrics.csv",
                 "run/plots/deadline_accuracy.png"):  # fmt: skip
        assert (out_dir / name).is_file(), name
    assert json.loads((out_dir / "demo.json").read_text())["config"]["limit_train"] == 128


@pytest.mark.slow
def test_make_demo_trains_a_model_that_answers_at_every_deadline(capsys, tmp_path):
    out_dir = tmp_path / "demo"
    code, out, _ = _run(capsys, "demo", "--out", str(out_dir))
    assert code == 0
    demo = json.loads((out_dir / "demo.json").read_text())
    assert demo["summary"]["final"]["test_acc"] > 0.8
    # At the lowest deadline nothing fits, and the runtime still answers. (Which exits it reaches depends on how fast
    # this machine is right now, so that is not asserted here.)
    lowest, highest = demo["deadlines"]["rows"][0], demo["deadlines"]["rows"][-1]
    assert lowest["kept"] is None and lowest["promised"] == 0 and lowest["requests"] == 200
    assert highest["promised"] == 200 and highest["delivered_accuracy"] > 0.8


def test_every_option_with_a_default_shows_it_in_its_help():
    import argparse

    from anytime.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in command._get_formatter()._get_help_string(action), (name, action.dest)


def test_every_reporting_command_speaks_json(exit_run, tmp_path, capsys):
    import argparse
    import shutil

    from anytime.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    quiet = {"serve", "schedule"}  # a server, JSON always
    for name, command in commands.items():
        assert name in quiet or any("--json" in a.option_strings for a in command._actions), name
    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    assert main(["collect", str(run), "--json"]) == 0
    collected = json.loads(capsys.readouterr().out)
    assert collected["split"] == "val" and len(collected["steps"]) == 3 and collected["samples"] > 0
    assert main(["plot", str(run), "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert any(p.endswith("pareto.pdf") for p in drawn["paths"]) and any("calibrat" in s for s in drawn["skipped"])


@pytest.mark.parametrize("emulated", [True, False])
def test_train_says_when_bf16_is_emulated_on_this_cpu(capsys, tmp_path, monkeypatch, emulated):
    import anytime.utils.machine as machine

    monkeypatch.setattr(machine, "bf16_emulated", lambda device: emulated)
    code, _, err = _run(capsys, "train", "--model", "lenet", "--data", "digits", "--epochs", "1", "--limit-train", "64",
                        "--amp", "bf16", "--out", str(tmp_path / "r"))  # fmt: skip
    assert code == 0
    assert ("no bfloat16 instructions" in err and "--amp off" in err) is emulated


def test_bf16_is_emulated_only_on_a_cpu_without_bf16_instructions(monkeypatch):
    import torch

    from anytime.utils import machine

    assert not machine.bf16_emulated(torch.device("cuda"))
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert machine.bf16_emulated(torch.device("cpu"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert not machine.bf16_emulated(torch.device("cpu"))


def test_a_study_draws_its_figures_at_the_size_asked_for(capsys, tmp_path, monkeypatch):
    from PIL import Image

    import anytime.commands.experiment

    studies = tmp_path / "experiments"
    studies.mkdir()
    (studies / "two_panels.py").write_text(
        "from pathlib import Path\n"
        "from anytime.plotting import save_figure\n"
        "from anytime.plotting.layout import panels\n"
        "def main(argv):\n"
        "    out = Path(argv[argv.index('--out') + 1])\n"
        "    out.mkdir()\n"
        "    fig, axes = panels(2, (5.5, 4))\n"
        "    for ax in axes:\n"
        "        ax.plot([0, 1], [0, 1])\n"
        "    save_figure(fig, out / 'figure', formats=('png',))\n"
        "    return 0\n"
    )
    monkeypatch.setattr(anytime.commands.experiment, "experiments_dir", lambda: studies)
    widths = {}
    for size in ("screen", "column"):
        code, _, err = _run(capsys, "experiment", "two-panels", "--out", str(tmp_path / size), "--figure-size", size)
        assert code == 0, err
        widths[size] = Image.open(tmp_path / size / "figure.png").size[0]
    assert widths["screen"] > 1500 and 430 <= widths["column"] <= 580  # 11 in and 3.4 in at 150 dpi
