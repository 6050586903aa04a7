"""The framework's promises to its user: no file of theirs touched, impossible requests refused before any
work, nothing half-written or left behind, errors for humans, plots that say what they leave out, no
machine-wide side effects unless asked, and runs that can be trained longer."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from anytime.cli import _run_command, main
from anytime.errors import AnytimeError
from anytime.utils import outputs, resources, tempnames
from anytime.utils.outputs import MARKER, DirState, check_output_dir, output_lock, staged_dir
from anytime.utils.tempnames import remove_stale

ANYTIME = [sys.executable, "-m", "anytime"]


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes: what must stay exactly as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if tempnames.is_temporary(p.name))


def _train(run: Path, *extra: str) -> list[str]:
    return ["train", "--model", "lenet", "--data", "digits", "--batch-size", "64", "--no-progress", "--out", str(run),
            *extra]  # fmt: skip


@pytest.fixture
def ok(capsys):
    """``ok(argv)``: run ``anytime ARGV``, which must succeed; its output is returned and not left to later checks."""

    def run(argv: list[str]) -> str:
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out

    return run


@pytest.fixture
def copied_run(exit_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    return run


# ---- 1. output locations: the deletion and move cases first -------------------------------------------------


def test_a_study_never_deletes_a_folder_holding_a_users_file(tmp_path, cli_error):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    before = _tree(tmp_path)
    cli_error(["experiment", "batch-time", "--quick", "--out", str(out)], str(out), "notes.txt")
    cli_error(["experiment", "batch-time", "--quick", "--out", str(out), "--overwrite"], str(out), "notes.txt")
    assert _tree(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_study_never_moves_a_users_file_aside(tmp_path, cli_error):
    target = tmp_path / "results.txt"
    target.write_text("my results")
    cli_error(["experiment", "batch-time", "--quick", "--out", str(target)], str(target), "is a file, not a folder")
    assert target.read_text() == "my results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def test_train_never_writes_among_a_users_files(tmp_path, cli_error):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "data.csv").write_text("1,2,3")
    cli_error(_train(out, "--epochs", "1"), str(out), "data.csv")
    cli_error(_train(out, "--epochs", "1", "--overwrite"), str(out), "data.csv")
    assert sorted(p.name for p in out.iterdir()) == ["data.csv"]


def test_train_out_a_file_says_not_a_folder(tmp_path, cli_error):
    target = tmp_path / "run"
    target.write_text("x")
    cli_error(_train(target, "--epochs", "1"), str(target), "is a file, not a folder")
    cli_error(_train(target, "--epochs", "2", "--resume"), str(target), "no run to resume")
    assert target.read_text() == "x"


def test_a_run_is_replaced_only_with_overwrite_and_only_while_it_holds_nothing_else(ok, tmp_path, capsys, cli_error):
    run = tmp_path / "run"
    ok(_train(run, "--epochs", "1"))
    assert json.loads((run / MARKER).read_text())["kind"] == "run"
    cli_error(_train(run, "--epochs", "1"), str(run), "--resume", "--extend", "--overwrite")
    ok(_train(run, "--epochs", "1", "--seed", "3", "--overwrite"))
    assert json.loads((run / "config.json").read_text())["train"]["seed"] == 3
    (run / "my-analysis.ipynb").write_text("{}")
    cli_error(_train(run, "--epochs", "1", "--overwrite"), str(run), "my-analysis.ipynb")
    assert (run / "my-analysis.ipynb").read_text() == "{}" and (run / "model.safetensors").is_file()
    capsys.readouterr()


def test_an_empty_folder_of_the_user_is_filled_and_kept(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    inode = target.stat().st_ino
    with staged_dir(target, "study") as work:
        (work / "a.csv").write_text("a")
    assert target.stat().st_ino == inode and (target / "a.csv").read_text() == "a"
    assert check_output_dir(target, "study") is DirState.OURS
    with pytest.raises(AnytimeError, match="pass --overwrite"), staged_dir(target, "study"):
        pass
    with pytest.raises(AnytimeError, match="holds a study, not a demo"), staged_dir(target, "demo", overwrite=True):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_missing_parent_is_refused_unless_it_is_the_default(tmp_path, monkeypatch, cli_error):
    cli_error(
        _train(tmp_path / "no" / "such" / "run", "--epochs", "1"), str(tmp_path / "no" / "such"), "does not exist"
    )
    assert not (tmp_path / "no").exists()
    monkeypatch.chdir(tmp_path)
    assert check_output_dir(Path("runs") / "x", "run", create_parents=True) is DirState.NEW


def test_a_read_only_folder_is_refused_before_any_work(copied_run, monkeypatch, cli_error):
    import anytime.tasks.collect

    def unwritable(*args, dir=None, **kwargs):  # noqa: A002  what a read-only folder answers a non-root user
        raise PermissionError(13, "Permission denied")

    def never(*args, **kwargs):
        raise AssertionError("computed before checking the output")

    monkeypatch.setattr(anytime.tasks.collect, "collect", never)
    monkeypatch.setattr(outputs.tempfile, "mkstemp", unwritable)
    cli_error(["collect", str(copied_run)], "cannot write in", str(copied_run), "Permission denied")
    assert not any(".tmp" in line for line in [str(p) for p in copied_run.rglob("*")])


def test_profile_out_a_folder_is_refused_before_measuring(copied_run, tmp_path, monkeypatch, cli_error):
    import anytime.profile

    def never(*args, **kwargs):
        raise AssertionError("measured before checking the output")

    monkeypatch.setattr(anytime.profile, "profile_model", never)
    cli_error(["profile", str(copied_run), "--out", str(tmp_path)], str(tmp_path), "is a folder")
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": true}')
    cli_error(["profile", str(copied_run), "--out", str(mine)], str(mine), "not an anytime profile")
    assert mine.read_text() == '{"mine": true}'


def test_calibrate_never_overwrites_a_users_file(ok, copied_run, tmp_path, cli_error):
    ok(["collect", str(copied_run)])
    mine = tmp_path / "thresholds.json"
    mine.write_text("[0.1, 0.2]")
    cli_error(
        ["calibrate", str(copied_run), "--max-drop", "1", "--out", str(mine)], str(mine), "not an anytime calibration"
    )
    assert mine.read_text() == "[0.1, 0.2]"
    ours = tmp_path / "cal.json"
    ok(["calibrate", str(copied_run), "--max-drop", "1", "--out", str(ours)])
    ok(["calibrate", str(copied_run), "--max-drop", "2", "--out", str(ours)])  # its own kind: replaced
    assert json.loads(ours.read_text())["target"]["max_drop_points"] == 2


# ---- 2. resources checked before allocation ------------------------------------------------------------------


def test_an_impossible_batch_size_is_refused_before_profiling(copied_run, cli_error):
    cli_error(["profile", str(copied_run), "--batch-sizes", "1,100000000"], "needs about", "available", "--batch-sizes")


def test_an_absurd_image_size_is_refused_before_allocating(cli_error):
    cli_error(["exits", "resnet20", "--image-size", "100000"], "needs about", "--image-size")


def test_an_image_folder_at_an_absurd_size_is_refused_before_decoding(tmp_path, cli_error):
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("a", "b"):
            folder = tmp_path / "images" / split / cls
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(folder / f"{i}.png")
    run = tmp_path / "run"
    cli_error(_train(run, "--data", "folder", "--data-root", str(tmp_path / "images"), "--image-size", "100000"),
              "12 folder images at 100000x100000", "needs about", "--image-size")  # fmt: skip
    assert not run.exists()


def test_a_training_batch_that_cannot_fit_leaves_no_run_behind(tmp_path, monkeypatch, cli_error):
    monkeypatch.setattr(resources, "available_memory", lambda: 2 * 2**20)
    run = tmp_path / "run"
    cli_error(_train(run, "--epochs", "1"), "training lenet on batches of 64", "needs about", "2.0 MB are available")
    assert not run.exists() and _leftovers(tmp_path) == []


def test_too_little_disk_for_the_checkpoints_is_refused_before_training(tmp_path, monkeypatch, cli_error):
    monkeypatch.setattr(resources, "free_space", lambda path: 1000)
    cli_error(_train(tmp_path / "run", "--epochs", "1"), "checkpoints of lenet", "1000 B are free")
    assert not (tmp_path / "run").exists()


def test_a_disk_that_fills_during_training_keeps_the_last_epoch(ok, tmp_path, monkeypatch, capsys):
    import anytime.train.checkpoint as checkpoint

    real_save = checkpoint.torch.save
    calls = []

    def save(obj, path):
        calls.append(path)
        if len(calls) == 2:  # what torch.save raises when the disk is full
            Path(path).write_bytes(b"partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/3: file write failed"
            )
        real_save(obj, path)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    monkeypatch.setattr(resources, "free_space", lambda path: 4096 if len(calls) >= 2 else 1 << 40)
    run = tmp_path / "run"
    assert main(_train(run, "--epochs", "3")) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the line that announced the training
    assert "Traceback" not in err and last.startswith("anytime train: error: "), err
    for words in (f"no space left to write {run / 'checkpoint.pt'}", "4.0 KB free", "--resume"):
        assert words in last, last
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    assert "accuracy" in ok(_train(run, "--epochs", "3", "--resume"))
    assert json.loads((run / "summary.json").read_text())["epochs"] == 3


# ---- 3. cleaning up after ourselves --------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_files_of_dead_processes_are_removed(ok, copied_run):
    folder = copied_run / "outputs"
    folder.mkdir()
    host, dead = tempnames.host_tag(), _dead_pid()
    stale_file = folder / f".val.npz.{host}.{dead}.abc123.tmp"
    stale_dir = folder / f".study.{host}.{dead}.x_y.partial"
    live = folder / f".test.npz.{host}.{os.getpid()}.abc123.tmp"
    other_host = folder / f".val.npz.elsewhere.{dead}.abc123.tmp"
    users = folder / ".my.tmp"
    stale_file.write_bytes(b"half")
    stale_dir.mkdir()
    for path in (live, other_host, users):
        path.write_bytes(b"keep")
    ok(["collect", str(copied_run)])
    assert not stale_file.exists() and not stale_dir.exists()
    assert live.exists() and other_host.exists() and users.exists()


def test_a_terminated_training_leaves_no_temporary_file(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([*ANYTIME, *_train(run, "--epochs", "200")], stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "training lenet on digits ..." once the run folder is claimed
    assert "training lenet" in line, line
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, rest
    assert "Traceback" not in rest and "nothing partial was kept" in rest
    assert _leftovers(tmp_path) == []
    if run.exists():  # stopped after the first checkpoint: a run that resumes
        assert (run / "checkpoint.pt").is_file()


def test_a_forked_worker_ends_quietly_on_sigterm():
    script = ("import multiprocessing, time\n"
              "from anytime.cli import _TerminationGuard\n"
              "_TerminationGuard()\n"
              "worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))\n"
              "worker.start(); time.sleep(0.5); worker.terminate(); worker.join()\n"
              "print(worker.exitcode)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(-signal.SIGTERM) and done.stderr == "", done.stderr


def _command_that(run):
    """A stand-in for a command module whose ``run`` is ``run``."""
    return lambda _name: type("Command", (), {"run": staticmethod(run)})


def test_a_signal_while_a_failure_is_reported_keeps_the_failure(monkeypatch, capsys):
    def fail(_args):
        raise AnytimeError("the data folder is empty")

    def report_while_stopped(command, message, where=""):  # the launcher stops the process mid-report
        os.kill(os.getpid(), signal.SIGTERM)
        print(f"anytime {command}: error: {message}{where}", file=sys.stderr)

    monkeypatch.setattr("anytime.cli._module", _command_that(fail))
    monkeypatch.setattr("anytime.cli.print_error", report_while_stopped)
    previous = signal.getsignal(signal.SIGTERM)
    assert _run_command(argparse.Namespace(command="train")) == 2
    err = capsys.readouterr().err
    assert "the data folder is empty" in err and "stopped by signal" not in err
    assert signal.getsignal(signal.SIGTERM) is previous


def test_only_the_first_signal_interrupts_and_the_second_does_not_cut_the_cleanup(monkeypatch, capsys):
    cleaned = []

    def run(_args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never reached in full: the signal unwinds it
        finally:
            os.kill(os.getpid(), signal.SIGHUP)  # a second signal during the clean-up
            cleaned.append(True)
        return 0

    monkeypatch.setattr("anytime.cli._module", _command_that(run))
    assert _run_command(argparse.Namespace(command="train")) == 128 + signal.SIGTERM
    assert cleaned == [True]
    assert "stopped by signal 15; nothing partial was kept" in capsys.readouterr().err


def test_a_second_writer_of_the_same_result_is_refused(ok, copied_run, cli_error):
    ok(["collect", str(copied_run)])
    target = copied_run / "calibration.json"
    with output_lock(target, command="anytime calibrate (another)"):
        cli_error(
            ["calibrate", str(copied_run), "--max-drop", "1"], "another anytime process", str(os.getpid()), str(target)
        )
    assert not target.exists()
    ok(["calibrate", str(copied_run), "--max-drop", "1"])
    assert _leftovers(copied_run) == []


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    target = tmp_path / "result.json"
    (tmp_path / f".result.json{tempnames.LOCK_SUFFIX}").write_text('{"pid": 1, "host": "x"}')  # nobody holds it
    with output_lock(target):
        pass
    assert remove_stale(tmp_path) == [] and list(tmp_path.iterdir()) == []


# ---- 4. error text for humans ----------------------------------------------------------------------------------


def test_a_closed_pipe_exits_quietly():
    proc = subprocess.Popen([*ANYTIME, "models", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0` would be
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 128 + signal.SIGPIPE)
    assert err == "", err


def test_a_checkpoint_with_code_is_refused_with_safe_advice(tmp_path, cli_error):
    import torch

    witness = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format": "anytime-checkpoint-v1", "config": Payload()}, run / "checkpoint.pt")
    for argv in (
        _train(run, "--epochs", "2", "--resume"),
        _train(tmp_path / "new", "--epochs", "1", "--init", str(run / "checkpoint.pt")),
    ):
        cli_error(
            argv, "holds code", "posix.system", "do not load it with weights_only=False unless you trust its source"
        )
    assert not witness.exists()
    (run / "checkpoint.pt").write_bytes(pickle.dumps(Payload(), protocol=4))  # not torch.save's protocol 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the refusal is the one thing said: no torch warning before it
        cli_error(_train(run, "--epochs", "2", "--resume"), "holds code")
    assert not witness.exists()


def test_write_errors_name_the_users_path_never_a_temporary_one(tmp_path, monkeypatch):
    from anytime.utils.io import write_json

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", args[0] if args else "x")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(AnytimeError) as info:
        write_json(tmp_path / "r.json", {})
    assert str(tmp_path / "r.json") in str(info.value) and ".tmp" not in str(info.value)
    assert tempnames.user_path(tmp_path / f".r.json.{tempnames.host_tag()}.12.abc.tmp") == str(tmp_path / "r.json")


# ---- 5. plots never drop content silently ----------------------------------------------------------------------


def test_plot_says_why_deadline_plots_are_missing(ok, copied_run, tmp_path, capsys, cli_error):
    from anytime.tasks.profiling import ProfileSettings, profile_run

    ok(["collect", str(copied_run)])
    profile_run(copied_run, ProfileSettings(batch_sizes=(1,), repeats=20, warmup=1, memory=False))
    (copied_run / "profile-cpu-copy.json").write_bytes(next(copied_run.glob("profile-*.json")).read_bytes())
    out = ok(["plot", str(copied_run)])
    assert "not drawn: deadline plots:" in out and "several profiles" in out and "--profile" in out
    assert (copied_run / "plots" / "pareto.png").is_file() and not (copied_run / "plots" / "latency.png").exists()
    (copied_run / "plots" / "latency.png").write_bytes(b"an earlier figure")
    ok(["plot", str(copied_run)])
    assert not (copied_run / "plots" / "latency.png").exists(), "a stale figure of a section not drawn was left"

    shutil.rmtree(copied_run / "plots")
    bad = tmp_path / "other.json"
    bad.write_text(
        json.dumps({**json.loads((copied_run / "profile-cpu-copy.json").read_text()), "model_fingerprint": "0" * 16})
    )
    cli_error(["plot", str(copied_run), "--profile", str(bad)], str(bad))
    assert not (copied_run / "plots").exists(), "no part of the figure set may be written before failing"
    assert _leftovers(copied_run) == []


# ---- 6. no machine-wide side effects unless asked --------------------------------------------------------------


def test_the_page_cache_is_dropped_only_when_asked(monkeypatch):
    import argparse

    from anytime.utils import results

    calls = []
    monkeypatch.setattr(results, "drop_page_cache", lambda: calls.append(1) or (True, "page cache dropped"))
    assert "not dropped" in results.page_cache_note(argparse.Namespace(drop_caches=False)) and calls == []
    assert results.page_cache_note(argparse.Namespace(drop_caches=True)) == "page cache dropped" and calls == [1]


# ---- 7. training a run longer ----------------------------------------------------------------------------------


def test_extend_trains_longer_with_the_schedule_of_the_new_length(ok, tmp_path, capsys, cli_error):
    from anytime.train import TrainConfig
    from anytime.train.recipe import lr_factor

    run = tmp_path / "run"
    ok(_train(run, "--epochs", "2", "--lr", "0.05"))
    cli_error(_train(run, "--epochs", "4", "--resume"), "epochs=4", "--extend --epochs N")
    cli_error(_train(run, "--epochs", "2", "--extend"), "more than its 2")
    cli_error(_train(run, "--extend"), "--epochs N")
    ok(_train(run, "--epochs", "4", "--extend"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 4 and summary["extended"][0]["from_epochs"] == 2
    assert summary["extended"][0]["to_epochs"] == 4 and summary["extended"][0]["at_epoch"] == 2
    assert json.loads((run / "config.json").read_text())["extended"] == summary["extended"]
    rows = [json.loads(json.dumps(r)) for r in __import__("csv").DictReader(open(run / "metrics.csv"))]
    longer = TrainConfig(model="lenet", data="digits", epochs=4, lr=0.05)
    assert [float(r["lr"]) for r in rows[2:]] == pytest.approx([0.05 * lr_factor(longer, e) for e in (2, 3)], rel=1e-5)
    capsys.readouterr()


def test_extend_records_itself_in_the_card(ok, tmp_path, capsys):
    card = tmp_path / "card.toml"
    card.write_text('[card]\nname = "tiny"\n[model]\nname = "lenet"\n[data]\nname = "digits"\n'
                    "[train]\nepochs = 1\nbatch_size = 64\n[results]\n")  # fmt: skip
    run = tmp_path / "run"
    ok(["train", "--card", str(card), "--out", str(run), "--no-progress", "--update-card"])
    assert main(["train", "--card", str(card), "--out", str(run), "--no-progress", "--update-card", "--extend",
                 "--epochs", "2"]) == 0  # fmt: skip
    text = card.read_text()
    assert "epochs = 2" in text.split("[results]")[1] and "extended_from = 1" in text
    capsys.readouterr()


# ---- cases found by an adversarial pass -----------------------------------------------------------------------


def test_overwrite_refuses_init_weights_inside_the_run_it_would_clear(ok, tmp_path, cli_error):
    run = tmp_path / "run"
    ok(_train(run, "--epochs", "1"))
    before = _tree(run)
    cli_error(_train(run, "--epochs", "1", "--init", str(run), "--overwrite"), "--overwrite would clear")
    assert _tree(run) == before


def test_overwrite_refuses_user_files_inside_anytimes_sub_folders(ok, copied_run, tmp_path, cli_error):
    (copied_run / "outputs").mkdir()
    (copied_run / "outputs" / "mynotes.txt").write_text("mine")
    cli_error(_train(copied_run, "--epochs", "1", "--overwrite"), "outputs/mynotes.txt")
    assert (copied_run / "outputs" / "mynotes.txt").read_text() == "mine"
    study = tmp_path / "study"
    with staged_dir(study, "study") as work:
        (work / "runs").mkdir()
        (work / "runs" / "a.csv").write_text("a")
    (study / "runs" / "b.txt").write_text("mine")
    with pytest.raises(AnytimeError, match="runs/b.txt"), staged_dir(study, "study", overwrite=True):
        pass
    assert (study / "runs" / "b.txt").read_text() == "mine"


def test_a_run_killed_before_its_first_epoch_can_be_trained_again(ok, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    outputs.write_marker(run, "run", outputs.RUN_ENTRIES)
    (run / "config.json").write_text("{}")  # what a kill -9 in the first epoch leaves
    ok(_train(run, "--epochs", "1"))
    assert (run / "model.safetensors").is_file()


def test_pipes_symlinks_and_dangling_links_as_output_files(ok, copied_run, tmp_path, cli_error):
    ok(["collect", str(copied_run)])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cli_error(["calibrate", str(copied_run), "--max-drop", "1", "--out", str(fifo)], "not a regular file")
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "x.json")
    cli_error(["calibrate", str(copied_run), "--max-drop", "1", "--out", str(dangling)], "symbolic link to nothing")
    real, link = tmp_path / "cal.json", tmp_path / "link.json"
    ok(["calibrate", str(copied_run), "--max-drop", "1", "--out", str(real)])
    link.symlink_to(real)
    ok(["calibrate", str(copied_run), "--max-drop", "2", "--out", str(link)])
    assert link.is_symlink() and json.loads(real.read_text())["target"]["max_drop_points"] == 2


def test_any_failure_of_a_writer_is_one_line_naming_the_users_path(tmp_path, monkeypatch):
    import anytime.train.checkpoint as checkpoint

    def odd(obj, path):  # what torch.save said on a full tmpfs
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", odd)
    monkeypatch.setattr(resources, "free_space", lambda path: 0)
    with pytest.raises(AnytimeError, match=f"no space left to write {tmp_path / 'study' / 'c.pt'}"):
        with staged_dir(tmp_path / "study", "study") as work:
            checkpoint.save_checkpoint(work / "c.pt", {"epoch": 0})
    assert list(tmp_path.iterdir()) == []


def test_demo_checks_its_folder_before_announcing_the_training(tmp_path, cli_error):
    (tmp_path / "mine.txt").write_text("x")
    cli_error(["demo", "--out", str(tmp_path)], "mine.txt")


def test_absurd_worker_counts_are_refused(tmp_path, cli_error):
    cli_error(_train(tmp_path / "run", "--epochs", "1", "--workers", "100000"), "workers must be 0..64")
    assert not (tmp_path / "run").exists()


def test_update_card_writes_through_a_link(ok, tmp_path):
    card = tmp_path / "my.toml"
    card.write_text('[card]\nname = "tiny"\n[model]\nname = "lenet"\n[data]\nname = "digits"\n'
                    "[train]\nepochs = 1\nbatch_size = 64\n[results]\n")  # fmt: skip
    link = tmp_path / "link.toml"
    link.symlink_to(card)
    ok(["train", "--card", str(link), "--out", str(tmp_path / "run"), "--no-progress", "--update-card"])
    assert link.is_symlink() and "test_acc" in card.read_text()


def test_a_run_stopped_before_its_first_epoch_is_told_to_train_again_not_to_resume(exit_run, tmp_path, cli_error):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", ".anytime.json"):
        shutil.copy(exit_run / name, run / name)
    cli_error(["collect", str(run)], "before its first epoch ended", f"anytime train --out {run}")
    shutil.copy(exit_run / "checkpoint.pt", run / "checkpoint.pt")
    cli_error(["collect", str(run)], "has not finished", "--resume")
