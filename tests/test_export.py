"""Deployment artifacts: every family's steps export and load back under the step contract, exported early exits
still skip later stages, int8 artifacts store int8 weights (>= 3.5x smaller where weights dominate), the parity
table is measured, and a damaged, edited, pickled or foreign artifact is refused in one line."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from anytime.cli import main
from anytime.deploy.export import ManifestLabels, export_model
from anytime.deploy.loader import ExportedModel, load_export
from anytime.deploy.manifest import MANIFEST, read_manifest
from anytime.deploy.runtimes import sha256_of
from anytime.errors import AnytimeError
from anytime.precision import Int8Recipe
from anytime.precision.tuning import Int8Settings
from anytime.tasks.export import ParitySettings, export_run
from tests.test_precision import SHAPE, _families

pytest.importorskip("onnxruntime")


def _export(model: nn.Module, fmt: str, folder: Path, shape: tuple[int, ...] = SHAPE, *, precision: str = "fp32",
            calibration: list[torch.Tensor] | None = None) -> ExportedModel:  # fmt: skip
    """Export a model (no run needed) and load it back."""
    folder.mkdir(parents=True)
    export_model(model, fmt, precision, folder, input_shape=shape, labels=ManifestLabels(type(model).__name__, 10),
                 int8=Int8Recipe(calibration=calibration))  # fmt: skip
    return load_export(folder)


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
@pytest.mark.parametrize("family", ["exits", "slices", "ladder", "plain"])
def test_fp32_artifacts_of_every_family_match_eager(family, fmt, tmp_path):
    model = _families()[family].eval()
    exported = _export(model, fmt, tmp_path / "export")
    steps = int(getattr(model, "num_steps", 1))
    assert exported.num_steps == steps
    expected = 2 * steps - 1 if family == "exits" else steps
    assert len(exported.manifest.parts) == expected
    x = torch.randn(5, *SHAPE, generator=torch.Generator().manual_seed(3))  # a batch size not seen at export
    with torch.no_grad():
        reference, out = model(x), exported(x)
        assert out.shape == reference.shape and out.dtype == torch.float32
        assert torch.allclose(out, reference, atol=1e-4, rtol=1e-4)
        if steps > 1:
            assert torch.equal(torch.stack(list(exported.steps(x))), out)


def test_an_exported_early_exit_does_not_run_later_stages(tmp_path):
    exported = _export(_families()["exits"], "onnx", tmp_path / "export")
    called: list[int] = []
    for i, part in enumerate(exported.parts):
        part.register_forward_hook(lambda *args, i=i: called.append(i))
    with torch.no_grad():
        exported.forward_until(torch.randn(2, *SHAPE), 0)
    assert called == [0, 1]  # segment 0 and head 0 only


def test_the_graphs_of_onnx_exports_share_one_table_of_the_exporters_functions(tmp_path, monkeypatch):
    from torch.onnx._internal.exporter import _registration

    import anytime.deploy.onnx_export as onnx_export

    built: list[int] = []
    build = vars(_registration.ONNXRegistry)["from_torchlib"].__func__

    def counted(cls, *args, **kwargs):
        built.append(1)
        return build(cls, *args, **kwargs)

    installed = classmethod(counted)
    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", installed)
    monkeypatch.setattr(onnx_export, "_ONNX_TABLES", {})
    exported = _export(_families()["exits"], "onnx", tmp_path / "exits")
    assert len(exported.manifest.parts) == 5 and len(built) == 1  # three segments and two heads
    _export(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)).eval(), "onnx", tmp_path / "plain")
    assert len(built) == 1
    assert vars(_registration.ONNXRegistry)["from_torchlib"] is installed  # torch's own again after each export


def _policy_at_medians(exported: ExportedModel, samples: torch.Tensor, criterion: str, temperatures=None):
    """A policy whose thresholds let about half of ``samples`` leave at every early exit (each between two
    samples' scores, so that rounding cannot tip a decision)."""
    from anytime.calibrate import ExitPolicy, get_criterion

    crit = get_criterion(criterion)
    temps = temperatures or (1.0,) * exported.num_steps
    with torch.no_grad():
        scores = [crit.score(exported.forward_until(samples, k), temps[k]) for k in range(exported.num_steps - 1)]
    return ExitPolicy(criterion, tuple(float(torch.quantile(s, 0.5)) for s in scores), temperatures)


@pytest.mark.parametrize(("precision", "criterion", "temperatures"), [
    ("fp32", "entropy", None), ("int8", "entropy", None), ("fp32", "normalized-entropy", (0.7, 1.3, 2.0)),
    ("fp32", "confidence", None), ("fp32", "margin", (1.5, 0.8, 1.0)),
])  # fmt: skip
def test_a_policy_compiled_into_onnx_graphs_answers_as_the_policy_does(precision, criterion, temperatures, tmp_path):
    model = _families()["exits"].eval()
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(1))]
    exported = _export(model, "onnx", tmp_path / "export", precision=precision, calibration=calibration)
    samples = torch.randn(24, *SHAPE, generator=torch.Generator().manual_seed(4))
    policy = _policy_at_medians(exported, samples, criterion, temperatures)
    program = exported.exit_program(policy)
    assert program is not None and exported.exit_program(policy) is program  # compiled once
    called: list[int] = []  # the artifacts' own sessions: the compiled graphs replace them
    for i, part in enumerate(exported.parts):
        part.register_forward_hook(lambda *args, i=i: called.append(i))
    with torch.inference_mode():
        expected = policy._run(exported, samples)  # the tensor path, artifact by artifact
    called.clear()
    whole = policy.run(exported, samples)
    ones = [policy.run(exported, samples[i : i + 1]) for i in range(len(samples))]
    assert called == []
    assert len(set(expected.exits.tolist())) >= 3  # samples leave at several exits
    assert torch.equal(whole.exits, expected.exits) and torch.equal(whole.predictions, expected.predictions)
    assert whole.logits.dtype == torch.float32 and torch.allclose(whole.logits, expected.logits, atol=1e-5)
    assert torch.equal(torch.cat([o.exits for o in ones]), expected.exits)
    assert torch.equal(torch.cat([o.predictions for o in ones]), expected.predictions)
    assert torch.allclose(torch.cat([o.logits for o in ones]), expected.logits, atol=1e-5)
    arrays = program(samples.numpy().astype("float64"))  # any float array: cast to the graph's input type
    assert arrays.exits.tolist() == expected.exits.tolist()


