"""Data-parallel training: the shares of each batch, the launcher, and 2 gloo processes against 1 process."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anytime.commands.train import without_option as _without_option
from anytime.data import Augment, Delivery, load_dataset, make_loader
from anytime.data.augment import random_crop_flip
from anytime.data.loader import share
from anytime.errors import AnytimeError
from anytime.train.distributed import from_environment
from anytime.train.launch import first_failure, free_port, launch_local, rank_environment
from anytime.train.trainer import _peer_error

# 2 gloo processes and 1 process at the same global batch, LeNet (no batch norm): the same sums in another order.
# One thread per process picks other kernels than two threads in one: after 2 epochs the weights part by 1e-7 on a
# Xeon and 2e-5 on an AMD EPYC. A wrong reduction (gradients summed, or a share weighed twice) doubles steps of
# lr 0.05 and parts them by orders of magnitude more.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4
# With --sync-bn (batch norm over the global batch), the same up to float rounding, which a few steps amplify: on a
# 2-core AVX2 EPYC (multi-exit ResNet-8) the first epoch's loss was 4e-6 apart (own rows' statistics: 2.1e-4) and the
# second 7e-5 apart (own rows: 6.5e-4), so the first epoch tells synced statistics from per-process ones and the
# second only bounds drift (a ResNet-20 drifted further: 3e-5 and 1.2e-3)
BN_FIRST_EPOCH_RTOL = 5e-5
BN_LOSS_RTOL = 5e-3
# By default each process normalises by its own rows' statistics: the curves part, but not by much
OWN_ROWS_LOSS_RTOL = 0.05


def _train(out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "anytime", "train", "--epochs", "2", "--batch-size", "64", "--lr", "0.05",
            "--out", str(out), "--no-progress", *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _losses(run: Path) -> list[float]:
    with open(run / "metrics.csv", newline="") as handle:
        return [float(row["train_loss"]) for row in csv.DictReader(handle)]


def _max_weight_difference(a: Path, b: Path) -> float:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys()
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


@pytest.mark.parametrize("count,world", [(64, 2), (65, 2), (7, 3), (1, 2)])
def test_shares_are_contiguous_and_cover_every_row(count, world):
    pieces = [share(count, (rank, world)) for rank in range(world)]
    assert pieces[0][0] == 0 and pieces[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert max(b - a for a, b in pieces) - min(b - a for a, b in pieces) <= 1


def test_augmenting_a_share_equals_that_share_of_the_augmented_batch():
    images = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    whole = random_crop_flip(images, padding=2, hflip=True, generator=torch.Generator().manual_seed(5))
    part = random_crop_flip(images[4:7], padding=2, hflip=True, generator=torch.Generator().manual_seed(5),
                            within=(4, 10))  # fmt: skip
    assert torch.equal(part, whole[4:7])
    with pytest.raises(ValueError, match="not within"):
        random_crop_flip(images[4:7], padding=2, hflip=True, generator=torch.Generator(), within=(8, 10))


@pytest.mark.parametrize("world", [2, 3])
def test_the_processes_shares_make_up_the_single_process_batches(world):
    splits = load_dataset("digits", seed=0)
    kw = {"batch_size": 100, "seed": 3, "augment": Augment("crop+flip", 2)}
    alone = make_loader(splits.train, splits.info, train=True, **kw)
    shared = [make_loader(splits.train, splits.info, train=True, delivery=Delivery(part=(r, world)), **kw)
              for r in range(world)]  # fmt: skip
    for loader in (alone, *shared):
        loader.set_epoch(4)
    assert all(len(loader) == len(alone) for loader in shared)
    for index, (batch, *parts) in enumerate(zip(alone, *shared)):
        assert torch.equal(batch[0], torch.cat([p[0] for p in parts]))
        assert torch.equal(batch[1], torch.cat([p[1] for p in parts]))
        assert sum(p[1].numel() for p in parts) == shared[0].batch_total(index)


def test_evaluation_splits_are_shared_out_whole():
    splits = load_dataset("digits", seed=0)
    alone = make_loader(splits.val, splits.info, batch_size=32, train=False)
    pieces = [make_loader(splits.val, splits.info, batch_size=32, train=False, delivery=Delivery(part=(r, 2)))
              for r in range(2)]  # fmt: skip
    labels = torch.cat([labels for piece in pieces for _, labels in piece])
    assert torch.equal(labels, torch.cat([labels for _, labels in alone]))


def test_a_last_batch_smaller_than_the_processes_is_dropped():
    splits = load_dataset("digits", seed=0)
    n = len(splits.train)
    batch = n - 1  # two batches: the second holds one image
    one = make_loader(splits.train, splits.info, batch_size=batch, train=True, delivery=Delivery(part=(0, 2)))
    assert len(one) == 1
    assert len(make_loader(splits.train, splits.info, batch_size=batch, train=True)) == 2


def test_environment_of_torchrun_is_read():
    assert from_environment({}) is None
    assert from_environment({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) is None
    ctx = from_environment({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert ctx is not None and ctx.part == (3, 4) and not ctx.main and ctx.local_rank == 1
    with pytest.raises(AnytimeError, match="not within WORLD_SIZE"):
        from_environment({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})
    with pytest.raises(AnytimeError, match="whole numbers"):
        from_environment({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"})
    env = rank_environment(1, 2, 29999, threads=1, base={})
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("1", "2", "29999", "1")
    assert rank_environment(0, 2, 1, threads=1, base={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_nproc_is_taken_out_of_the_command_the_processes_run():
    argv = ["train", "--nproc", "2", "--epochs", "1", "--nproc=3", "--out", "x"]
    assert _without_option(argv, "--nproc") == ["train", "--epochs", "1", "--out", "x"]


def test_the_launching_process_starts_the_others_without_importing_torch(tmp_path):
    # it only waits for them: torch's import (about 2.4 s on two cores) would delay every rank's start
    argv = ["train", "--nproc", "2", "--epochs", "1", "--out", str(tmp_path / "run")]
    code = ("import sys, anytime.cli as cli, anytime.commands.train as train\n"
            "train.launch_train = lambda args: print('torch' in sys.modules) or 0\n"
            f"sys.exit(cli.main({argv!r}))\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    # process 1 exits with an error at once; process 0 would sleep for 10 minutes, then leave a mark
    script = tmp_path / "job.py"
    mark = tmp_path / "process-0-finished"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      f"time.sleep(600)\nopen({str(mark)!r}, 'w').close()\n")  # fmt: skip
    result = launch_local(["--version"], 1)
    assert result.returncode == 0 and result.failed_rank is None
    result = launch_local([], 2, grace_s=5, program=[sys.executable, str(script)])
    assert result.failed_rank == 1 and result.returncode == 3 and not result.signalled
    assert not mark.exists()  # process 0 was stopped, not waited for


def test_the_launcher_blames_a_killed_process_before_the_peers_that_lost_it():
    # process 1 killed, process 0 out with an error on noticing, both seen in one look: process 1 is the cause
    assert first_failure([2, -9]) == 1 and first_failure([-15, -9]) == 0
    assert first_failure([3, None]) == 0 and first_failure([None, 3]) == 1 and first_failure([2, 2]) == 0
    assert first_failure([0, None]) is None and first_failure([0, 0]) is None


def test_two_gloo_processes_follow_one_process_at_the_same_global_batch(tmp_path):
    _train(tmp_path / "one")
    two = _train(tmp_path / "two", "--nproc", "2")
    assert "error" not in two.stderr
    one_losses, two_losses = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two_losses == pytest.approx(one_losses, rel=LOSS_RTOL)
    assert _max_weight_difference(tmp_path / "one", tmp_path / "two") < WEIGHT_ATOL
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["torch_threads"] == 1  # the 2 cores shared out
    assert json.loads((tmp_path / "two" / "config.json").read_text())["processes"] == 2


def test_multi_exit_network_with_batch_norm_trains_on_two_processes(tmp_path):
    extra = ("--model", "resnet8", "--exits", "auto", "--limit-train", "256", "--lr", "0.02")
    _train(tmp_path / "one", *extra)
    _train(tmp_path / "two", *extra, "--nproc", "2", "--sync-bn")
    _train(tmp_path / "own", *extra, "--nproc", "2")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two[0] == pytest.approx(one[0], rel=BN_FIRST_EPOCH_RTOL)
    assert two == pytest.approx(one, rel=BN_LOSS_RTOL)
    assert _losses(tmp_path / "own") == pytest.approx(_losses(tmp_path / "one"), rel=OWN_ROWS_LOSS_RTOL)
    exits = json.loads((tmp_path / "two" / "summary.json").read_text())["exits"]
    assert len(exits) == 3 and all(0 <= e["test_acc"] <= 1 for e in exits)
    assert json.loads((tmp_path / "own" / "config.json").read_text())["sync_bn"] is False


GRADIENT_CHECK = """
import copy, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from anytime.backbones import create_model
from anytime.train.distributed import end_process, sync_batch_norms
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = create_model("resnet20", num_classes=10, in_channels=1).double()
alone = copy.deepcopy(model)
sync_batch_norms(model)
x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2))
rows = slice(8 * rank, 8 * rank + 8)
net = DistributedDataParallel(model)  # kept: its hooks average the gradients in backward
torch.nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
torch.nn.functional.cross_entropy(alone(x), y).backward()
gap = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), alone.parameters()))
stats = max(float((a - b).abs().max()) for a, b in zip(model.buffers(), alone.buffers()) if a.is_floating_point())
dist.barrier()
dist.destroy_process_group()
end_process(0 if gap < 1e-12 and stats < 1e-12 else 1)
"""


def test_two_processes_with_synced_batch_norm_compute_the_whole_batchs_gradient(tmp_path):
    # in float64, so that what is left is the arithmetic, not float32's rounding
    script = tmp_path / "check.py"
    script.write_text(GRADIENT_CHECK)
    result = launch_local([], 2, program=[sys.executable, str(script)], threads=1)
    assert result.returncode == 0 and result.failed_rank is None


ENDS_ITSELF = """
import atexit, sys
from anytime.cli import main
from anytime.train.distributed import Distributed
atexit.register(lambda: print("teardown ran"))
Distributed(rank=0, world_size=1, local_rank=0).start(__import__("torch").device("cpu"))
status = main(["train", "--out", sys.argv[1], "--resume"])
print("main returned", status)
"""


def test_a_process_that_joined_a_group_ends_itself_with_the_status_skipping_teardown(tmp_path):
    # gloo's threads abort the interpreter's teardown now and then (4 exits in 40 here without a barrier): a
    # process that has been in a group leaves without it, with the status its command ended with
    script = tmp_path / "worker.py"
    script.write_text(ENDS_ITSELF)
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **group})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "anytime train: error" in done.stderr and "no run to resume" in done.stderr
    assert "main returned" not in done.stdout and "teardown ran" not in done.stdout


def test_synced_batch_norm_is_batch_norm_on_one_process(tmp_path):
    import torch.distributed as dist
    from torch import nn

    from anytime.train.distributed import SyncedBatchNorm2d, sync_batch_norms

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        synced = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        synced.load_state_dict(plain.state_dict())
        assert sync_batch_norms(synced) == 1 and isinstance(synced[1], SyncedBatchNorm2d)
        x = torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(0)) * 3 + 1
        for module in (plain, synced):
            module(x).square().mean().backward()
        assert torch.allclose(synced(x), plain(x), atol=1e-5)  # a second step: running statistics moved alike
        for name, buffer in plain.state_dict().items():
            assert torch.allclose(synced.state_dict()[name].float(), buffer.float(), atol=1e-5), name
        for a, b in zip(plain.parameters(), synced.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-5)
        plain.eval(), synced.eval()
        assert torch.allclose(synced(x), plain(x), atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_sandwich_slices_and_stochastic_depth_train_on_two_processes(tmp_path):
    # 4 slices: the sandwich rule trains 3 of them per batch, the same 3 in every process
    done = _train(tmp_path / "sliced", "--model", "resnet20", "--slices", "0.25,0.5,0.75,1.0", "--sandwich",
                  "--stochastic-depth", "0.2", "--limit-train", "256", "--epochs", "1", "--nproc", "2", "--sync-bn",
                  "--json")  # fmt: skip
    summary = json.loads(done.stdout)
    assert summary["processes"] == 2 and len(summary["exits"]) == 4


def test_refusal_is_said_once_and_nothing_is_touched(exit_run, tmp_path):
    shutil.copytree(exit_run, tmp_path / "run")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()}
    done = _train(tmp_path / "run", "--nproc", "2", check=False)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already holds a run" in lines[0], done.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()} == before


def _rank_pid(parent: int, rank: int) -> int | None:
    """The process of ``rank`` among ``parent``'s children (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the processes through /proc")
