"""The CUDA paths, run where torch sees a GPU and skipped elsewhere: fp16 and bf16 runs keep the step contract and
their parent's accuracy, profiles on a GPU are synchronised and measure GPU memory, one schedule spans precisions,
real early exit and the anytime runtime run on the GPU, a text encoder is profiled per length bucket, and NVML reads
the GPU's energy. None of them times anything against a clock."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from anytime.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROFILE = ["--device", "cuda", "--batch-sizes", "1,4", "--repeats", "100", "--warmup", "3"]


def _input_shape(run) -> tuple[int, ...]:
    return (int(run.dataset["in_channels"]), *(int(v) for v in run.dataset["image_size"]))


@pytest.fixture(scope="module")
def half_runs(exit_run, tmp_path_factory) -> tuple[Path, Path, Path]:
    """The trained multi-exit digits run and its fp16 (compiled) and bf16 (eager) forms, converted on the GPU."""
    from anytime.tasks.quantize import QuantizeSettings, quantize_run

    parent = tmp_path_factory.mktemp("half") / "run"
    shutil.copytree(exit_run, parent)
    quantize_run(parent, "fp16", device="cuda")  # compiled, as deployed
    quantize_run(parent, "bf16", QuantizeSettings(compile=False), device="cuda")
    return parent, parent.with_name("run-fp16"), parent.with_name("run-bf16")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_runs_keep_the_step_contract_and_the_parents_accuracy(half_runs, precision):
    from anytime.train.runs import load_run

    parent, fp16, bf16 = half_runs
    qrun = fp16 if precision == "fp16" else bf16
    summary = json.loads((qrun / "summary.json").read_text())
    assert summary["precision"]["precision"] == precision
    assert summary["device"] == torch.cuda.get_device_name(0)
    for exit_ in summary["exits"]:
        assert abs(exit_["val_acc"] - exit_["parent_val_acc"]) <= 0.02, exit_
    loaded = load_run(qrun, "cuda")
    x = torch.randn(6, *_input_shape(loaded), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        out = loaded.model(x)
        assert out.device.type == "cuda" and out.dtype == torch.float32
        for k in range(loaded.num_steps):
            assert torch.equal(loaded.model.forward_until(x, k), out[k])
        reference = load_run(parent, "cuda").model(x)
    assert (out.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_a_profile_on_the_gpu_is_synchronised_and_measures_its_memory(half_runs, capsys):
    parent, fp16, _ = half_runs
    assert main(["profile", str(fp16), *PROFILE]) == 0, capsys.readouterr().err
    profile = json.loads(next(fp16.glob("profile-cuda-*.json")).read_text())
    assert profile["device"]["type"] == "cuda" and "CUDA synchronised" in profile["settings"]["timer"]
    assert profile["settings"]["precision"]["precision"] == "fp16"
    for batch in profile["batches"]:
        assert batch["memory"]["how"] == "CUDA allocator peak" and batch["memory"]["peak_mb"] > 0


def test_one_schedule_spans_fp32_fp16_and_bf16_on_the_gpu(half_runs, capsys):
    parent, fp16, bf16 = half_runs
    for run in (parent, fp16, bf16):
        if not list(run.glob("profile-cuda-*.json")):
            assert main(["profile", str(run), *PROFILE]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["schedule", str(parent), "--deadline-ms", "1000", "--with", f"{fp16},{bf16}"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["precision"] in ("fp32", "fp16", "bf16")
    assert {option["option"].split()[0] for option in answer["frontier"]} <= {"fp32", "fp16", "bf16"}


def test_real_early_exit_and_the_runtime_run_on_the_gpu(half_runs, capsys):
    from anytime.scheduler.runs import runner_for_run
    from anytime.train.runs import load_run

    parent, fp16, _ = half_runs
    assert main(["collect", str(fp16)]) == 0 and main(["calibrate", str(fp16), "--max-drop", "1"]) == 0
    loaded = load_run(fp16, "cuda")
    parts = [type(p).__name__ for p in loaded.model.parts]
    assert len(loaded.model.segments) == loaded.num_steps, (parts, loaded.num_steps, type(loaded.model).__name__)
    assert main(["evaluate", str(fp16), "--device", "cuda", "--latency-samples", "20"]) == 0, capsys.readouterr().err
    if not list(fp16.glob("profile-cuda-*.json")):
        assert main(["profile", str(fp16), *PROFILE]) == 0
    runner, loaded = runner_for_run(fp16, next(fp16.glob("profile-cuda-*.json")), device="cuda")
    answer = runner.predict(torch.zeros(1, *_input_shape(loaded), device="cuda"), 10_000.0)
    assert answer.logits.device.type == "cuda" and 0 <= answer.step < loaded.num_steps


def test_a_text_encoder_is_profiled_per_length_bucket_on_the_gpu(tmp_path, capsys):
    from anytime.train import TrainConfig, Trainer
    from tests.test_text import _sentences, _write

    root = tmp_path / "text"
    root.mkdir()
    _write(root / "train.tsv", _sentences(200, 0), column="sentence")
    _write(root / "test.tsv", _sentences(40, 2))
    run = tmp_path / "run"
    Trainer(TrainConfig(model="mobilebert_tiny", data="textfolder", data_root=str(root), epochs=1, batch_size=32,
                        lr=2e-3, optimizer="adamw", exits="auto", vocab_size=200, max_length=16, device="cuda"),
            run).fit()  # fmt: skip
    for length in (8, 16):
        assert main(["profile", str(run), "--length", str(length), *PROFILE]) == 0, capsys.readouterr().err
    assert sorted(p.name.rsplit("-", 1)[1] for p in run.glob("profile-cuda-*-T*.json")) == ["T16.json", "T8.json"]
    half = tmp_path / "run-fp16"  # a text encoder in half precision: its token ids stay integers on the GPU
    capsys.readouterr()
    assert main(["quantize", str(run), "--precision", "fp16", "--device", "cuda", "--no-compile", "--out", str(half),
                 "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert all(abs(e["test_acc"] - e["parent_test_acc"]) <= 0.05 for e in summary["exits"])
    for argv in (["collect", half, "--device", "cuda"], ["calibrate", half, "--max-drop", "1"],
                 ["evaluate", half, "--device", "cuda", "--split", "test", "--latency-samples", "5"],
                 ["profile", half, "--length", "8", *PROFILE]):  # fmt: skip
        assert main([str(a) for a in argv]) == 0, capsys.readouterr().err


def test_nvml_reads_the_gpus_energy():
    pytest.importorskip("pynvml")
    from anytime.profile.energy_readers import open_energy_reader

    reader = open_energy_reader("cuda", 0)
    try:
        first = reader.read_j()
        with reader.sampling():
            x = torch.randn(4096, 4096, device="cuda")
            for _ in range(200):
                x = torch.tanh(x @ x)
            torch.cuda.synchronize()
        assert reader.read_j() > first
    finally:
        reader.close()