def test_a_compiled_policy_skips_heads_nobody_leaves_at_and_leaves_other_policies_to_the_tensor_path(tmp_path):
    from anytime.calibrate import ExitPolicy

    model = _families()["exits"].eval()
    exported = _export(model, "onnx", tmp_path / "export")
    samples = torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(6))
    policy = _policy_at_medians(exported, samples, "entropy")
    gaps = ExitPolicy("entropy", (None, policy.thresholds[1]))
    with torch.inference_mode():
        expected = gaps._run(exported, samples)
    out = gaps.run(exported, samples)
    assert set(out.exits.tolist()) == {1, 2} and torch.equal(out.exits, expected.exits)
    assert exported.exit_program(ExitPolicy("patience", (1.0, 1.0))) is None
    combining = ExitPolicy("entropy", (0.5, 0.5), combine=((1.0,), (0.5, 0.5), (0.3, 0.3, 0.4)))
    assert exported.exit_program(combining) is None
    assert _export(model, "pt2", tmp_path / "pt2").exit_program(policy) is None
    plain = _export(_families()["plain"].eval(), "onnx", tmp_path / "plain")
    alone = plain.exit_program(ExitPolicy("entropy", ()))
    assert alone is not None
    with torch.no_grad():
        assert alone(samples.numpy()).predictions.tolist() == plain(samples).argmax(1).tolist()
    with pytest.raises(AnytimeError, match="this policy is for 2 exits; the model has 3 exits"):
        exported.exit_program(ExitPolicy("entropy", (0.5,)))


@pytest.mark.parametrize("alone_is_faster", [True, False])
def test_a_batch_of_one_runs_each_graph_on_one_thread_where_that_measured_faster(
    alone_is_faster, tmp_path, monkeypatch
):
    from anytime.calibrate import ExitPolicy

    _export(_families()["exits"], "onnx", tmp_path / "export")
    exported = load_export(tmp_path / "export", threads=2)
    monkeypatch.setattr("anytime.deploy.exit_program._faster_alone", lambda *args: alone_is_faster)
    samples = torch.randn(10, *SHAPE, generator=torch.Generator().manual_seed(9))
    policy = _policy_at_medians(exported, samples, "confidence")
    program = exported.exit_program(policy)
    assert program is not None
    for graph in program._graphs:
        assert (graph.one is not graph.session) == alone_is_faster
    with torch.inference_mode():
        expected = policy._run(exported, samples)
    assert [int(policy.run(exported, samples[i : i + 1]).exits) for i in range(10)] == expected.exits.tolist()
    single = load_export(tmp_path / "export", threads=1).exit_program(ExitPolicy("entropy", (None, None)))
    assert single is not None and all(graph.one is graph.session for graph in single._graphs)  # nothing to choose


