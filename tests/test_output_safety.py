"""One promise over every command that writes: a user's file at ``--out``, or inside the ``--out`` folder, survives
byte for byte, and nothing is written beside it. Each command is refused (one line, no traceback) before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from anytime.cli import main

MINE = b"the user's own notes\n"
# command -> (argv, with RUN, SRC, SWEEP and OUT standing for paths, and whether --out names a file or a folder)
WRITERS: dict[str, tuple[list[str], str]] = {
    "calibrate": (["calibrate", "RUN", "--max-drop", "1", "--out", "OUT"], "file"),
    "cam": (["cam", "RUN", "--split", "test", "--out", "OUT"], "folder"),
    "cut": (["cut", "PLAIN", "--out", "OUT"], "folder"),
    "demo": (["demo", "--out", "OUT"], "folder"),
    "ensemble": (["ensemble", "--members", "PLAIN,RUN", "--out", "OUT"], "folder"),
    "ensemble-baseline": (
        [
            "ensemble-baseline",
            "--method",
            "voting",
            "--model",
            "lenet",
            "--estimators",
            "2",
            "--epochs",
            "1",
            "--data",
            "digits",
            "--out",
            "OUT",
        ],
        "folder",
    ),  # fmt: skip
    "experiment": (["experiment", "batch-time", "--quick", "--out", "OUT"], "folder"),
    "export": (["export", "RUN", "--format", "onnx", "--out", "OUT"], "folder"),
    "jobs": (["jobs", "SWEEP", "--out", "OUT"], "folder"),
    "ponder": (["ponder", "SACT", "--split", "test", "--out", "OUT"], "folder"),
    "prepare-data": (["prepare-data", "SRC", "--image-size", "8", "--out", "OUT"], "folder"),
    "profile": (["profile", "RUN", "--batch-sizes", "1", "--repeats", "3", "--out", "OUT"], "file"),
    "quantize": (["quantize", "RUN", "--precision", "bf16", "--out", "OUT"], "folder"),
    "report": (["report", "RUN", "--out", "OUT"], "file"),
    "split-run": (
        [
            "split-run",
            "RUN",
            "--server",
            "http://127.0.0.1:9",
            "--device-profile",
            "RUN/profile.json",
            "--server-profile",
            "RUN/profile.json",
            "--bandwidth-mbps",
            "10",
            "--deadline-ms",
            "50",
            "--out",
            "OUT",
        ],
        "file",
    ),  # fmt: skip
    "ticket": (["ticket", "RUN", "--sparsity", "0.5", "--out", "OUT"], "folder"),
    "train": (["train", "--model", "lenet", "--data", "digits", "--epochs", "1", "--out", "OUT"], "folder"),
}
SUFFIX = {"calibrate": ".json", "profile": ".json", "report": ".html", "split-run": ".csv"}


def test_every_command_with_an_out_option_is_covered():
    contract = json.loads((Path(__file__).parent / "cli_contract.json").read_text())["commands"]
    writing = {name for name, doc in contract.items()
               if any("--out" in a["option_strings"] for a in doc.get("arguments", []))}  # fmt: skip
    assert writing == set(WRITERS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    """A plain ResNet-8 and a SACT ResNet-20 on a few hundred digits, one epoch each (a few seconds)."""
    from anytime.train import TrainConfig, Trainer

    folder = tmp_path_factory.mktemp("trained")
    tiny = {"data": "digits", "epochs": 1, "batch_size": 64, "lr": 0.05, "limit_train": 200}
    Trainer(TrainConfig(model="resnet8", **tiny), folder / "plain").fit()
    Trainer(TrainConfig(model="resnet20", sact="0.5,0.99", **tiny), folder / "sact").fit()
    return {"PLAIN": str(folder / "plain"), "SACT": str(folder / "sact")}


@pytest.fixture
def places(exit_run, trained, tmp_path) -> dict[str, str]:
    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    source = tmp_path / "images"
    for split in ("train", "test"):
        for label in ("a", "b"):
            (source / split / label).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8), 40 * i, dtype=np.uint8)).save(source / split / label / f"{i}.png")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[base]\nmodel = "lenet"\ndata = "digits"\nepochs = 1\n[grid]\nlr = [0.05]\n')
    return {"RUN": str(run), "SRC": str(source), "SWEEP": str(sweep), **trained}


def _argv(command: str, places: dict[str, str], out: Path) -> list[str]:
    argv, _ = WRITERS[command]
    replaced = []
    for word in argv:
        for key, value in places.items():
            word = word.replace(key, value)
        replaced.append(str(out) if word == "OUT" else word)
    return replaced


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_users_file_at_or_inside_out_survives_and_nothing_is_written_beside_it(command, places, tmp_path, capsys):
    kind = WRITERS[command][1]
    folder = tmp_path / "mine"
    folder.mkdir()
    if kind == "file":
        out = folder / f"notes{SUFFIX[command]}"
        out.write_bytes(MINE)
        linked = folder / f"link{SUFFIX[command]}"
        linked.symlink_to(out)
        targets = [out, linked]
    else:
        (folder / "notes.txt").write_bytes(MINE)
        targets = [folder]
    for target in targets:
        before = sorted(p.name for p in folder.iterdir())
        code = main(_argv(command, places, target))
        err = capsys.readouterr().err
        assert code != 0, f"{command} wrote into {target}"
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "did not write" in lines[0] or "never overwrites" in lines[0], lines[0]  # refused for --out, first
        assert sorted(p.name for p in folder.iterdir()) == before
        assert (out if kind == "file" else folder / "notes.txt").read_bytes() == MINE
        assert kind == "folder" or linked.is_symlink()
