"""Precision as a dimension of every step: converted models keep the step contract, int8 early exit still skips
computation, int8 calibration reads training images only, and a quantized run goes through the pipeline."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from anytime.backbones import create_model
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.families import BlockDropLadder, attach_exits, slice_model
from anytime.precision import Int8Recipe, PrecisionModel, backend_for, convert

SHAPE = (3, 32, 32)


def _families(backbone: str = "resnet8") -> dict[str, torch.nn.Module]:
    """Every step family on one backbone (by default the smallest ResNet: exporting and quantizing take time
    in proportion to its layers)."""
    torch.manual_seed(0)
    return {
        "exits": attach_exits(create_model(backbone, num_classes=10), "auto", num_classes=10, input_shape=SHAPE),
        "slices": slice_model(create_model(backbone, num_classes=10), (0.5, 1.0), input_shape=SHAPE),
        "ladder": BlockDropLadder(create_model(backbone, num_classes=10), input_shape=SHAPE),
        "plain": create_model(backbone, num_classes=10),
    }


@pytest.fixture(scope="module")
def calibration() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(16, *SHAPE, generator=generator) for _ in range(2)]


@pytest.mark.parametrize("precision", ["int8", "int8-dynamic", "bf16"])
@pytest.mark.parametrize("family", ["exits", "slices", "ladder", "plain"])
def test_converted_steps_keep_the_step_contract(family, precision, calibration):
    model = _families()[family].eval()
    # int8's deployed form (oneDNN kernels) on two families; the others as reference graphs, to keep the suite short
    lowered = precision == "int8" and family in ("exits", "plain")
    converted, _ = convert(
        model, precision, input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=lowered
    )
    assert isinstance(converted, PrecisionModel)
    x = torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(x)
        out = converted(x)
        assert out.shape == reference.shape and out.dtype == torch.float32
        steps = int(getattr(model, "num_steps", 1))
        assert converted.num_steps == steps and len(converted.step_flops) == steps
        if steps > 1:
            for k in range(steps):
                assert torch.equal(converted.forward_until(x, k), out[k])
            assert torch.equal(torch.stack(list(converted.steps(x))), out)
        agree = (reference.argmax(-1) == out.argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"{family} at {precision}: top-1 agrees on {agree:.0%} of the samples"
    assert converted.step_flops[-1] > 0  # the float graph's FLOPs, not the quantized graph's zero
    with pytest.raises(AnytimeError, match="does not exist"):
        converted.forward_until(x, steps)


@pytest.mark.parametrize("criterion", ["entropy", "patience"])
def test_early_exit_of_a_half_precision_run_answers_in_float32(criterion, monkeypatch):
    # A converted model's heads answer in float32 and its last segment in its own precision; a batch whose
    # samples leave at both once failed on a GPU (fp16) when the answers were gathered into one tensor.
    from anytime.calibrate import ExitPolicy

    # compiled as a bf16 run compiles its parts, by TorchDynamo alone: inductor's code generation (60-70 s here with
    # a cold cache) is about what the graphs compute, not about how the parts answer together
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(*args, **{**kwargs, "backend": "eager"}))
    model = _families()["exits"].eval()
    converted, _ = convert(model, "bf16", input_shape=SHAPE)
    assert converted.spec.compile and all(hasattr(part, "_orig_mod") for part in converted.parts)
    x = torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = converted.forward_until(x, 0)
    if criterion == "patience":  # every head runs, so no one leaving early still mixes the two precisions
        policy = ExitPolicy("patience", (99.0,) * (converted.num_steps - 1))
    else:  # the median entropy at exit 0: about half the batch leaves there, the rest goes on
        p = first.softmax(-1)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
        policy = ExitPolicy("entropy", (float(entropy.median()),) + (None,) * (converted.num_steps - 2))
    out = policy.run(converted, x)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (16, 10)
    if criterion == "entropy":
        assert len(set(out.exits.tolist())) > 1, "the batch should leave at more than one exit"
    one = policy.run(converted, x[:1])
    assert one.logits.dtype == torch.float32


def test_int8_early_exit_does_not_run_later_stages(calibration):
    model = _families()["exits"].eval()
    converted, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=True)
    called: list[int] = []
    for i, part in enumerate(converted.parts):
        part.register_forward_hook(lambda *args, i=i: called.append(i))
    with torch.no_grad():
        converted.forward_until(torch.randn(2, *SHAPE), 0)
        assert called == [0, 1]  # segment 0 and head 0 only
        called.clear()
        first = next(converted.steps(torch.randn(2, *SHAPE)))
    assert called == [0, 1] and first.shape == (2, 10)


def test_lowered_int8_kernels_compute_what_the_reference_graphs_compute(calibration):
    """On an x86 CPU without VNNI, oneDNN's int8 kernels add pairs of uint8 x int8 products in 16 bits; with
    full-range activations they saturated (a CIFAR network's lowered graphs agreed with their own reference
    arithmetic on 82-85% of test images). The backend of such a CPU quantizes activations to 7 bits."""
    model = _families()["exits"].eval()
    x = torch.randn(64, *SHAPE, generator=torch.Generator().manual_seed(4)) * 3  # large activations
    lowered, state = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration + [x[:32]]),
                             compile=True)  # fmt: skip
    reference, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(state=state), compile=False)
    with torch.no_grad():
        fast, slow = lowered(x), reference(x)
    scale = float(slow.abs().max())
    assert float((fast - slow).abs().max()) <= 0.05 * scale, "the int8 kernels overflow"


def test_a_full_range_int8_run_is_refused_on_a_cpu_without_vnni(calibration, monkeypatch):
    from anytime.precision import model as precision_model

    model = _families()["plain"].eval()
    monkeypatch.setattr(precision_model, "x86_without_vnni", lambda: True)
    _, state = convert(model, "int8", input_shape=SHAPE, compile=False,
                       int8=Int8Recipe(calibration=calibration, backend=precision_model.X86_FULL))  # fmt: skip
    with pytest.raises(AnytimeError, match="VNNI.*quantize the float run again"):
        convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(state=state, backend=precision_model.X86_FULL),
                compile=True)  # fmt: skip


def test_int8_rebuilds_exactly_from_its_statistics(calibration):
    model = _families()["exits"].eval()
    first, state = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=False)
    again, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(state=state), compile=False)
    x = torch.randn(4, *SHAPE)
    with torch.no_grad():
        assert torch.equal(first(x), again(x))
    with pytest.raises(AnytimeError, match="calibration images"):
        convert(model, "int8", input_shape=SHAPE)
    other = _families()["plain"].eval()
    with pytest.raises(AnytimeError, match="do not fit its model"):
        convert(other, "int8", input_shape=SHAPE, int8=Int8Recipe(state=state), compile=False)


def test_a_precision_the_device_cannot_run_is_refused():
    model = create_model("lenet", num_classes=10).eval()
    with pytest.raises(AnytimeError, match="fp16 runs on CUDA.*bf16"):
        convert(model, "fp16", input_shape=SHAPE)
    with pytest.raises(AnytimeError, match="unknown precision"):
        convert(model, "int4", input_shape=SHAPE)


def _quantized(exit_run, folder, *, compile: bool):
    from anytime.precision.tuning import Int8Settings
    from anytime.tasks.quantize import QuantizeSettings, quantize_run

    parent = folder / "run"
    shutil.copytree(exit_run, parent)
    quantize_run(parent, "int8", QuantizeSettings(compile=compile), Int8Settings(calibration_images=128))
    return parent, folder / "run-int8"


@pytest.fixture(scope="module")
def quantized(exit_run, tmp_path_factory):
    """The trained multi-exit digits run and its int8 form as reference graphs (quick to rebuild)."""
    return _quantized(exit_run, tmp_path_factory.mktemp("quantized"), compile=False)


def test_a_quantized_run_reports_every_step_beside_its_parent(quantized):
    parent, qrun = quantized
    summary = json.loads((qrun / "summary.json").read_text())
    float_summary = json.loads((parent / "summary.json").read_text())
    record = summary["precision"]
    assert record["precision"] == "int8" and record["mode"] == "reference"
    assert record["backend"] == backend_for("int8", torch.device("cpu"))  # 7-bit activations where there is no VNNI
    assert record["calibration_split"] == "train" and record["calibration_images"] == 128 and record["torchao"]
    assert [e["parent_val_acc"] for e in summary["exits"]] == [e["val_acc"] for e in float_summary["exits"]]
    for e in summary["exits"]:
        assert abs(e["val_acc"] - e["parent_val_acc"]) < 0.1 and 0 <= e["test_acc"] <= 1
    config = json.loads((qrun / "config.json").read_text())
    assert config["precision"]["parent_fingerprint"] and (qrun / "quant.safetensors").is_file()


def test_int8_calibration_reads_training_images_only(exit_run, tmp_path, monkeypatch):
    import anytime.tasks.quantize as quantize
    from anytime.precision.tuning import Int8Settings

    parent = tmp_path / "run"
    shutil.copytree(exit_run, parent)
    seen: list[str] = []
    real_loader, real_convert = quantize.make_loader, quantize.convert

    def loader(split, *args, **kwargs):
        seen.append(split.name)
        return real_loader(split, *args, **kwargs)

    def converting(*args, int8=None, **kwargs):
        batches = list(int8.calibration)  # everything the calibration reads is read now
        assert seen == ["train"], f"calibration read {seen}"
        return real_convert(*args, int8=replace(int8, calibration=batches), **kwargs)

    monkeypatch.setattr(quantize, "make_loader", loader)
    monkeypatch.setattr(quantize, "convert", converting)
    quantize.quantize_run(parent, "int8", quantize.QuantizeSettings(compile=False), Int8Settings(calibration_images=64))
    assert seen[1:] == ["val", "test"]  # after calibration: only the report


Q90 = ["--quantile", "0.9"]


def _through_the_pipeline(parent, qrun, capsys, cli_error, mode):
    # 20 timings per step (int8 reference graphs time slowly), so the 0.9 quantile, not the default 0.99
    for argv in (["collect", str(qrun)], ["calibrate", str(qrun), "--max-drop", "1"],
                 ["profile", str(qrun), "--batch-sizes", "1,4", "--repeats", "20", "--warmup", "2", "--no-memory"],
                 ["schedule", str(qrun), *Q90, "--deadline-ms", "1000"]):  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert '"fits": true' in out
    profile = json.loads(next(qrun.glob("profile-*.json")).read_text())
    assert profile["settings"]["precision"]["mode"] == mode
    summary = json.loads((qrun / "summary.json").read_text())
    assert [s["flops"] for s in profile["steps"]] == summary["step_flops"]
    float_profile = parent / "float.json"
    assert main(["profile", str(parent), "--batch-sizes", "1,4", "--repeats", "20", "--warmup", "2", "--no-memory",
                 "--out", str(float_profile)]) == 0  # fmt: skip
    capsys.readouterr()
    cli_error(["schedule", str(qrun), *Q90, "--deadline-ms", "5", "--profile", str(float_profile)], "another model")
    with_float = ["schedule", str(parent), "--profile", str(float_profile), *Q90, "--with"]
    assert main([*with_float, str(qrun), "--deadline-ms", "1000"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["fits"] and both["precision"] in ("fp32", "int8") and both["run"] in (str(parent), str(qrun))
    assert {f["run"] for f in both["frontier"]} <= {str(parent), str(qrun)}
    assert all(f["option"].split()[0] in ("fp32", "int8") for f in both["frontier"])
    cli_error([*with_float, str(parent), "--deadline-ms", "5"], "both fp32")


def test_a_quantized_run_goes_through_the_pipeline(quantized, capsys, cli_error):
    _through_the_pipeline(*quantized, capsys, cli_error, "reference")


@pytest.mark.slow
def test_a_deployed_int8_run_goes_through_the_pipeline(exit_run, tmp_path, capsys, cli_error):
    _through_the_pipeline(*_quantized(exit_run, tmp_path, compile=True), capsys, cli_error, "onednn")


def test_quantize_refuses_bad_requests_in_one_line(quantized, tmp_path, cli_error):
    parent, qrun = quantized
    cli_error(["quantize", str(qrun), "--precision", "int8"], "already a converted run")
    cli_error(["quantize", str(parent), "--precision", "fp16"], "fp16 runs on CUDA")
    cli_error(["quantize", str(parent), "--precision", "int8"], str(qrun), "--overwrite")
    cli_error(["quantize", str(tmp_path / "nothing"), "--precision", "int8"], "no run directory")
    untrained = tmp_path / "untrained"
    shutil.copytree(parent, untrained)
    (untrained / "model.safetensors").unlink()
    cli_error(["quantize", str(untrained), "--precision", "int8", "--out", str(tmp_path / "q")], "has not finished")
    assert not (tmp_path / "q").exists()


def test_quantization_aware_training_reports_ptq_and_qat_and_rebuilds(tmp_path, tiny_config, capsys):
    from anytime.train import Trainer
    from anytime.train.runs import load_run

    parent = tmp_path / "lenet"
    Trainer(tiny_config.replace(epochs=1), parent).fit()
    assert main(["quantize", str(parent), "--precision", "int8", "--qat-epochs", "1", "--qat-lr", "0.01",
                 "--calibration-images", "64", "--no-compile"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "QAT epoch 1/1" in out and "PTQ test" in out
    qrun = tmp_path / "lenet-int8"
    summary = json.loads((qrun / "summary.json").read_text())
    record, final = summary["precision"], summary["final"]
    assert record["qat_epochs"] == 1 and record["qat_lr"] == 0.01
    assert {"ptq_val_acc", "ptq_test_acc", "val_acc", "test_acc"} <= set(final)
    first, again = load_run(qrun).model, load_run(qrun).model  # rebuilt from the trained graphs' state
    x = torch.randn(8, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(first(x), again(x))
    float_model = load_run(parent).model
    with torch.no_grad():
        assert not torch.equal(first(x), float_model(x))


def test_qat_refuses_other_precisions(exit_run, tmp_path, cli_error):
    cli_error(["quantize", str(exit_run), "--precision", "bf16", "--qat-epochs", "1", "--out", str(tmp_path / "q")],
              "--qat-epochs fine-tunes int8")  # fmt: skip
    assert not (tmp_path / "q").exists()


def test_torchvision_resnets_quantize_to_int8():
    # the non-strict export of torchvision's residual adds is refused by X86InductorQuantizer's fusion patterns
    model = create_model("tv:resnet18", num_classes=10).eval()
    calibration = [torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(4))]
    converted, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=False)
    with torch.no_grad():
        assert converted(torch.randn(3, *SHAPE)).shape == (3, 10)


def test_int8_dynamic_runs_fbgemm_kernels_on_an_x86_cpu_and_torchao_elsewhere(monkeypatch):
    import platform

    import anytime.precision.model as precision_model

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the fbgemm kernels are chosen on x86 CPUs")
    model = _families()["exits"].eval()
    x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(4))
    converted, _ = convert(model, "int8-dynamic", input_shape=SHAPE)
    assert converted.spec.backend == "fbgemm-dynamic" and not converted.spec.compile  # compiled, they ran slower
    linears = [m for p in converted.parts for m in p.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert linears, "every exit head's Linear should be a dynamic int8 Linear"
    monkeypatch.setattr(precision_model, "_has_fbgemm", lambda: False)
    elsewhere, _ = convert(model, "int8-dynamic", input_shape=SHAPE, compile=False)
    assert elsewhere.spec.backend == "torchao-dynamic"
    with torch.no_grad():  # the two forms quantize alike
        agree = (converted(x).argmax(-1) == elsewhere(x).argmax(-1)).float().mean().item()
    assert agree >= 0.75


def _weights_quantized(converted) -> int:
    """How many convolutions and linear layers of a converted model's reference graphs take int8 weights."""
    count = 0
    for part in converted.parts:
        for node in part.graph.nodes:
            if node.op == "call_function" and node.target in (
                torch.ops.aten.conv2d.default,
                torch.ops.aten.linear.default,
            ):
                weight = node.args[1]
                count += getattr(weight, "op", "") == "call_function" and "dequantize" in str(weight.target)
    return count


