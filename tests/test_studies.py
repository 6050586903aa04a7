"""The edge-training studies and the benchmarks, run in their quick modes (slow: `make test-slow`)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from anytime.cli import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _check_config(out):
    config = json.loads((out / "config.json").read_text())
    assert config["hyper_parameters"]["quick"] is True
    assert "git_sha" in config and config["machine"]["cpu_model"]
    assert any("page cache" in note for note in config["notes"])


def test_batch_time_quick(tmp_path, capsys):
    out = tmp_path / "batch-time"
    assert main(["experiment", "batch-time", "--quick", "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out) == json.loads((out / "results.json").read_text()) and printed.err  # progress: stderr
    rows = _rows(out / "results.csv")
    assert {r["model"] for r in rows} == {"lenet", "resnet18", "preact_resnet18", "resnext29_2x64d",
                                          "mobilenetv2", "vgg11"}  # fmt: skip
    for r in rows:
        assert float(r["forward_p50_s"]) > 0 and float(r["backward_p50_s"]) > 0
    assert (out / "batch_time_resnet18.png").is_file()
    _check_config(out)


def test_memory_quick(tmp_path):
    out = tmp_path / "memory"
    assert main(["experiment", "memory", "--quick", "--out", str(out)]) == 0
    by_batch = _rows(out / "by_batch_size.csv")
    resnet20 = [float(r["peak_rss_mb"]) for r in by_batch if r["model"] == "resnet20"]
    assert len(resnet20) == 2 and resnet20[0] <= resnet20[-1]
    workers = {(r["pipeline"], int(r["workers"])): r for r in _rows(out / "by_workers.csv")}
    assert int(workers[("torchvision", 4)]["processes"]) >= 5
    assert float(workers[("torchvision", 4)]["peak_rss_mb"]) > float(workers[("torchvision", 0)]["peak_rss_mb"])
    assert (out / "memory.png").is_file()
    _check_config(out)


@pytest.mark.needs_data
def test_time_accuracy_quick(tmp_path, cifar_root):
    out = tmp_path / "time-accuracy"
    assert main(["experiment", "time-accuracy", "--quick", "--out", str(out)]) == 0
    rows = _rows(out / "curves.csv")
    assert {r["model"] for r in rows} == {"lenet", "resnet20"}
    for model in ("lenet", "resnet20"):
        times = [float(r["elapsed_s"]) for r in rows if r["model"] == model]
        assert times == sorted(times)
    assert (out / "time_accuracy.svg").is_file()
    _check_config(out)


def _benchmark(tmp_path, name: str, *extra: str) -> dict:
    """Run benchmarks/NAME.py --quick with a JSON report; its report."""
    report = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", *extra, "--json", str(report)],
                          capture_output=True, text=True, check=False, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(report.read_text())


@pytest.mark.parametrize(("name", "extra"), [("trainer_overhead", ()), ("data_pipeline", ()), ("exit_overhead", ()),
                                           ("exit_overhead", ("--onnx",)), ("exit_overhead", ("--decompose",)),
                                           ("sweep_speed", ()),
                                           ("scheduler_overhead", ())])  # fmt: skip
def test_benchmark_quick_writes_its_report(tmp_path, name, extra):
    if name == "data_pipeline" and not (REPO.parent / "shared" / "data" / "cifar10" / "train").is_dir():
        pytest.skip("needs the CIFAR-10 image folder")
    data = _benchmark(tmp_path, name, *extra)
    assert data["benchmark"] == name and data["verdict"] in ("pass", "fail") and data["ratio"] > 0
    if "--onnx" in extra:
        assert data["figures"]["runtime"] == "onnxruntime" and data["figures"]["small_network_runtime"] == "onnxruntime"
    if "--decompose" in extra:
        for batch in ("batch1", "batch32"):
            assert data["figures"][batch]["segments_ratio"] > 0 and data["figures"][batch]["segments_heads_ratio"] > 0


def test_exit_overhead_refuses_to_decompose_an_onnx_export_in_one_line():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "exit_overhead.py"), "--onnx", "--decompose"],
                          capture_output=True, text=True, check=False, cwd=REPO)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--onnx" in lines[0] and "Traceback" not in done.stderr


def test_lottery_quick(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the study keeps its runs in ./runs
    out = tmp_path / "lottery"
    assert main(["experiment", "lottery", "--quick", "--out", str(out)]) == 0
    rows = _rows(out / "tickets.csv")
    assert len(rows) == 8 and {r["workers"] for r in rows} == {"1", "2"}
    by_workers = {w: {r["job"]: r["test_acc"] for r in rows if r["workers"] == w} for w in ("1", "2")}
    assert by_workers["1"] == by_workers["2"]  # a worker is one thread either way: the same tickets
    assert (out / "lottery.png").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["hyper_parameters"]["quick"] is True and config["git_sha"]


def test_scale_out_benchmarks_quick(tmp_path):
    ddp = _benchmark(tmp_path, "ddp_scaling")["figures"]
    assert ddp["two processes"]["processes"] == 2 and ddp["largest_relative_loss_gap"] < 1e-4
    sweep = _benchmark(tmp_path, "sweep_parallel")["figures"]
    assert sweep["same_accuracies"] and sweep["2 workers, 1 thread each"]["jobs"] == 4


def test_energy_and_structured_ticket_benchmarks_quick(tmp_path):
    sampler = _benchmark(tmp_path, "energy_sampler")["figures"]
    assert sampler["one_figure"]["calls_per_window"] >= 1 and sampler["threads_1"]["p50_ratio"] > 0
    tickets = _benchmark(tmp_path, "structured_tickets", "--runs", str(tmp_path / "runs"))["figures"]["networks"]
    assert tickets["channels-0.5"]["parameters"] < tickets["dense"]["parameters"]
    assert tickets["masked"]["parameters"] == tickets["dense"]["parameters"] > tickets["masked"]["nonzero_parameters"]


def test_resolution_ladder_benchmark_quick(tmp_path):
    figures = _benchmark(tmp_path, "resolution_ladder", "--runs", str(tmp_path / "runs"))["figures"]["families"]
    assert [s["step"] for s in figures["resolutions"]] == ["16px", "24px", "crop24", "32px"]
    assert {"exits", "slices"} <= set(figures) and (tmp_path / "resolution_ladder.png").is_file()


@pytest.mark.needs_data
def test_early_exit_benchmark_quick(tmp_path, cifar_root):
    figures = _benchmark(tmp_path, "early_exit_cifar10", "--run", str(tmp_path / "run"), "--form", "fold",
                         "--select-exits", "--onnx")["figures"]  # fmt: skip
    assert figures["agreement"] == {"exits": 1.0, "predictions": 1.0} and figures["form"] == "fold"
    # ONNX Runtime's logits differ from PyTorch's in the last bits: a sample on a threshold may tip
    assert figures["onnx"]["agreement_exits"] >= 0.99 and figures["onnx"]["speedup"] > 0
    assert figures["selection"]["exits"] == [k for k, t in enumerate(figures["thresholds"]) if t is not None]
    assert (tmp_path / "run-quick" / "calibration.json").is_file()
    forms = _benchmark(tmp_path, "inference_form", "--run", str(tmp_path / "run"))["figures"]["forms"]
    assert set(forms) == {"eager", "fold", "channels-last", "fold+channels-last"}
    assert all(f["backbone_b1_ms"] > 0 and f["exit0_b1_ms"] > 0 for f in forms.values())


def test_slicing_latency_benchmark_quick(tmp_path):
    data = _benchmark(tmp_path, "slicing_latency")
    assert data["verdict"] in ("pass", "fail") and 0 < data["ratio"] < 1.5
    assert {"resnet18 batch 1", "resnet18 batch 32", "resnet20 batch 1"} <= set(data["figures"])


@pytest.mark.needs_data
def test_residual_cutting_study_and_ladder_quality_quick(tmp_path, cifar_root, monkeypatch):
    monkeypatch.setenv("ANYTIME_CIFAR10", str(cifar_root))
    monkeypatch.chdir(tmp_path)  # the study keeps its runs in ./runs/study-quick
    runs = tmp_path / "runs" / "study-quick"
    data = _benchmark(tmp_path, "ladder_quality", "--runs", str(runs), "--plot", str(tmp_path / "lq"))
    families = {"early exits", "width slices", "block drops", "block drops, stochastic depth"}
    assert data["verdict"] == "info" and set(data["figures"]["steps"]) == families
    assert (tmp_path / "lq.png").is_file() and (tmp_path / "lq.csv").is_file()

    out = tmp_path / "study"
    assert main(["experiment", "residual-cutting", "--quick", "--out", str(out)]) == 0  # reuses the four runs
    results = json.loads((out / "results.json").read_text())
    assert set(results["families"]) == families and len(results["runs"]) == 6
    for family, steps in results["families"].items():
        assert [s["name"] for s in steps] == [s["name"] for s in data["figures"]["steps"][family]]
        assert all(s["mean_ms"] > 0 for s in steps)
    for name in ("resnet20", "resnet20-sd", "resnet29_bottleneck", "resnet29_bottleneck-sd"):
        rows = _rows(out / f"cut-{name}.csv")
        assert rows[0]["config"] == "none" and any(r["config"] == "shortcut:top2" for r in rows)
    assert (out / "families.png").is_file() and (out / "cut.png").is_file() and (out / "matched.csv").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["hyper_parameters"]["quick"] is True and config["hyper_parameters"]["PROFILE_PROCESSES"] == 1
    assert config["git_sha"] and config["machine"]["cpu_model"]


@pytest.mark.needs_data
def test_deadline_benchmark_quick(tmp_path, cifar_root):
    figures = _benchmark(tmp_path, "deadline_cifar10", "--run", str(tmp_path / "run"))["figures"]
    assert set(figures["verdicts"]) == {"quiet, static", "quiet, adaptive", "one core busy, static",
                                        "one core busy, adaptive", "one core busy, auto threads, static",
                                        "one core busy, auto threads, adaptive"}  # fmt: skip
    assert len(figures["rows"]) == 24 and all(0 <= r["miss_rate"] <= 1 for r in figures["rows"])
    assert all(r["oracle_accuracy"] is not None for r in figures["rows"] if r["first_exit_fits"])
    # A p99 that surely fits (its upper bound within the deadline) fits as measured; the sure oracle never beats the
    # oracle of the exits alone, and that one is there wherever the runtime's answers timed before the sweep give an
    # oracle (not the other way round: an exit alone can fit where the runtime's first answer does not).
    assert all(r["first_exit_fits_point"] for r in figures["rows"] if r["first_exit_fits"])
    assert all(r["exit_oracle_accuracy"] is not None for r in figures["rows"] if r["load_oracle_accuracy"] is not None)
    assert all(r["sure_oracle_accuracy"] <= r["exit_oracle_accuracy"] for r in figures["rows"]
               if r["sure_oracle_accuracy"] is not None)  # fmt: skip
    quiet = figures["loads"]["quiet"]
    assert len(quiet["runtime_p99_ms"]) == len(quiet["runtime_p50_ms"]) == len(figures["step_accuracy"])
    assert isinstance(figures["passed_exit_oracle"], bool) and isinstance(figures["passed_load_oracle"], bool)
    assert figures["max_drop"] == 0.5
    # The runtime's answers are timed in the runtimes' turns in the deployed conditions only, and that oracle is
    # always an exit's accuracy (exit 0's where no answer's p99 fitted).
    steps = len(figures["step_accuracy"])
    for r in figures["rows"]:
        deployed = r["load"] == "quiet" or "auto threads" in r["load"]
        assert (r["runtime_p99_now_ms"] is not None) == deployed
        if deployed:
            assert len(r["runtime_p99_now_ms"]) == steps and r["oracle_accuracy"] in figures["step_accuracy"]
        else:
            assert r["oracle_accuracy"] == r["load_oracle_accuracy"]
    assert figures["loads"]["one core busy, auto threads"]["threads"] >= 1
    assert (tmp_path / "run-quick" / "deadline" / "deadline_cifar10.png").is_file()


@pytest.mark.needs_data
def test_quantized_member_benchmark_quick(tmp_path, cifar_root):
    figures = _benchmark(tmp_path, "quantized_member", "--run", str(tmp_path / "run"))["figures"]
    assert {"batch 1", "batch 32", "size ratio", "drop points"} <= set(figures)
    assert (tmp_path / "run-quick-int8" / "quant.safetensors").is_file()


@pytest.mark.needs_data
def test_precision_schedule_benchmark_quick(tmp_path, cifar_root):
    data = _benchmark(tmp_path, "precision_schedule", "--run", str(tmp_path / "run"))
    assert data["verdict"] in ("pass", "fail") and data["figures"]["frontier"]
    assert any(option["option"].startswith(("fp32 ", "int8 ")) for option in data["figures"]["frontier"])


def test_precision_study_quick(tmp_path):
    out = tmp_path / "precision"
    assert main(["experiment", "precision", "--quick", "--out", str(out)]) == 0
    rows = _rows(out / "results.csv")
    variants = {r["variant"] for r in rows}
    assert {
        "fp32 eager",
        "fp32 compiled",
        "int8 PTQ (oneDNN)",
        "bf16 eager",
        "onnxruntime fp32",
        "onnxruntime int8",
    } <= variants
    for row in rows:
        assert float(row["latency_b1_p50_ms"]) > 0 and float(row["images_per_s_b32"]) > 0 and int(row["size_bytes"]) > 0
    fp32 = {r["model"]: int(r["size_bytes"]) for r in rows if r["variant"] == "fp32 eager"}
    int8 = {r["model"]: int(r["size_bytes"]) for r in rows if r["variant"] == "onnxruntime int8"}
    assert all(int8[m] < fp32[m] for m in fp32)
    assert (out / "precision.png").is_file() and json.loads((out / "config.json").read_text())["hyper_parameters"][
        "quick"
    ]


@pytest.mark.needs_data
def test_export_parity_benchmark_quick(tmp_path, cifar_root):
    run_dir = tmp_path / "run"
    assert main(["train", "--model", "resnet20", "--data", "cifar10", "--epochs", "1", "--limit-train", "1000",
                 "--out", str(run_dir), "--no-progress"]) == 0  # fmt: skip
    data = _benchmark(tmp_path, "export_parity", "--runs", str(run_dir))
    figures = data["figures"]
    assert {(r["format"], r["dtype"]) for r in figures["rows"]} == {
        ("pt2", "fp32"),
        ("pt2", "int8"),
        ("onnx", "fp32"),
        ("onnx", "int8"),
    }
    assert data["verdict"] in ("pass", "fail")
    assert {(s["format"], s["variant"]) for s in figures["sizes"]} == {
        (f, v) for f in ("pt2", "onnx") for v in ("int8", "int8-tuned")
    }


def test_ensemble_baselines_study_quick(tmp_path):
    out = tmp_path / "baselines"
    assert main(["experiment", "ensemble-baselines", "--quick", "--out", str(out)]) == 0
    rows = _rows(out / "results.csv")
    assert {r["method"] for r in rows} == {"fusion", "voting", "bagging", "gradient-boosting", "snapshot"}
    assert all(0 <= float(r["test_acc"]) <= 1 and float(r["train_time_s"]) > 0 for r in rows)
    assert (out / "baselines.png").is_file() and (out / "runs" / "lenet-voting" / "model.safetensors").is_file()
    assert main(["experiment", "ensemble-baselines", "--quick", "--out", str(out), "--overwrite"]) == 0


def test_ensemble_baselines_benchmark_quick(tmp_path):
    data = _benchmark(tmp_path, "ensemble_baselines")
    assert data["verdict"] == "info" and {r["method"] for r in data["figures"]["rows"]} == {"voting", "fusion"}


@pytest.fixture(scope="module")
def cifar_members(tmp_path_factory, cifar_root) -> list[Path]:
    """Two tiny CIFAR-10 runs of different architectures (1 epoch on 1,000 images) and their int8 forms."""
    folder = tmp_path_factory.mktemp("members")
    runs = []
    for model in ("lenet", "resnet20"):
        run_dir = folder / model
        assert main(["train", "--model", model, "--data", "cifar10", "--epochs", "1", "--limit-train", "1000",
                     "--lr", "0.05", "--out", str(run_dir), "--no-progress"]) == 0  # fmt: skip
        assert main(["quantize", str(run_dir), "--precision", "int8", "--calibration-images", "64"]) == 0
        runs.append(run_dir)
    return runs


@pytest.mark.needs_data
def test_ensemble_fusion_and_ladder_benchmarks_quick(tmp_path, cifar_members):
    members = ",".join(str(r) for r in cifar_members)
    fusion = _benchmark(tmp_path, "ensemble_fusion", "--members", members)
    assert set(fusion["figures"]["checks"]) == {"gain", "beats mean", "int8 loss", "fuser share"}
    ladder = _benchmark(tmp_path, "ensemble_ladder", "--members", members)
    assert {len(v["steps"]) for v in ladder["figures"]["ladders"].values()} == {2} and ladder["figures"]["fuser ms"] > 0


def test_ensembles_study_quick(tmp_path):
    out = tmp_path / "ensembles"
    assert main(["experiment", "ensembles", "--quick", "--out", str(out)]) == 0
    rows = _rows(out / "results.csv")
    kinds = {(r["kind"], r["precision"]) for r in rows}
    assert {("ensemble mlp", "fp32"), ("ensemble mlp", "int8"), ("member alone", "int8"), ("early exits", "fp32"),
            ("sklearn stacking", "fp32")} <= kinds  # fmt: skip
    assert all(float(r["p99_ms"]) > 0 and 0 <= float(r["test_acc"]) <= 1 for r in rows)
    assert (out / "ensembles.png").is_file()
    from anytime.train.runs import load_run

    assert load_run(out / "runs" / "int8").num_steps == 2  # its members, kept inside the results, still found


def test_onnx_export_time_quick(tmp_path):
    data = _benchmark(tmp_path, "onnx_export_time")
    assert data["verdict"] == "info" and data["figures"]["graphs"] == 5 and data["ratio"] > 0
    assert all(len(data["figures"]["later_s"][variant]) == 2 for variant in ("shared", "per-graph"))