def test_the_thread_choice_compares_medians_of_interleaved_runs():
    from anytime.deploy.exit_program import _TRIALS, _faster_alone

    class Session:
        def __init__(self, cost: float) -> None:
            self.cost, self.calls = cost, 0

        def run(self, outputs: object, feed: dict) -> None:
            assert feed["x"].shape == (1, 3, 8, 8)
            self.calls += 1
            now[0] += self.cost

    now = [0.0]
    for threaded_cost, single_cost, expected in ((2e-4, 1e-4, True), (1e-4, 2e-4, False)):
        threaded, single = Session(threaded_cost), Session(single_cost)
        assert _faster_alone(threaded, single, "x", (3, 8, 8), float, clock=lambda: now[0]) is expected
        assert threaded.calls == single.calls == _TRIALS + 2  # two warm-up runs each
    threaded, single = Session(2.5e-3), Session(4e-3)  # a large graph: threads kept, no trials
    assert _faster_alone(threaded, single, "x", (3, 8, 8), float, clock=lambda: now[0]) is False
    assert threaded.calls == single.calls == 2


def test_a_policy_onnx_cannot_take_runs_apart_and_a_changed_artifact_is_refused(tmp_path, monkeypatch):
    exported = _export(_families()["exits"], "onnx", tmp_path / "export")
    samples = torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(5))
    policy = _policy_at_medians(exported, samples, "entropy")

    def refuse(*args: object) -> bytes:
        raise ValueError("other IR versions")

    monkeypatch.setattr("anytime.deploy.exit_program._answering", refuse)
    assert exported.exit_program(policy) is None
    with torch.inference_mode():
        expected = policy._run(exported, samples)
    assert torch.equal(policy.run(exported, samples).exits, expected.exits)
    monkeypatch.undo()
    head = tmp_path / "export" / exported.manifest.parts[3].file
    head.write_bytes(head.read_bytes() + b"\0")
    with pytest.raises(AnytimeError, match="changed since the export was loaded"):
        exported.exit_program(policy.__class__("confidence", (0.5, 0.5)))


def test_adaptive_poolings_export_as_plain_poolings_or_two_products_and_answer_the_same(tmp_path):
    import onnx

    class Pools(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.odd = nn.AdaptiveAvgPool2d(4)  # on 15x15: windows of 4, 5, 5 and 4, overlapping
            self.even = nn.AdaptiveAvgPool2d((2, None))  # on 8x8 -> 2x8: plain 4x1 windows
            self.head = nn.Linear(8 * 16 + 8 * 16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            odd = self.odd(h[..., :15, :15])
            even = self.even(h[..., :8, :8])
            return self.head(torch.cat([odd.flatten(1), even.flatten(1)], dim=1))

    model = Pools().eval()
    exported = _export(model, "onnx", tmp_path / "export", (3, 16, 16))
    ops = [node.op_type for node in onnx.load(str(tmp_path / "export" / exported.manifest.parts[0].file)).graph.node]
    assert "Gather" not in ops and ops.count("AveragePool") == 1 and ops.count("MatMul") == 2
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(exported(x), model(x), atol=1e-5)
    assert isinstance(model.odd, nn.AdaptiveAvgPool2d)  # the model itself is untouched
    calibration = [torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))]
    quantized = _export(model, "onnx", tmp_path / "int8", (3, 16, 16), precision="int8", calibration=calibration)
    ops = [node.op_type for node in onnx.load(str(tmp_path / "int8" / quantized.manifest.parts[0].file)).graph.node]
    assert ops.count("AveragePool") == 1 and ops.count("MatMul") == 0  # no pooling matrices for the quantizer to round
    from anytime.deploy.inference import (  # a head the fold form fused is unfused to export
        InferenceForm,
        inference_form,
    )

    head = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 10)).eval()
    folded = inference_form(head, InferenceForm(fold=True))
    assert type(folded[1]).__name__ == "PooledLinear"
    exported = _export(folded, "onnx", tmp_path / "folded", (3, 16, 16))
    ops = [node.op_type for node in onnx.load(str(tmp_path / "folded" / exported.manifest.parts[0].file)).graph.node]
    assert "Gather" not in ops and ops.count("MatMul") == 2  # 14x14 -> 4: the window matrices
    with torch.no_grad():
        assert torch.allclose(exported(x), head(x), atol=1e-5)


def test_converted_parts_wrap_their_segments_and_heads_once(tmp_path):
    exported = _export(_families()["exits"], "pt2", tmp_path / "export")
    keys = set(exported.state_dict())
    assert exported.segments[0] is exported.segments[0] and exported.heads[0] is exported.heads[0]
    assert set(exported.state_dict()) == keys  # the wrappers are not registered as more modules