def test_layers_kept_in_float_are_left_out_of_the_int8_graphs(calibration):
    from anytime.precision.int8 import quantizable_layers

    model = _families()["exits"].eval()
    first = quantizable_layers(model)[0]
    plain, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=False)
    kept, state = convert(
        model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration, float_layers=(first,)), compile=False
    )
    assert _weights_quantized(kept) == _weights_quantized(plain) - 1 and kept.spec.float_layers == (first,)
    again, _ = convert(
        model, "int8", input_shape=SHAPE, int8=Int8Recipe(state=state, float_layers=(first,)), compile=False
    )
    x = torch.randn(4, *SHAPE)
    with torch.no_grad():
        assert torch.equal(kept(x), again(x)) and not torch.equal(kept(x), plain(x))
    with pytest.raises(AnytimeError, match="no convolution or linear layer named 'stem'"):
        convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration, float_layers=("stem",)),
                compile=False)  # fmt: skip
    with pytest.raises(AnytimeError, match="int8 option"):
        convert(model, "bf16", input_shape=SHAPE, int8=Int8Recipe(float_layers=(first,)))


class _Outliers(torch.nn.Module):
    """A small linear CNN whose first convolution is calibrated on images with rare huge pixels in a channel it
    ignores: quantizing its input wipes out the ordinary pixels, while the layers after it never see the outliers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(3, 16, 3, padding=1, bias=False)
        with torch.no_grad():
            self.first.weight[:, 0] = 0.0
        self.second = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.fc = torch.nn.Linear(16 * 4 * 4, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(self.first(x))  # linear, so the class follows the image rather than the biases
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(h, 4).flatten(1))


def test_accuracy_aware_int8_keeps_the_layer_int8_hurts_most_in_float():
    from anytime.precision.tuning import Int8Settings, layer_sensitivity, step_agreement, tune_int8

    torch.manual_seed(0)
    model = _Outliers().eval()
    generator = torch.Generator().manual_seed(4)
    calibration = [torch.randn(16, *SHAPE, generator=generator) for _ in range(2)]
    calibration[0][0, 0, 0, 0] = 500.0  # one pixel, in a channel the network ignores, sets the first input range
    images = torch.randn(200, *SHAPE, generator=generator)
    ranking = layer_sensitivity(model, calibration, images)
    assert [r.name for r in ranking][0] == "first" and ranking[0].agreement < 0.9 <= ranking[1].agreement
    plain, _ = convert(model, "int8", input_shape=SHAPE, int8=Int8Recipe(calibration=calibration), compile=False)
    assert min(step_agreement(model, plain, images)) < 0.9  # all int8: the ordinary pixels are gone
    converted, _, tuning = tune_int8(model, Int8Settings(min_agreement=0.9), input_shape=SHAPE,
                                     calibration=calibration, images=images, compile=False)  # fmt: skip
    assert tuning.float_layers == ("first",) and tuning.met and converted.spec.float_layers == ("first",)
    assert [layers for layers, _ in tuning.tried] == [("first",)]  # the simulation said where to start
    assert min(tuning.agreement) >= 0.9 and tuning.to_dict()["met"]
    _, _, missed = tune_int8(model, Int8Settings(min_agreement=1.0, max_float_layers=0), input_shape=SHAPE,
                             calibration=calibration, images=images, compile=False)  # fmt: skip
    assert not missed.met and missed.float_layers == () and len(missed.tried) == 1


def test_layers_go_back_to_float_by_agreement_bought_per_weight(monkeypatch):
    from anytime.precision import tuning

    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 2), torch.nn.Linear(2, 2))  # 1600, 80, 4
    # simulated agreement: layer 0 in float buys the most, layer 1 less but for 20x fewer weights, layer 2 nothing
    worth = {"0": 0.05, "1": 0.04, "2": 0.0}
    monkeypatch.setattr(
        tuning,
        "_simulated_agreement",
        lambda _m, quantized, *_: 0.9 + sum(v for n, v in worth.items() if n not in quantized),
    )
    ranking = [tuning.LayerSensitivity(n, a) for n, a in (("0", 0.9), ("1", 0.91), ("2", 1.0))]
    order, simulated = tuning._cheapest_order(model, {}, 256, torch.zeros(1), [], ranking, 3)
    assert order == ["1", "0", "2"]  # the small layer first; the useless one last, by the single-layer ranking
    assert simulated == pytest.approx([0.9, 0.94, 0.99, 0.99])
    # with room for 100 weights in float, layer 0 (1,600) never goes back, and the order ends when nothing fits
    order, simulated = tuning._cheapest_order(model, {}, 256, torch.zeros(1), [], ranking, 3, max_float_weights=100)
    assert order == ["1", "2"] and simulated == pytest.approx([0.9, 0.94, 0.94])
    assert tuning._cheapest_order(model, {}, 256, torch.zeros(1), [], ranking, 3, max_float_weights=3) == ([], [0.9])


def test_quantize_chooses_layers_kept_in_float_and_the_run_rebuilds_with_them(exit_run, tmp_path, capsys, cli_error):
    parent = tmp_path / "run"
    shutil.copytree(exit_run, parent)
    qrun = tmp_path / "q"
    assert main(["quantize", str(parent), "--precision", "int8", "--no-compile", "--calibration-images", "64",
                 "--min-agreement", "1.0", "--max-float-layers", "1", "--agreement-images", "100",
                 "--out", str(qrun)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "agreement with the float run on 100 validation images" in out
    record = json.loads((qrun / "config.json").read_text())["precision"]
    tuning = record["agreement_tuning"]
    assert 1 <= len(tuning["tried"]) <= 2 and tuning["images"] == 100
    assert record["float_layers"] == tuning["float_layers"] == tuning["tried"][-1]["float_layers"] or not tuning["met"]
    assert main(["collect", str(qrun)]) == 0  # the run rebuilds from its record, with the same layers in float
    capsys.readouterr()
    cli_error(["quantize", str(parent), "--precision", "bf16", "--min-agreement", "0.99"], "int8 options")
    cli_error(["quantize", str(parent), "--precision", "int8", "--min-agreement", "1.5", "--out", str(tmp_path / "x")],
              "(0, 1]")  # fmt: skip
    cli_error(["quantize", str(parent), "--precision", "int8", "--min-agreement", "0.9", "--float-layers", "a",
               "--out", str(tmp_path / "x")], "give one")  # fmt: skip
    cli_error(["quantize", str(parent), "--precision", "int8", "--float-layers", "nope", "--out", str(tmp_path / "x")],
              "no convolution or linear layer named 'nope'")  # fmt: skip
    assert not (tmp_path / "x").exists()
