"""Atomic writes, results folders, the machine record and memory probes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import pytest

from anytime.errors import AnytimeError
from anytime.train.memory import TreeMemorySampler, peak_rss_bytes, tree_memory
from anytime.utils.io import write_json, write_text
from anytime.utils.machine import describe_machine, git_sha, resolve_device, storage_of
from anytime.utils.outputs import staged_dir
from anytime.utils.seed import derive_seed


def test_a_failed_write_leaves_the_old_file_and_no_debris(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    write_text(path, "old")

    class HalfWritten(OSError):
        pass

    real_fsync = os.fsync

    def failing_fsync(fd):
        real_fsync(fd)
        raise HalfWritten("disk full")  # the new bytes are on disk in the temporary file, not yet renamed

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(AnytimeError, match=f"could not write {path} "):
        write_json(path, {"a": 1})
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_staged_dir_keeps_old_results_when_a_run_fails(tmp_path):
    target = tmp_path / "results"
    with staged_dir(target, "study") as work:
        (work / "a.csv").write_text("first")
    with pytest.raises(RuntimeError), staged_dir(target, "study", overwrite=True) as work:
        (work / "a.csv").write_text("half")
        raise RuntimeError("interrupted")
    assert (target / "a.csv").read_text() == "first"
    with staged_dir(target, "study", overwrite=True) as work:
        (work / "b.csv").write_text("second")
    assert sorted(p.name for p in target.iterdir()) == [".anytime.json", "b.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_machine_description_names_cpu_threads_and_software(tmp_path):
    info = describe_machine(tmp_path)
    assert info["cpu_model"]
    assert info["torch_threads"] >= 1
    assert info["torch"].startswith("2.")
    assert info["data_storage"]["path"] == str(tmp_path.resolve())
    assert storage_of(tmp_path / "missing") is None


def test_device_names_are_checked():
    import torch

    from anytime.errors import AnytimeError

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(AnytimeError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(AnytimeError, match="no CUDA GPU"):
            resolve_device("cuda:0")


def test_git_sha_of_a_folder_outside_git(tmp_path):
    assert git_sha(tmp_path) is None


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(0, 1) == derive_seed(0, 1)
    assert len({derive_seed(0, e) for e in range(100)}) == 100
    assert 0 <= derive_seed(2**40, 7) < 2**63


def test_tree_memory_counts_child_processes():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; x = bytearray(200 * 2**20); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # however busy the machine
        with TreeMemorySampler(interval_s=0.05) as sampler:
            time.sleep(0.2)
        alone = tree_memory(child.pid)
    finally:
        child.kill()
        child.communicate()  # reaps it and closes the pipe
    assert alone.rss_bytes > 150 * 2**20
    assert sampler.peak_processes_ >= 2
    assert sampler.peak_rss_bytes_ > 150 * 2**20
    assert peak_rss_bytes() > 0


def test_threads_leave_the_busy_cores_to_their_owners():
    from anytime.utils.threads import busy_cores, choose_threads

    assert choose_threads(cores=2, busy=(0.1, "test")).threads == 2
    assert choose_threads(cores=2, busy=(1.0, "test")).threads == 1
    assert choose_threads(cores=2, busy=(2.7, "test")).threads == 1  # never fewer than one
    assert choose_threads(cores=8, busy=(2.4, "test")).threads == 6
    readings = iter([(100, 400), (250, 600)])  # 150 of 200 jiffies busy
    load, source = busy_cores(read=lambda: next(readings), sleep=lambda s: None)
    assert source == "/proc/stat" and abs(load - 0.75 * (os.cpu_count() or 1)) < 1e-9
    choice = choose_threads(cores=4, busy=(1.2, "test"))
    assert choice.to_dict() == {"threads": 3, "cores": 4, "busy_cores": 1.2, "source": "test"}


def test_proc_stat_is_read_as_busy_and_total_jiffies(tmp_path):
    from anytime.utils.threads import _cpu_times

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 800 30 1 2 3 0 0\ncpu0 50 2 10 400 15 0 1 1 0 0\n")
    assert _cpu_times(str(stat)) == (100 + 5 + 20 + 1 + 2 + 3, 961)
    assert _cpu_times(str(tmp_path / "missing")) is None


_REPEATED_FORWARD = """
import resource, sys
from anytime.utils.memory import hold_freed_memory
print(hold_freed_memory().held)
import torch
def forward():  # two 3 MiB activations alive at once, then freed, as between the layers of a batch-32 forward
    a = torch.ones(3 << 18)
    b = torch.ones(3 << 18)
    del b, a
for _ in range(10):
    forward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    forward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_held_freed_memory_is_reused_without_page_faults():
    # Page faults are counted, not timed. glibc's defaults hand such blocks back and fault every page in again
    # (1,470 faults per forward measured here); held, the same pages serve every forward.
    out = subprocess.run([sys.executable, "-c", _REPEATED_FORWARD], capture_output=True, text=True, check=True)
    held, faults = out.stdout.split()
    assert held == "True" and int(faults) < 50 * 100, out.stdout  # 1,536 pages per forward would be touched anew


def test_the_allocator_setting_says_what_it_did(monkeypatch):
    from anytime.utils import memory

    monkeypatch.setattr(memory, "_applied", None)
    assert "not set by anytime" in memory.allocator_state()
    monkeypatch.setattr(memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    refused = memory.hold_freed_memory()
    assert not refused.held and "musl, not glibc" in refused.detail and memory.allocator_state() == refused.detail
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        monkeypatch.undo()
        monkeypatch.setattr(memory, "_applied", None)
        held = memory.hold_freed_memory()
        assert held.held and "mmap threshold 32 MiB" in held.detail and memory.hold_freed_memory() is held


def test_a_serving_loop_pauses_the_collector_and_collects_what_is_due_between_requests():
    import gc
    import weakref

    from anytime.utils.collector import collect_due, serving_gc

    class Node:
        pass

    freed = []
    limits = gc.get_threshold()
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with serving_gc():
            gc.set_threshold(50, 10, 10)
            assert not gc.isenabled()
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle: only the collector frees it
            weakref.finalize(a, freed.append, "a")
            del a, b
            kept = [Node() for _ in range(200)]  # far past the young generation's threshold: nothing runs by itself
            assert freed == [] and len(kept) == 200
            assert collect_due() == 0 and freed == ["a"]
            assert collect_due() == -1  # nothing due right after a collection
        assert gc.isenabled()
    finally:
        gc.set_threshold(*limits)
        if not was_enabled:
            gc.disable()


def test_a_study_shows_a_bar_on_a_terminal_and_its_lines_on_stdout(capsys, monkeypatch):
    import sys

    from anytime.utils.progress import StudyProgress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with StudyProgress(2, "my-study", unit="model") as progress:
        progress.done("first model: 91.00%")
        progress.say("a note")
        progress.done()
    printed = capsys.readouterr()
    assert printed.out.splitlines() == ["first model: 91.00%", "a note"]
    assert "my-study:   0%" in printed.err and "0/2" in printed.err  # drawn at once; later redraws are throttled
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # piped or logged: the lines only
    with StudyProgress(1, "my-study") as progress:
        progress.done("only line")
    printed = capsys.readouterr()
    assert printed.out == "only line\n" and printed.err == ""