class _Wide(nn.Module):
    """Weights dominate the file: two 1024x1024 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_int8_artifacts_store_int8_weights(fmt, tmp_path):
    torch.manual_seed(0)
    model = _Wide().eval()
    calibration = [torch.randn(32, 256) for _ in range(2)]
    fp32 = _export(model, fmt, tmp_path / "fp32", (256,))
    int8 = _export(model, fmt, tmp_path / "int8", (256,), precision="int8", calibration=calibration)
    ratio = fp32.manifest.bytes / int8.manifest.bytes
    assert ratio >= 3.5, f"{fmt}: the int8 artifact is only {ratio:.2f}x smaller"
    x = torch.randn(64, 256)
    with torch.no_grad():
        agree = (int8(x).argmax(1) == model(x).argmax(1)).float().mean().item()
    assert agree >= 0.9


def test_onnx_artifacts_carry_no_module_paths_and_a_small_int8_network_is_still_3_5x_smaller(tmp_path):
    import onnx

    model = _families("resnet20")["exits"].eval()  # 0.27 M weights, where names weigh most
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    fp32 = _export(model, "onnx", tmp_path / "fp32")
    int8 = _export(model, "onnx", tmp_path / "int8", precision="int8", calibration=calibration)
    ratio = fp32.manifest.bytes / int8.manifest.bytes
    assert ratio >= 3.5, f"the int8 ONNX artifacts are only {ratio:.2f}x smaller"
    graph = onnx.load(str(tmp_path / "int8" / int8.manifest.parts[-1].file)).graph
    onnx.checker.check_model(onnx.load(str(tmp_path / "int8" / int8.manifest.parts[-1].file)), full_check=True)
    assert [v.name for v in graph.input] == ["input"] and [v.name for v in graph.output] == ["output"]
    assert not any(node.name for node in graph.node) and not graph.value_info
    assert max(len(name) for node in graph.node for name in (*node.input, *node.output)) <= 10


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_pt2_artifacts_store_16_bit_weights_and_answer_in_fp32(precision, tmp_path):
    torch.manual_seed(0)
    model = _Wide().eval()
    fp32 = _export(model, "pt2", tmp_path / "fp32", (256,))
    half = _export(model, "pt2", tmp_path / precision, (256,), precision=precision)
    ratio = fp32.manifest.bytes / half.manifest.bytes
    assert 1.9 <= ratio <= 2.1, f"{precision}: the artifact is {ratio:.2f}x smaller than fp32"
    x = torch.randn(16, 256)
    with torch.no_grad():
        out, reference = half(x), model(x)
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)
    assert next(iter(model.parameters())).dtype == torch.float32  # exporting never casts the caller's model


def test_pt2_archives_deflate_their_graph_and_hold_no_example_inputs(tmp_path):
    exported = _export(_Wide().eval(), "pt2", tmp_path / "fp32", (256,))
    with zipfile.ZipFile(tmp_path / "fp32" / exported.manifest.parts[0].file) as archive:
        entries = archive.infolist()
    assert all(e.file_size == 0 for e in entries if "sample_inputs" in e.filename)
    assert all(e.compress_type == zipfile.ZIP_DEFLATED for e in entries if e.filename.endswith(".json"))
    assert all(e.compress_type == zipfile.ZIP_STORED for e in entries if "/weights/weight_" in e.filename)


@pytest.fixture(scope="module")
def exported_run(exit_run, tmp_path_factory):
    """The trained multi-exit digits run exported as ONNX int8 (quantized by ONNX Runtime), with its parity table."""
    out = tmp_path_factory.mktemp("exported") / "onnx-int8"
    return exit_run, export_run(exit_run, "onnx", ParitySettings(images=200, latency_images=5),
                                Int8Settings(calibration_images=128), precision="int8", out=out)  # fmt: skip


def test_export_of_a_run_writes_manifest_and_parity_table(exported_run):
    run, report = exported_run
    manifest = read_manifest(report.out)
    assert manifest == report.manifest and manifest.precision == "int8" and manifest.calibration_images == 128
    assert manifest.parent_run == str(run) and manifest.quantizer and manifest.versions["onnxruntime"]
    assert [r.step for r in report.parity] == list(range(manifest.num_steps))
    for row in report.parity:
        assert row.images == 200 and row.top1_agreement >= 0.9 and row.max_abs_err > 0
        assert (
            row.eager_p50_ms > 0
            and row.artifact_images_per_s > 0
            and row.input_shape == "x".join(map(str, manifest.input_shape))
        )
    table = (report.out / "parity.csv").read_text().splitlines()
    assert (
        table[0].startswith("step,dtype,input_shape,images,max_abs_err,top1_agreement")
        and len(table) == 1 + manifest.num_steps
    )


def test_fp32_export_of_a_run_agrees_with_eager_on_test_images(exit_run, tmp_path, capsys):
    out = tmp_path / "pt2"
    assert main(["export", str(exit_run), "--format", "pt2", "--out", str(out), "--parity-images", "100"]) == 0
    printed = capsys.readouterr().out
    assert "top-1 agree" in printed and "100.00%" in printed and "segment0.pt2" in printed
    rows = json.loads((out / "parity.json").read_text())["rows"]
    assert all(r["top1_agreement"] == 1.0 and r["max_abs_err"] < 1e-4 for r in rows)
    assert main(["profile", str(out), "--batch-sizes", "1,2", "--repeats", "5", "--warmup", "1", "--no-memory"]) == 0
    profile = json.loads(next(out.glob("profile-*.json")).read_text())
    assert profile["model_fingerprint"] == read_manifest(out).fingerprint and "pt2 fp32" in profile["model"]


def test_damaged_or_foreign_exports_are_refused_in_one_line(exported_run, tmp_path, cli_error):
    _, report = exported_run
    for damage, words in (("truncate", ("bytes but the manifest says",)), ("edit", ("checksum",)),
                          ("remove", ("missing",)), ("manifest", ("fingerprint does not match",)),
                          ("garbage", ("not readable JSON",))):  # fmt: skip
        copy = tmp_path / damage
        shutil.copytree(report.out, copy)
        first = copy / report.manifest.parts[0].file
        if damage == "truncate":
            first.write_bytes(first.read_bytes()[:100])
        elif damage == "edit":
            data = bytearray(first.read_bytes())
            data[-1] ^= 0xFF
            first.write_bytes(bytes(data))
        elif damage == "remove":
            first.unlink()
        elif damage == "manifest":
            doc = json.loads((copy / MANIFEST).read_text())
            doc["parts"][0]["sha256"] = "0" * 64
            doc["parts"][0]["file"], doc["parts"][1]["file"] = doc["parts"][1]["file"], doc["parts"][0]["file"]
            (copy / MANIFEST).write_text(json.dumps(doc))
        else:
            (copy / MANIFEST).write_text("{not json")
        with pytest.raises(AnytimeError) as raised:
            load_export(copy)
        assert all(w in str(raised.value) for w in words) and "\n" not in str(raised.value), str(raised.value)
        cli_error(["profile", str(copy), "--no-memory"], *words)


def test_a_pt2_archive_with_pickled_payloads_is_refused_before_loading(tmp_path):
    exported = _export(_families()["plain"], "pt2", tmp_path / "export")
    path = tmp_path / "export" / exported.manifest.parts[0].file
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    config = next(name for name in entries if name.endswith("weights_config.json"))
    doc = json.loads(entries[config])
    next(iter(doc["config"].values()))["use_pickle"] = True
    entries[config] = json.dumps(doc).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    manifest = json.loads((tmp_path / "export" / MANIFEST).read_text())
    manifest["parts"][0].update(bytes=path.stat().st_size, sha256=sha256_of(path))
    manifest.pop("fingerprint")
    (tmp_path / "export" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(AnytimeError, match="pickled objects"):
        load_export(tmp_path / "export")


def test_export_refuses_bad_requests_in_one_line(exit_run, exported_run, tmp_path, cli_error, monkeypatch):
    cli_error(
        ["export", str(tmp_path / "nothing"), "--format", "pt2", "--out", str(tmp_path / "e")], "no run directory"
    )
    cli_error(["export", str(exit_run), "--format", "onnx", "--precision", "bf16", "--out", str(tmp_path / "e")],
              "onnx artifacts are exported at fp32, int8")  # fmt: skip
    _, report = exported_run
    cli_error(["export", str(exit_run), "--format", "onnx", "--precision", "int8", "--out", str(report.out)],
              "--overwrite")  # fmt: skip
    cli_error(["export", str(exit_run), "--format", "pt2", "--out", str(tmp_path / "no" / "e")], "does not exist")
    cli_error(["profile", str(report.out), "--train"], "export")
    cli_error(["profile", str(report.out), "--no-memory", "--device", "cuda"], "cuda")
    import builtins

    real_import = builtins.__import__

    def without_onnxruntime(name, *args, **kwargs):
        if name.split(".")[0] in ("onnxruntime", "onnx"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_onnxruntime)
    cli_error(["profile", str(report.out), "--no-memory"], "pip install 'anytime[deploy]'")
    cli_error(
        ["export", str(exit_run), "--format", "onnx", "--out", str(tmp_path / "e")], "pip install 'anytime[deploy]'"
    )
    assert not (tmp_path / "e").exists()


def test_a_converted_run_exports_at_its_own_precision(exit_run, tmp_path, cli_error):
    from anytime.tasks.quantize import QuantizeSettings, quantize_run

    parent = tmp_path / "run"
    shutil.copytree(exit_run, parent)
    quantize_run(parent, "int8", QuantizeSettings(compile=False), Int8Settings(calibration_images=64))
    qrun = tmp_path / "run-int8"
    cli_error(["export", str(qrun), "--format", "pt2", "--precision", "fp32", "--out", str(tmp_path / "e")], "int8 run")
    report = export_run(qrun, "pt2", ParitySettings(images=64, latency_images=3), out=tmp_path / "e")
    assert report.manifest.precision == "int8" and report.manifest.calibration_images == 64
    from anytime.train.runs import load_run

    quantized = load_run(qrun).model
    x = torch.randn(4, *report.manifest.input_shape)
    exported = load_export(report.out, lower=False)  # the reference graphs: the same arithmetic as the run's
    with torch.no_grad():
        assert torch.allclose(exported(x), quantized(x), atol=1e-5)


def test_trtexec_timings_become_a_profile_of_the_export(exported_run, tmp_path, capsys, cli_error):
    _, report = exported_run
    times = tmp_path / "times"
    times.mkdir()
    manifest = report.manifest
    for i, part in enumerate(manifest.parts):  # what trtexec --exportTimes writes: one record per inference
        records = [{"startComputeMs": 0.0, "latencyMs": 1.0 + i + 0.01 * j, "computeMs": 0.5} for j in range(120)]
        (times / f"{Path(part.file).stem}.json").write_text(json.dumps(records))
    out = tmp_path / "board.json"
    assert main(["profile", str(report.out), "--trtexec-times", str(times), "--device-label", "Jetson Orin Nano",
                 "--engine-precision", "fp16", "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    from anytime.profile import DeviceProfile

    profile = DeviceProfile.load(out, fingerprint=manifest.fingerprint, num_steps=manifest.num_steps)
    assert profile.device["label"] == "Jetson Orin Nano" and profile.settings["precision"]["precision"] == "fp16"
    assert profile.incremental and profile.model_bytes == manifest.bytes
    # exit 0 = segment 0 (part 0) + head 0 (part 1); exit 1 adds segment 1 (part 2) and head 1 (part 3)
    assert profile.step_quantile(0, 0.5) == pytest.approx(1.0 + 2.0 + 0.02 * 59, abs=0.03)
    assert profile.step_quantile(1, 0.5) == pytest.approx(1.0 + 3.0 + 4.0 + 0.03 * 59, abs=0.05)
    (times / f"{Path(manifest.parts[0].file).stem}.json").write_text("[{}]")
    cli_error(
        ["profile", str(report.out), "--trtexec-times", str(times), "--out", str(tmp_path / "b2.json")], "exportTimes"
    )
    cli_error(["profile", str(report.out), "--trtexec-times", str(tmp_path / "none"), "--out", str(tmp_path / "b3.json")],
              "missing")  # fmt: skip


def test_int8_ranges_are_7_bit_only_on_an_x86_cpu_without_vnni(monkeypatch):
    from anytime.precision import int8, model

    monkeypatch.setattr(model.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert int8.x86_without_vnni() and model.backend_for("int8", torch.device("cpu")) == model.X86_7BIT
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    assert not int8.x86_without_vnni() and model.backend_for("int8", torch.device("cpu")) == model.X86_FULL
    monkeypatch.setattr(model.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert not int8.x86_without_vnni()


def test_int8_onnx_artifacts_leave_the_layers_named_in_float(tmp_path):
    import onnx

    from anytime.precision.int8 import quantizable_layers

    model = _families()["plain"].eval()
    first = quantizable_layers(model)[0]
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(6)) for _ in range(2)]
    for name, layers in (("all", ()), ("kept", (first,))):
        folder = tmp_path / name
        folder.mkdir()
        manifest = export_model(model, "onnx", "int8", folder, input_shape=SHAPE, labels=ManifestLabels("resnet20", 10),
                                int8=Int8Recipe(calibration=calibration, float_layers=layers))  # fmt: skip
        assert manifest.float_layers == layers and read_manifest(folder).float_layers == layers
        graph = onnx.load(str(folder / manifest.parts[0].file)).graph
        made_by = {output: node for node in graph.node for output in node.output}
        first_conv = next(node for node in graph.node if node.op_type == "Conv")
        weight_from = made_by.get(first_conv.input[1])
        assert (weight_from is not None and weight_from.op_type == "DequantizeLinear") == (name == "all")
        # as in PT2E, the float layer's output stays float (through its ReLU) until a quantized layer reads it
        after = [node.op_type for node in graph.node if first_conv.output[0] in node.input]
        assert after == (["QuantizeLinear"] if name == "all" else ["Relu"])
    with pytest.raises(AnytimeError, match="no convolution or linear layer named"):
        export_model(model, "onnx", "int8", tmp_path / "all", input_shape=SHAPE, labels=ManifestLabels("resnet20", 10),
                     int8=Int8Recipe(calibration=calibration, float_layers=("nope",)))  # fmt: skip


def test_int8_pt2_artifacts_leave_the_layers_named_in_float(tmp_path):
    from anytime.precision.int8 import quantizable_layers

    def int8_weights(folder: Path, manifest) -> int:
        graph = torch.export.load(str(folder / manifest.parts[0].file)).graph
        layers = (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default)
        return sum(node.target in layers and "dequantize" in str(getattr(node.args[1], "target", ""))
                   for node in graph.nodes)  # fmt: skip

    model = _families()["plain"].eval()
    first = quantizable_layers(model)[0]
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(6))]
    counts = {}
    for name, layers in (("all", ()), ("kept", (first,))):
        folder = tmp_path / name
        folder.mkdir()
        manifest = export_model(model, "pt2", "int8", folder, input_shape=SHAPE, labels=ManifestLabels("resnet20", 10),
                                int8=Int8Recipe(calibration=calibration, float_layers=layers))  # fmt: skip
        assert read_manifest(folder).float_layers == layers
        counts[name] = int8_weights(folder, manifest)
    assert counts["all"] == len(quantizable_layers(model)) and counts["kept"] == counts["all"] - 1


def test_the_pooling_that_only_a_float_layer_reads_stays_float_in_int8_onnx(tmp_path):
    import onnx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(32, 10)).eval()  # fmt: skip
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(8))]
    for layers in ((), ("4",)):
        folder = tmp_path / ("kept" if layers else "all")
        folder.mkdir()
        manifest = export_model(model, "onnx", "int8", folder, input_shape=SHAPE, labels=ManifestLabels("head", 10),
                                int8=Int8Recipe(calibration=calibration, float_layers=layers))  # fmt: skip
        graph = onnx.load(str(folder / manifest.parts[0].file)).graph
        made_by = {output: node.op_type for node in graph.node for output in node.output}
        pool = next(n for n in graph.node if n.op_type in ("AveragePool", "GlobalAveragePool", "ReduceMean"))
        gemm = next(n for n in graph.node if n.op_type in ("Gemm", "MatMul"))
        rounded = [made_by.get(pool.input[0]) == "DequantizeLinear", made_by.get(gemm.input[0]) == "DequantizeLinear"]
        assert rounded == ([True, True] if not layers else [False, False])


class _Scaled(nn.Module):
    """A classifier whose logits are scaled after the linear layer, as the fast CIFAR card's are."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(32, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * 0.125


