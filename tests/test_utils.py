"""Atomic writes, results folders, the machine record and memory probes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from anytime.train.memory import TreeMemorySampler, peak_rss_bytes, tree_memory
from anytime.utils.io import write_json, write_text
from anytime.utils.machine import describe_machine, drop_page_cache, git_sha, storage_of
from anytime.utils.results import staged_dir
from anytime.utils.seed import derive_seed


def test_write_text_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    write_text(path, "old")

    def broken_dumps(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(json, "dumps", broken_dumps)
    with pytest.raises(ValueError):
        write_json(path, {"a": 1})
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_staged_dir_keeps_old_results_when_a_run_fails(tmp_path):
    target = tmp_path / "results"
    with staged_dir(target) as work:
        (work / "a.csv").write_text("first")
    with pytest.raises(RuntimeError), staged_dir(target) as work:
        (work / "a.csv").write_text("half")
        raise RuntimeError("interrupted")
    assert (target / "a.csv").read_text() == "first"
    with staged_dir(target) as work:
        (work / "b.csv").write_text("second")
    assert sorted(p.name for p in target.iterdir()) == ["b.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_machine_description_names_cpu_threads_and_software(tmp_path):
    info = describe_machine(tmp_path)
    assert info["cpu_model"]
    assert info["torch_threads"] >= 1
    assert info["torch"].startswith("2.")
    assert info["data_storage"]["path"] == str(tmp_path.resolve())
    assert storage_of(tmp_path / "missing") is None


def test_drop_page_cache_says_what_happened():
    dropped, note = drop_page_cache()
    assert isinstance(dropped, bool)
    assert ("dropped" in note) if dropped else note.startswith("page cache not dropped")


def test_git_sha_of_a_folder_outside_git(tmp_path):
    assert git_sha(tmp_path) is None


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(0, 1) == derive_seed(0, 1)
    assert len({derive_seed(0, e) for e in range(100)}) == 100
    assert 0 <= derive_seed(2**40, 7) < 2**63


def test_tree_memory_counts_child_processes():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; x = bytearray(200 * 2**20); time.sleep(3)"],
    )
    try:
        time.sleep(1.5)
        with TreeMemorySampler(interval_s=0.05) as sampler:
            time.sleep(0.2)
        alone = tree_memory(child.pid)
    finally:
        child.kill()
        child.wait()
    assert alone.rss_bytes > 150 * 2**20
    assert sampler.peak_processes_ >= 2
    assert sampler.peak_rss_bytes_ > 150 * 2**20
    assert peak_rss_bytes() > 0