def test_a_killed_process_stops_the_run_and_resume_ends_where_an_unbroken_run_does(tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "anytime", "train", "--epochs", "8", "--batch-size", "64", "--lr", "0.05",
            "--out", str(run), "--no-progress", "--nproc", "2"]  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoint.pt").is_file() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = _rank_pid(launcher.pid, 1)
    assert victim is not None and launcher.poll() is None, "the run ended before a process could be stopped"
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "Traceback" not in err and "process 1 of 2 was killed" in err, err
    assert 1 <= len(_losses(run)) < 8
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, check=False, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    _train(tmp_path / "unbroken", "--epochs", "8", "--nproc", "2")
    assert _max_weight_difference(run, tmp_path / "unbroken") == 0.0


def test_a_lost_peer_is_told_in_its_first_sentence_without_the_source_place():
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:50342: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
                        "application\nmore detail")  # fmt: skip
    assert _peer_error(gloo) == "Read error [127.0.0.1]:50342: Connection reset by peer"
    assert _peer_error(RuntimeError("")) == "RuntimeError"
    long = _peer_error(RuntimeError("word " * 100))
    assert len(long) <= 164 and long.endswith("word ...")


def test_the_slurm_template_ships_and_parses():
    from importlib.resources import files

    template = files("anytime") / "templates" / "train-ddp.sbatch"
    text = template.read_text()
    assert "srun torchrun" in text and "-m anytime train" in text and "--resume" in text
    done = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