def test_int8_onnx_answers_with_logits_that_are_not_rounded(tmp_path):
    # Rounding the logits to 256 levels swaps near-tied classes; the linear layer keeps int8 weights.
    import onnx

    torch.manual_seed(0)
    model = _Scaled().eval()
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(9))]
    int8 = _export(model, "onnx", tmp_path / "int8", precision="int8", calibration=calibration)
    graph = onnx.load(str(tmp_path / "int8" / int8.manifest.parts[0].file)).graph
    made_by = {output: node for node in graph.node for output in node.output}
    gemm = next(n for n in graph.node if n.op_type in ("Gemm", "MatMul"))
    assert made_by[graph.output[0].name].op_type == "Mul" and made_by[gemm.output[0]].op_type in ("Gemm", "MatMul")
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in gemm.output for n in graph.node)
    weight = made_by[gemm.input[1]]
    assert weight.op_type == "DequantizeLinear"
    assert any(t.name == weight.input[0] and t.data_type == onnx.TensorProto.INT8 for t in graph.initializer)
    x = torch.randn(64, *SHAPE, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        reference = model(x)
    logits = int8.forward_until(x, 0)
    # unrounded logits take (nearly) as many values as the batch has entries; 256 levels could not
    assert logits.unique().numel() > 256 and torch.allclose(logits, reference, atol=0.2)


def test_int8_export_chooses_the_layers_kept_in_float_for_its_own_quantizer(exit_run, tmp_path, capsys, cli_error):
    from anytime.tasks.export import TUNING, _compare
    from anytime.tasks.quantize import tuning_images
    from anytime.train.runs import load_run

    out = tmp_path / "tuned"
    assert main(["export", str(exit_run), "--format", "onnx", "--precision", "int8", "--calibration-images", "64",
                 "--min-agreement", "1.0", "--max-float-layers", "1", "--agreement-images", "100",
                 "--parity-images", "0", "--out", str(out)]) == 0  # fmt: skip
    assert "agreement with the float run on 100 validation images" in capsys.readouterr().out
    tuning = json.loads((out / TUNING).read_text())
    assert tuning["images"] == 100 and 1 <= len(tuning["tried"]) <= 2 and len(tuning["ranking"]) > 1
    best = max(tuning["tried"], key=lambda t: t["min_agreement"])
    assert read_manifest(out).float_layers == tuple(tuning["float_layers"]) == tuple(best["float_layers"])
    # what was measured is what was written: the artifacts agree with the float run as the search recorded
    run = load_run(exit_run, "cpu", converted=False)
    images, exported = tuning_images(run, 100), load_export(out)
    measured = [_compare(run.model.eval(), exported, images, k)[1] for k in range(exported.manifest.num_steps)]
    assert measured == pytest.approx(tuning["agreement"]) and min(measured) == pytest.approx(best["min_agreement"])
    for argv, message in (
        (["--precision", "fp32", "--min-agreement", "0.99"], "for int8 from a float run"),
        (["--precision", "int8", "--min-agreement", "1.5"], "(0, 1]"),
        (["--precision", "int8", "--min-agreement", "0.9", "--float-layers", "a"], "give one"),
    ):  # fmt: skip
        cli_error(["export", str(exit_run), "--format", "onnx", *argv, "--out", str(tmp_path / "e")], message)
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory) -> Path:
    """A LeNet trained for 2 epochs on the digits: one graph per export, for the export's own options."""
    from anytime.train import TrainConfig, Trainer

    run = tmp_path_factory.mktemp("lenet-run") / "run"
    Trainer(TrainConfig(model="lenet", data="digits", epochs=2, batch_size=64, lr=0.05, device="cpu"), run).fit()
    return run


