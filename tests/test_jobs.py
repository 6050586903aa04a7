"""Sweeps of training runs (`anytime jobs`): the sweep file, local and submitit backends, resume, failures."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.train import TrainConfig, Trainer
from anytime.train.jobs import load_sweep, numeric_axis, run_sweep

TINY = 'model = "lenet"\nepochs = 2\nbatch_size = 64\nlimit_train = 256\n'


def _sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def _grid(tmp_path: Path) -> Path:
    return _sweep(tmp_path, f"[base]\n{TINY}\n[grid]\nlr = [0.02, 0.05]\nseed = [0, 1]\n")


def test_a_grid_is_the_product_of_its_lists(tmp_path):
    sweep = load_sweep(_grid(tmp_path), tmp_path / "out")
    assert [job.name for job in sweep.jobs] == ["lr=0.02_seed=0", "lr=0.02_seed=1", "lr=0.05_seed=0", "lr=0.05_seed=1"]
    assert {(job.config["lr"], job.config["seed"]) for job in sweep.jobs} == {
        (0.02, 0),
        (0.02, 1),
        (0.05, 0),
        (0.05, 1),
    }
    assert all(job.config["epochs"] == 2 and job.config["model"] == "lenet" for job in sweep.jobs)
    assert sweep.jobs[0].run_dir == str(tmp_path / "out" / "lr=0.02_seed=0")
    assert numeric_axis([]) is None


def test_a_job_list_and_a_card_as_base(tmp_path):
    text = ('[base]\ncard = "cifar10-resnet20"\nepochs = 3\n\n[[job]]\nname = "short"\nlr = 0.05\n\n'
            '[[job]]\nmodel = "resnet32"\n')  # fmt: skip
    sweep = load_sweep(_sweep(tmp_path, text), tmp_path / "out")
    assert [job.name for job in sweep.jobs] == ["short", "model=resnet32"]
    assert sweep.jobs[0].config["data"] == "cifar10" and sweep.jobs[0].config["epochs"] == 3
    assert sweep.jobs[1].config["model"] == "resnet32" and sweep.jobs[1].card is not None


@pytest.mark.parametrize(
    "text,message",
    [
        ("[base]\nmodel = 'lenet'\n[grid]\n", "[grid] is empty"),
        ("[base]\n[grid]\nlr = 0.1\n", "must be a non-empty list"),
        ("[base]\n[grid]\nlearning_rate = [0.1]\n", "unknown setting(s) learning_rate"),
        ("[base]\nlr = 'fast'\n[grid]\nseed = [0]\n", "lr must be float"),
        ("[base]\n", "either a [grid] table of lists or a [[job]] list, not neither"),
        ("[grid]\nseed = [0]\n[[job]]\nlr = 0.1\n", "not both"),
        ("[sweep]\n[grid]\nseed = [0]\n", "unknown table(s) sweep"),
        ("[[job]]\nname = 'a'\n[[job]]\nname = 'a'\n", "several jobs are named a"),
        ("[[job]]\nname = '../up'\n", "letters, digits"),
        ("[grid]\nseed = [0]\n[slurm]\nqueue = 'gpu'\n", "unknown [slurm] setting queue"),
        ("[grid]\nseed = [0]\n[slurm]\ntime_min = '1h'\n", "time_min must be int"),
        ("[grid\nseed = [0]\n", "not valid TOML"),
        ("[base]\ncard = 'no-such-card'\n[grid]\nseed = [0]\n", "no-such-card"),
    ],
)
def test_bad_sweep_files_are_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(AnytimeError) as info:
        load_sweep(_sweep(tmp_path, text), tmp_path / "out")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_local_sweep_runs_every_job_then_skips_them_all(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["jobs", str(_grid(tmp_path)), "--out", str(out), "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(": done, test") == 4
    with open(out / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["job"] for r in rows] == ["lr=0.02_seed=0", "lr=0.02_seed=1", "lr=0.05_seed=0", "lr=0.05_seed=1"]
    assert all(r["status"] == "done" and 0 <= float(r["test_acc"]) <= 1 for r in rows)
    assert {r["param.lr"] for r in rows} == {"0.02", "0.05"}
    assert (out / "results.png").is_file() and json.loads((out / "results.json").read_text())["workers"] == 2
    weights = {p: p.stat().st_mtime_ns for p in out.glob("*/model.safetensors")}
    assert len(weights) == 4
    assert main(["jobs", str(_grid(tmp_path)), "--out", str(out), "--workers", "2", "--no-plot"]) == 0
    assert capsys.readouterr().out.count(": finished, test") == 4
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/model.safetensors")} == weights


def test_an_interrupted_job_resumes_from_its_checkpoint(tmp_path):
    sweep = load_sweep(_sweep(tmp_path, f"[base]\n{TINY}\n[grid]\nseed = [0]\n"), tmp_path / "out")
    job = sweep.jobs[0]

    def stop(_end):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(TrainConfig.from_dict(dict(job.config)), job.run_dir, on_epoch_end=stop).fit()
    result = run_sweep(sweep, tmp_path / "out")
    assert [o.status for o in result.outcomes] == ["done"]
    config = json.loads((Path(job.run_dir) / "config.json").read_text())
    assert config["resumed"][0]["at_epoch"] == 1 and result.outcomes[0].epochs == 2


def test_a_failed_job_is_reported_with_its_log_and_the_others_finish(tmp_path, capsys):
    text = (f"[base]\n{TINY}\n[[job]]\nname = 'good'\n\n[[job]]\nname = 'bad'\ndata = 'cifar10'\n"
            f"data_root = '{tmp_path / 'nowhere'}'\n")  # fmt: skip
    out = tmp_path / "out"
    assert main(["jobs", str(_sweep(tmp_path, text)), "--out", str(out), "--no-plot"]) == 1
    captured = capsys.readouterr()
    assert "good: done" in captured.out and "bad: failed" in captured.out
    assert "1 of 2 job(s) failed" in captured.err and "Traceback" not in captured.err
    log = out / "logs" / "bad.log"
    assert log.is_file() and "Traceback" in log.read_text()
    rows = {r["job"]: r for r in csv.DictReader(open(out / "results.csv", newline=""))}
    assert rows["bad"]["status"] == "failed" and rows["bad"]["error"] and rows["good"]["status"] == "done"


def test_a_run_folder_of_another_recipe_stops_the_sweep_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    first = load_sweep(_sweep(tmp_path, f"[base]\n{TINY}\n[[job]]\nname = 'a'\n[[job]]\nname = 'b'\n"), out)
    run_sweep(first, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    changed = load_sweep(_sweep(tmp_path, f"[base]\n{TINY}\n[[job]]\nname = 'a'\nlr = 0.3\n"), out)
    with pytest.raises(AnytimeError, match="job a: .* holds a run of another recipe \\(lr differ\\)"):
        run_sweep(changed, out)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_slurm_backend_says_what_is_missing(tmp_path, monkeypatch):
    sweep = load_sweep(_grid(tmp_path), tmp_path / "out")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(AnytimeError, match="no sbatch on this machine"):
        run_sweep(sweep, tmp_path / "out", backend="slurm")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "submitit" else real(name, *a))
    with pytest.raises(AnytimeError, match=r"pip install 'anytime\[slurm\]'"):
        run_sweep(sweep, tmp_path / "out", backend="slurm")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(importlib.util.find_spec("submitit") is None, reason="needs submitit (anytime[slurm])")
def test_the_slurm_path_runs_on_submitits_local_executor(tmp_path):
    text = f"[base]\n{TINY}\nepochs = 1\n[grid]\nseed = [0, 1]\n[slurm]\ntime_min = 10\n"
    sweep = load_sweep(_sweep(tmp_path, text.replace("epochs = 2\n", "")), tmp_path / "out")
    result = run_sweep(sweep, tmp_path / "out", backend="submitit-local", workers=2)
    assert [o.status for o in result.outcomes] == ["done", "done"]
    assert all((Path(o.run_dir) / "summary.json").is_file() for o in result.outcomes)
    assert any((tmp_path / "out" / "submitit").iterdir())


def test_a_sweep_never_writes_among_the_users_files(tmp_path, cli_error):
    sweep = _sweep(tmp_path, f"[base]\n{TINY}\n[grid]\nseed = [0]\n")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my own table\n")
    cli_error(["jobs", str(sweep), "--out", str(out)], "anytime did not write", "results.csv")
    assert (out / "results.csv").read_text() == "my own table\n" and sorted(p.name for p in out.iterdir()) == [
        "results.csv"
    ]
    ours = tmp_path / "ours"
    assert main(["jobs", str(sweep), "--out", str(ours), "--no-plot"]) == 0
    assert main(["jobs", str(sweep), "--out", str(ours), "--no-plot"]) == 0  # its own sweep: resumed, nothing to do
    (ours / "notes.txt").write_text("mine")
    cli_error(["jobs", str(sweep), "--out", str(ours)], "did not write", "notes.txt")
