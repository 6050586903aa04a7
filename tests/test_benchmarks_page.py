"""The benchmarks' results folder and the page rendered from it (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks import their `common` as a sibling
    try:
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_the_benchmarks_page_is_current():
    page = _module("page")
    assert (REPO / "docs" / "benchmarks.md").read_text() == page.render(), (
        "docs/benchmarks.md is stale: run `python benchmarks/page.py`")  # fmt: skip


def test_a_full_run_is_recorded_per_machine_and_rendered(tmp_path, capsys):
    common, page = _module("common"), _module("page")
    results = tmp_path / "results"
    quick = argparse.Namespace(quick=True, json=None)
    common.report("sweep_speed", quick, {"ms": 1.0}, 2.0, ">= 1", True, results=results)
    assert not results.exists()  # a smoke run records nothing
    full = argparse.Namespace(quick=False, json=str(tmp_path / "also.json"))
    common.report("sweep_speed", full, {"ms": 1.0}, 0.5, ">= 1", False, results=results)
    (recorded,) = results.glob("*/sweep_speed.json")
    assert json.loads(recorded.read_text()) == json.loads((tmp_path / "also.json").read_text())
    assert recorded.parent.name == common.machine_name(json.loads(recorded.read_text())["machine"])
    assert "recorded in" in capsys.readouterr().out
    rendered = page.render(results)
    (row,) = [line for line in rendered.splitlines() if line.startswith("| `sweep_speed`")]
    cells = [c.strip() for c in row.split("|")]
    assert cells[3:7] == [recorded.parent.name, "0.5", ">= 1", "fail"]
    assert "| `cli_startup` |" in rendered and "not recorded yet" in rendered


def test_the_page_refuses_a_report_it_cannot_read_or_place(tmp_path):
    page = _module("page")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not a benchmark report"):
        page.render(tmp_path)
    (tmp_path / "m" / "x.json").write_text(json.dumps({"benchmark": "gone", "ratio": 1, "target": "t",
                                                        "verdict": "pass", "date": "2026-12-06"}))  # fmt: skip
    with pytest.raises(SystemExit, match="no longer exist: gone"):
        page.render(tmp_path)


def test_machine_names_are_folder_names():
    common = _module("common")
    assert common.machine_name({"cpu_model": "AMD EPYC", "cpu_count": 2, "gpu": None}) == "amd-epyc-2c"
    assert common.machine_name({"cpu_model": "Intel(R) Xeon(R) 8480+", "cpu_count": 16,
                                "gpu": "NVIDIA H100 80GB HBM3"}) == "intel-r-xeon-r-8480-16c-nvidia-h100-80gb-hbm3"  # fmt: skip
