"""Deployable artifacts of a model's steps: ``torch.export`` programs (``.pt2``) or ONNX graphs, one per step
(one per segment and per exit head of a multi-exit model, so a deployed early exit still skips the rest),
a manifest that names, sizes and checksums them (:mod:`anytime.deploy.manifest`), and a loader that never executes
pickled code (:mod:`anytime.deploy.loader`); the ONNX graphs are written by :mod:`anytime.deploy.onnx_export`.

int8 ``.pt2`` artifacts hold the PT2E graph (int8 weights, quantize/dequantize around each kernel) and are
lowered to oneDNN's int8 kernels when loaded on an x86 CPU; int8 ONNX artifacts are quantized by ONNX
Runtime's ``quantize_static`` (QDQ, int8 weights per channel, uint8 activations) calibrated on the same
training images, and run through ONNX Runtime's execution providers.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from anytime.contract import step_count
from anytime.deploy.manifest import (
    ARTIFACT_DTYPES,
    MANIFEST,
    ArtifactPart,
    ExportManifest,
    check_exportable,
    dynamic_batch,
)
from anytime.deploy.onnx_export import export_onnx, normalised_by, quantize_onnx
from anytime.deploy.runtimes import sha256_of
from anytime.errors import AnytimeError, first_line
from anytime.precision.int8 import x86_without_vnni
from anytime.precision.model import X86_7BIT, Int8Recipe


def _roles(layout: str, count: int) -> list[tuple[str, int]]:
    if layout == "exits":
        return [("segment" if i % 2 == 0 else "head", i // 2) for i in range(count)]
    if layout == "steps":
        return [("step", i) for i in range(count)]
    return [("model", 0)]


def _without_unused_state(part: nn.Module) -> nn.Module:
    """A converted int8 graph keeps the float weights it no longer reads (the int8 copies replaced them);
    ``torch.export`` would store them all, so an int8 artifact would be no smaller than the float one."""
    if not isinstance(part, torch.fx.GraphModule):
        return part
    used = {str(node.target) for node in part.graph.nodes if node.op == "get_attr"}
    for name, _ in [*part.named_parameters(), *part.named_buffers()]:
        if name not in used:
            owner, _, attr = name.rpartition(".")
            delattr(part.get_submodule(owner) if owner else part, attr)
    return part


_DEBUG_META = ("stack_trace", "from_node", "source_fn_stack", "nn_module_stack", "torch_fn", "custom")


def _export_pt2(part: nn.Module, example: Tensor, path: Path, what: str) -> None:
    try:
        with torch.no_grad():
            program = torch.export.export(_without_unused_state(part), (example,), dynamic_shapes=dynamic_batch())
        for node in program.graph.nodes:  # where each node came from in the Python source: a third of the file
            for key in _DEBUG_META:
                node.meta.pop(key, None)
        program.example_inputs = None  # a pickled tensor: the manifest names the input shape instead
        torch.export.save(program, str(path))
    except Exception as exc:  # noqa: BLE001  torch.export fails in many ways; name the part and the first line
        raise AnytimeError(f"{what} cannot be exported as a .pt2 program ({first_line(exc)})") from None
    _deflate_descriptions(path)


def _deflate_descriptions(path: Path) -> None:
    """Compress the archive's JSON entries (the graph and the weights' table), which torch stores uncompressed.

    For a small int8 network the graph's description is as large as its int8 weights (ResNet-20: 155 KB of
    JSON beside 275 KB of weights); deflated it is a tenth of that. Weights stay stored, aligned, as written.
    """
    staged = path.with_name(f".{path.name}.deflating")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(staged, "w") as target:
        for info in source.infolist():
            packed = zipfile.ZIP_DEFLATED if info.filename.endswith(".json") else zipfile.ZIP_STORED
            target.writestr(info, source.read(info), compress_type=packed)
    os.replace(staged, path)


def _write_artifacts(
    parts: Sequence[nn.Module], examples: Sequence[Tensor], *, layout: str, fmt: str, folder: Path,
    calibration: Sequence[Sequence[Tensor]] | None = None, float_names: Sequence[Sequence[str]] = (),
) -> list[ArtifactPart]:  # fmt: skip
    """Write one artifact per part into ``folder`` and describe them. ``examples`` are each part's input
    (a small batch, in the part's dtype); for int8 ONNX artifacts ``parts`` are float, ``calibration`` holds
    each part's inputs on the calibration images (training images only) and ``float_names`` each part's
    modules left in float."""
    written = []
    roles = _roles(layout, len(parts))
    for i, (part, example, (role, step)) in enumerate(zip(parts, examples, roles)):
        name = f"model.{fmt}" if role == "model" else f"{role}{step}.{fmt}"
        path = folder / name
        what = {"segment": f"segment {step}", "head": f"exit head {step}", "step": f"step {step}"}.get(
            role, "the model"
        )
        if not isinstance(part, torch.fx.GraphModule):
            part.eval()  # a multi-exit model's segments are fresh containers, in training mode until told
        if fmt == "pt2":
            _export_pt2(part, example, path, what)
        elif calibration is None:
            export_onnx(part, example, path, what)
        else:
            float_path = path.with_name(path.stem + ".float.onnx")
            export_onnx(part, example, float_path, what, to_quantize=True)
            kept = float_names[i] if float_names else ()
            # every part answers logits but a segment with a head after it (MSDNet's segments answer a 2-D tensor too)
            logits = role != "segment" or i == len(parts) - 1
            quantize_onnx(float_path, path, [b.detach().float().numpy() for b in calibration[i]], what, kept,
                          normalised_by(part, example) if kept else None, logits=logits)  # fmt: skip
        with torch.no_grad():
            output = part(example)
        written.append(ArtifactPart(name, role, step, tuple(example.shape[1:]), tuple(output.shape[1:]),
                                    path.stat().st_size, sha256_of(path)))  # fmt: skip
    return written


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {"torch": torch.__version__}
    for package in ("torchao", "onnx", "onnxruntime"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


@dataclass(frozen=True)
class ManifestLabels:
    """What an export's manifest records of the model beside its artifacts: its ``name`` and ``num_classes``, the
    run it came from (``parent_run``, its folder, and ``parent_fingerprint``, its weights' fingerprint; empty for a
    model exported without a run) and, int8 only, how many training images calibrated it
    (``calibration_images``)."""

    name: str
    num_classes: int
    parent_run: str = ""
    parent_fingerprint: str = ""
    calibration_images: int | None = None


def export_model(
    model: nn.Module, fmt: str, precision: str, folder: Path, *, input_shape: tuple[int, ...],
    labels: ManifestLabels, int8: Int8Recipe | None = None,
) -> ExportManifest:  # fmt: skip
    """Write a float model's steps (eval mode, on the CPU) as ``fmt`` artifacts at ``precision`` into the existing
    ``folder``, with the manifest (``labels`` name the model and where it came from); return it. int8 is built from
    ``int8``: ``calibration`` batches (training images) or, for ``.pt2``, the ``state`` of an earlier conversion
    (``qat``: of quantization-aware training); it keeps ``float_layers`` (names in ``model``) in float."""
    from anytime.precision.int8 import layers_per_part
    from anytime.precision.model import convert, float_flops
    from anytime.precision.parts import float_parts, layout_of, part_inputs

    recipe = int8 or Int8Recipe()
    check_exportable(fmt, precision)
    model = model.eval()
    layout = layout_of(model)
    floats = float_parts(model)
    dtype = ARTIFACT_DTYPES[precision]
    with torch.no_grad():
        examples = [x.to(dtype) for x in part_inputs(layout, floats, torch.zeros(2, *input_shape))]
    parts: list[nn.Module] = floats
    per_part: list[list[Tensor]] | None = None
    backend = recipe.backend
    if precision in ("bf16", "fp16"):  # a cast: exporting traces it, so fp16 exports on a CPU too
        parts = [copy.deepcopy(part).to(dtype) for part in floats]
    elif precision == "int8" and fmt == "pt2":
        converted, _ = convert(model, "int8", input_shape=input_shape, int8=recipe, compile=False)
        parts = list(converted.parts)
        backend = converted.spec.backend
    elif precision == "int8":
        if recipe.qat:
            raise AnytimeError("a model fine-tuned for int8 (QAT) exports as pt2: ONNX int8 artifacts are quantized by "
                               "ONNX Runtime from float weights, which would drop the fine-tuning")  # fmt: skip
        per_part = [[] for _ in floats]
        with torch.no_grad():
            for x in recipe.calibration or ():
                for i, inputs in enumerate(part_inputs(layout, floats, x)):
                    per_part[i].append(inputs)
        if not per_part[0]:
            raise AnytimeError("int8 ONNX artifacts need calibration images from the training split")
    float_names = layers_per_part(model, floats, recipe.float_layers) if precision == "int8" else []
    written = _write_artifacts(parts, examples, layout=layout, fmt=fmt, folder=folder, calibration=per_part,
                               float_names=float_names)  # fmt: skip
    quantizer = None
    if precision == "int8" and fmt == "pt2":
        quantizer = "X86InductorQuantizer (PT2E" + (", 7-bit activations: for CPUs without VNNI)" if backend == X86_7BIT
                                                     else ")")  # fmt: skip
    elif precision == "int8":
        quantizer = "onnxruntime quantize_static (QDQ, per channel" + (
            ", 7-bit weights: the exporting CPU has no VNNI)" if x86_without_vnni() else ")")  # fmt: skip
    from datetime import datetime, timezone

    manifest = ExportManifest(
        fmt, precision, layout, labels.name, labels.num_classes, tuple(input_shape),
        float_flops(model, tuple(input_shape), step_count(model)), tuple(written), labels.parent_run,
        labels.parent_fingerprint, datetime.now(timezone.utc).isoformat(timespec="seconds"), quantizer,
        labels.calibration_images if precision == "int8" else None, _versions(),
        tuple(recipe.float_layers) if precision == "int8" else (),
    )  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2))
    return manifest


def float_weight_budget(
    model: nn.Module, fmt: str, *, input_shape: tuple[int, ...], num_classes: int, name: str,
    calibration: Sequence[Tensor], min_size_ratio: float,
) -> int:  # fmt: skip
    """The most weights an int8 ``fmt`` artifact of a float model may keep in float and still be at least
    ``min_size_ratio`` times smaller than its fp32 artifact. Both artifacts are written to a scratch folder
    and weighed, so the graphs' descriptions count too; each weight kept in float then costs 3 bytes more (4
    against 1). The quantization parameters a float layer no longer needs are not credited, so the budget errs
    small. A model whose plain int8 artifact already misses the ratio is a one-line error."""
    with tempfile.TemporaryDirectory() as scratch:
        sizes = []
        for precision in ("fp32", "int8"):
            folder = Path(scratch) / precision
            folder.mkdir()
            sizes.append(export_model(model, fmt, precision, folder, input_shape=input_shape,
                                      labels=ManifestLabels(name, num_classes),
                                      int8=Int8Recipe(calibration=calibration)).bytes)  # fmt: skip
    fp32, int8 = sizes
    if fp32 / int8 < min_size_ratio:
        raise AnytimeError(f"with every layer in int8 the {fmt} artifact is {fp32 / int8:.2f}x smaller than fp32, "
                           f"below --min-size-ratio {min_size_ratio:g}: lower it or leave it out")  # fmt: skip
    return int((fp32 / min_size_ratio - int8) // 3)