def test_a_size_ratio_bounds_the_weights_the_search_keeps_in_float(lenet_run, tmp_path, cli_error):
    from anytime.precision.int8 import quantizable_layers
    from anytime.tasks.export import TUNING
    from anytime.train.runs import load_run

    model = load_run(lenet_run, "cpu", converted=False).model.eval()
    modules = dict(model.named_modules())
    sizes = {name: modules[name].weight.numel() for name in quantizable_layers(model)}
    largest = max(sizes, key=sizes.__getitem__)
    common = ["--format", "onnx", "--precision", "int8", "--calibration-images", "64", "--parity-images", "0"]
    plain = tmp_path / "plain"
    assert main(["export", str(lenet_run), *common, "--out", str(plain)]) == 0
    fp32 = ["--precision", "fp32", "--parity-images", "0", "--out", str(tmp_path / "fp32")]
    assert main(["export", str(lenet_run), *common[:2], *fp32]) == 0
    fp32_bytes, int8_bytes = read_manifest(tmp_path / "fp32").bytes, read_manifest(plain).bytes
    # a ratio whose budget leaves every layer but the largest free to stay float
    ratio = fp32_bytes / (int8_bytes + 3 * (sizes[largest] - 1))
    out = tmp_path / "tuned"
    assert main(["export", str(lenet_run), *common, "--min-agreement", "1.0", "--max-float-layers", "2",
                 "--agreement-images", "50", "--min-size-ratio", f"{ratio:.6f}", "--out", str(out)]) == 0  # fmt: skip
    tuning = json.loads((out / TUNING).read_text())
    assert tuning["max_float_weights"] == pytest.approx(sizes[largest] - 1, abs=1)
    assert largest not in tuning["float_layers"]
    assert tuning["float_weights"] == sum(sizes[name] for name in tuning["float_layers"]) <= tuning["max_float_weights"]
    assert fp32_bytes / read_manifest(out).bytes >= ratio
    tuned = ["--precision", "int8", "--min-agreement", "0.9", "--out", str(tmp_path / "e")]
    cli_error(["export", str(lenet_run), *common[:2], *tuned, "--min-size-ratio", "1"], "above 1")
    cli_error(["export", str(lenet_run), *common[:2], *tuned[:2], "--min-size-ratio", "3", "--out",
               str(tmp_path / "e")], "give --min-agreement too")  # fmt: skip
    cli_error(["export", str(lenet_run), *common, "--min-agreement", "0.9", "--min-size-ratio", "4.5",
               "--out", str(tmp_path / "e")], "below --min-size-ratio 4.5")  # fmt: skip
    assert not (tmp_path / "e").exists()


def test_a_network_ending_in_a_global_max_pool_quantizes_to_int8_onnx(tmp_path):
    # The exporter writes the pool as ReduceMax with its axes as an input, which ONNX Runtime's symbolic shape
    # inference cannot follow into the Reshape after it; the fast CIFAR card ends this way.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).eval()  # fmt: skip
    calibration = [torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(7))]
    int8 = _export(model, "onnx", tmp_path / "int8", precision="int8", calibration=calibration)
    x = torch.randn(32, *SHAPE)
    with torch.no_grad():
        assert (int8(x).argmax(1) == model(x).argmax(1)).float().mean() >= 0.9
