"""Deployable artifacts of a model's steps: ``torch.export`` programs (``.pt2``) or ONNX graphs, one per step
(one per segment and per exit head of a multi-exit model, so a deployed early exit still skips the rest),
a manifest that names, sizes and checksums them, and a loader that never executes pickled code.

int8 ``.pt2`` artifacts hold the PT2E graph (int8 weights, quantize/dequantize around each kernel) and are
lowered to oneDNN's int8 kernels when loaded on an x86 CPU; int8 ONNX artifacts are quantized by ONNX
Runtime's ``quantize_static`` (QDQ, int8 weights per channel, uint8 activations) calibrated on the same
training images, and run through ONNX Runtime's execution providers.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import tempfile
import threading
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from anytime.contract import step_count
from anytime.deploy.runtimes import DEPLOY_HINT, PROVIDERS, first_line, onnx_modules, ort_session, sha256_of
from anytime.errors import AnytimeError
from anytime.precision.model import X86_7BIT, PartsModel, lower_int8, x86_without_vnni
from anytime.utils.quiet import quiet_torchao

if TYPE_CHECKING:
    from anytime.calibrate.policy import ExitPolicy
    from anytime.deploy.exit_program import ExitProgram

FORMATS: tuple[str, ...] = ("pt2", "onnx")
EXPORTABLE: dict[str, tuple[str, ...]] = {"pt2": ("fp32", "int8", "bf16", "fp16"), "onnx": ("fp32", "int8")}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "anytime-export-v1"
EXPORT = "export"  # the kind of results folder an export is
MAX_BATCH = 4096  # the largest batch an artifact's dynamic batch dimension admits
_DTYPES = {"fp32": torch.float32, "int8": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ArtifactPart:
    """One file of an export: a segment, an exit head, a step or the whole model."""

    file: str
    role: str  # segment | head | step | model
    step: int
    input_shape: tuple[int, ...]  # one sample's, without the batch dimension
    output_shape: tuple[int, ...]
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"file": self.file, "role": self.role, "step": self.step, "input_shape": list(self.input_shape),
                "output_shape": list(self.output_shape), "bytes": self.bytes, "sha256": self.sha256}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any) -> ArtifactPart:
        """Rebuild from :meth:`to_dict` (a malformed record raises ``KeyError``/``TypeError``/``ValueError``)."""
        return cls(str(doc["file"]), str(doc["role"]), int(doc["step"]), tuple(int(v) for v in doc["input_shape"]),
                   tuple(int(v) for v in doc["output_shape"]), int(doc["bytes"]), str(doc["sha256"]))  # fmt: skip


@dataclass(frozen=True)
class ExportManifest:
    """What an export holds and where it came from; ``fingerprint`` names the artifacts' bytes (a profile of the
    export must name it), ``parent_fingerprint`` the run they were exported from."""

    format: str
    precision: str
    layout: str
    model: str
    num_classes: int
    input_shape: tuple[int, ...]
    step_flops: tuple[int, ...]
    parts: tuple[ArtifactPart, ...]
    parent_run: str
    parent_fingerprint: str
    created: str
    quantizer: str | None = None
    calibration_images: int | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    float_layers: tuple[str, ...] = ()  # int8: layers left in float

    @property
    def num_steps(self) -> int:
        """The number of steps the artifacts answer at."""
        return len(self.step_flops)

    @property
    def fingerprint(self) -> str:
        """A short SHA-256 over the artifacts' checksums, their format and precision."""
        digest = hashlib.sha256(f"{self.format}/{self.precision}".encode())
        for part in self.parts:
            digest.update(part.sha256.encode())
        return digest.hexdigest()[:16]

    @property
    def bytes(self) -> int:
        """The artifacts' total size on disk."""
        return sum(p.bytes for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (with its format tag)."""
        return {
            "format_tag": MANIFEST_FORMAT, "format": self.format, "precision": self.precision, "layout": self.layout,
            "model": self.model, "num_classes": self.num_classes, "input_shape": list(self.input_shape),
            "step_flops": list(self.step_flops), "parts": [p.to_dict() for p in self.parts],
            "parent_run": self.parent_run, "parent_fingerprint": self.parent_fingerprint,
            "fingerprint": self.fingerprint, "bytes": self.bytes, "created": self.created,
            "quantizer": self.quantizer, "calibration_images": self.calibration_images, "versions": self.versions,
            "float_layers": list(self.float_layers),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, *, where: str) -> ExportManifest:
        """Rebuild from :meth:`to_dict`; anything malformed is a one-line error naming ``where``."""
        if not isinstance(doc, dict) or doc.get("format_tag") != MANIFEST_FORMAT:
            raise AnytimeError(f"{where} is not an anytime export manifest; export the run again with `anytime export`")
        try:
            manifest = cls(
                str(doc["format"]), str(doc["precision"]), str(doc["layout"]), str(doc["model"]),
                int(doc["num_classes"]), tuple(int(v) for v in doc["input_shape"]),
                tuple(int(v) for v in doc["step_flops"]), tuple(ArtifactPart.from_dict(p) for p in doc["parts"]),
                str(doc["parent_run"]), str(doc["parent_fingerprint"]), str(doc["created"]),
                doc.get("quantizer"), doc.get("calibration_images"), dict(doc.get("versions") or {}),
                tuple(str(name) for name in doc.get("float_layers") or ()),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(
                f"{where} is missing fields or has malformed ones; was it edited? Export the run again"
            ) from None
        if manifest.format not in FORMATS or manifest.precision not in EXPORTABLE[manifest.format]:
            raise AnytimeError(
                f"{where}: format '{manifest.format}' at precision '{manifest.precision}' is not one anytime exports"
            )
        expected = 2 * manifest.num_steps - 1 if manifest.layout == "exits" else manifest.num_steps
        if not manifest.parts or len(manifest.parts) != expected or manifest.num_steps < 1:
            raise AnytimeError(
                f"{where} lists {len(manifest.parts)} artifacts for {manifest.num_steps} steps; was it edited?"
            )
        if doc.get("fingerprint") not in (None, manifest.fingerprint):
            raise AnytimeError(f"{where}: the fingerprint does not match the artifacts' checksums; was it edited?")
        return manifest


def check_exportable(fmt: str, precision: str) -> None:
    """A one-line error for a format or a precision anytime does not export."""
    if fmt not in FORMATS:
        raise AnytimeError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if precision not in EXPORTABLE[fmt]:
        raise AnytimeError(f"{fmt} artifacts are exported at {', '.join(EXPORTABLE[fmt])}, not {precision}")


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


def _dynamic_batch() -> tuple[dict[int, Any]]:
    return ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)


_DEBUG_META = ("stack_trace", "from_node", "source_fn_stack", "nn_module_stack", "torch_fn", "custom")


def _export_pt2(part: nn.Module, example: Tensor, path: Path, what: str) -> None:
    try:
        with torch.no_grad():
            program = torch.export.export(_without_unused_state(part), (example,), dynamic_shapes=_dynamic_batch())
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


class _MatrixPooling(nn.Module):
    """Adaptive average pooling over one fixed input size as two products with constant matrices (each row
    averages one window): two MatMul nodes in ONNX."""

    def __init__(self, size: tuple[int, int], out: tuple[int, int]) -> None:
        super().__init__()
        self.register_buffer("rows", _window_matrix(size[0], out[0]))
        self.register_buffer("columns", _window_matrix(size[1], out[1]).T.contiguous())

    def forward(self, x: Tensor) -> Tensor:
        return torch.matmul(torch.matmul(self.rows, x), self.columns)


def _window_matrix(size: int, out: int) -> Tensor:
    """``[out, size]``: row i averages adaptive pooling's window i, from floor(i size / out) to ceil((i+1) size / out)."""
    matrix = torch.zeros(out, size)
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def _with_modules(part: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """``part`` itself when ``modules`` is empty, else a copy with the submodules it names replaced."""
    if not modules:
        return part
    part = copy.deepcopy(part)
    for name, module in modules.items():
        owner, _, attr = name.rpartition(".")
        setattr(part.get_submodule(owner) if owner else part, attr, module)
    return part


def _unfused(part: nn.Module) -> nn.Module:
    """``part``, or a copy whose :class:`~anytime.deploy.inference.PooledLinear` modules are the three they stand for."""
    from anytime.deploy.inference import PooledLinear

    if isinstance(part, PooledLinear):
        return part.unfused()
    return _with_modules(part, {name: m.unfused() for name, m in part.named_modules() if isinstance(m, PooledLinear)})


def _plain_poolings(part: nn.Module, example: Tensor, *, matrices: bool) -> nn.Module:
    """``part``, or a copy of it whose adaptive average poolings are written for ONNX Runtime: over a size their
    output divides, plain average poolings (the same windows); otherwise, with ``matrices``, two products with
    constant matrices (the int8 quantizer would round those, so int8 exports keep the adaptive form). The
    exporter writes an adaptive pooling as a chain of about 60 Gather and Add nodes: ONNX Runtime ran it in
    0.14-0.23 ms at batch 1 on the fast CIFAR card's exit heads, more than the segment before a head takes. A
    pooled head fused by the fold inference form is unfused first, so its pooling is rewritten too."""
    part = _unfused(part)
    sizes: dict[str, set[tuple[int, int]]] = {}
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: sizes.setdefault(name, set()).add(
                 tuple(args[0].shape[-2:])))  # fmt: skip
             for name, module in part.named_modules() if isinstance(module, nn.AdaptiveAvgPool2d)]  # fmt: skip
    if not hooks:
        return part
    try:
        with torch.no_grad():
            part(example)
    finally:
        for hook in hooks:
            hook.remove()
    plain: dict[str, nn.Module] = {}
    for name, seen in sizes.items():
        if len(seen) != 1:
            continue  # called on several sizes: one kernel cannot serve them all
        size = next(iter(seen))
        wanted = part.get_submodule(name).output_size
        pair = wanted if isinstance(wanted, tuple) else (wanted, wanted)
        out = (size[0] if pair[0] is None else int(pair[0]), size[1] if pair[1] is None else int(pair[1]))
        if out == (1, 1):
            continue  # exported as a global pooling already
        if size[0] % out[0] == 0 and size[1] % out[1] == 0:
            kernel = (size[0] // out[0], size[1] // out[1])
            plain[name] = nn.AvgPool2d(kernel, stride=kernel)
        elif matrices:
            plain[name] = _MatrixPooling(size, out)
    return _with_modules(part, plain)


_ONNX_TABLES: dict[tuple[Any, ...], Any] = {}
_ONNX_TABLES_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_onnx_table() -> Iterator[None]:
    """While inside, ``torch.onnx.export`` reuses its table of ATen-to-ONNX functions (built once per process and
    kept) instead of building it for every graph, and a multi-exit run exports a graph per segment and per head:
    a ResNet-20 with two exits (five graphs) exported in 7.99 s against 11.76 s, and again in the same process in
    4.77 s against 9.02 s (benchmarks/onnx_export_time.py, two Xeon cores). The exporter only reads the table, and
    no custom translations are given here, so the graphs are the same, byte for byte. Where torch keeps the table
    elsewhere (another version), each graph builds its own, as before."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    table_type = getattr(_registration, "ONNXRegistry", None)
    build = vars(table_type).get("from_torchlib") if isinstance(table_type, type) else None
    if not isinstance(build, classmethod):
        yield
        return

    def shared(cls: type, *args: Any, **kwargs: Any) -> Any:
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in _ONNX_TABLES:
            _ONNX_TABLES[key] = build.__func__(cls, *args, **kwargs)
        return _ONNX_TABLES[key]

    with _ONNX_TABLES_LOCK:
        table_type.from_torchlib = classmethod(shared)  # type: ignore[attr-defined,union-attr]
        try:
            yield
        finally:
            table_type.from_torchlib = build  # type: ignore[attr-defined,union-attr]


def _export_onnx(part: nn.Module, example: Tensor, path: Path, what: str, *, to_quantize: bool = False) -> None:
    """``part`` as an fp32 ONNX graph; ``to_quantize``: the float graph ONNX Runtime's quantizer starts from (it
    keeps the exporter's debug names, which map nodes to modules)."""
    onnx_modules()
    part = _plain_poolings(part, example, matrices=not to_quantize)
    try:
        # the exporter reports its progress on stdout; a library stays quiet
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), _one_onnx_table():
            torch.onnx.export(
                part, (example,), str(path), dynamo=True, external_data=False, input_names=["input"],
                output_names=["output"], dynamic_shapes=_dynamic_batch(), verbose=False,
            )  # fmt: skip
    except ImportError as exc:
        raise AnytimeError(f"ONNX export needs {exc.name or 'onnxscript'}; {DEPLOY_HINT}") from None
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(f"{what} cannot be exported as an ONNX graph ({first_line(exc)})") from None
    if not to_quantize:
        _without_debug_info(path)


_WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # what ONNX Runtime quantizes with int8 weights


def _normalised_by(part: nn.Module, example: Tensor) -> dict[str, str]:
    """For each batch norm that directly follows a convolution in ``part``, its module path and the
    convolution's: the ONNX exporter folds the two into one Conv node named after the batch norm."""
    with torch.no_grad():
        graph = torch.export.export(part, (example,), strict=False).graph
    convs = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default)

    def path(node: torch.fx.Node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        return str(list(stack.values())[-1][0]) if stack else ""

    found = {}
    for node in graph.nodes:
        users = list(node.users)
        if node.target in convs and len(users) == 1 and "batch_norm" in str(users[0].target):
            found[path(users[0])] = path(node)
    return found


def _nodes_of_modules(path: Path, modules: Sequence[str], folded: dict[str, str] | None = None) -> list[str]:
    """The names of the nodes an exported ONNX graph computes inside ``modules`` (module paths in the exported
    part), read from the exporter's name scopes (a node named after a batch norm computes the convolution
    ``folded`` into it), of the weightless nodes (pooling, normalisation, activations) that only those feed, up to
    the next layer with weights, and of the weightless nodes that only those read: what ONNX Runtime's quantizer is
    told to leave in float, so that, as in PT2E, a float layer's output stays float until a quantized layer reads
    it, and its input is not rounded on its way from float layers or the graph's input."""
    if not modules:
        return []
    onnx, _ = onnx_modules()
    graph = onnx.load(str(path)).graph
    wanted, found = set(modules), []
    wanted |= {bn for bn, conv in (folded or {}).items() if conv in wanted}
    constant = {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    float_tensors: set[str] = set()
    for node in graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
        try:
            paths = ast.literal_eval(scopes) if scopes else []
        except (ValueError, SyntaxError):
            paths = []
        inside = any(isinstance(scope, str) and scope in wanted for scope in paths)
        dynamic = [name for name in node.input if name and name not in constant]
        fed_by_float = bool(dynamic) and all(name in float_tensors for name in dynamic)
        if inside or (fed_by_float and node.op_type not in _WEIGHTED_OPS):
            found.append(node.name)
            float_tensors.update(node.output)
    # and the weightless nodes whose every reader is float (an exit head's pooling before its float linear layer):
    # quantizing their input would round what only float layers read
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    outputs, excluded = {v.name for v in graph.output}, set(found)
    for node in reversed(graph.node):
        if node.name in excluded or node.op_type in _WEIGHTED_OPS or any(o in outputs for o in node.output):
            continue
        read_by = [r for o in node.output for r in readers.get(o, [])]
        if read_by and all(r in excluded for r in read_by):
            found.append(node.name)
            excluded.add(node.name)
    return found


def _logits_tail(path: Path) -> list[str]:
    """The weightless nodes (scaling, flattening, pooling) between a graph's last layers with weights and its
    output, when that output is logits (``[N, C]``): left in float, with the linear layers' outputs, so that the
    answer is not rounded to 256 levels, where near-tied classes swap (PT2E leaves a linear layer's output
    float too). Empty for a graph whose output is a feature map; only called on graphs that answer logits."""
    onnx, _ = onnx_modules()
    graph = onnx.load(str(path)).graph
    if any(len(v.type.tensor_type.shape.dim) != 2 for v in graph.output):
        return []
    made_by = {o: node for node in graph.node for o in node.output}
    found, waiting = [], [v.name for v in graph.output]
    while waiting:
        node = made_by.get(waiting.pop())
        if node is None or node.op_type in _WEIGHTED_OPS or node.name in found:
            continue
        found.append(node.name)
        waiting.extend(name for name in node.input if name)
    return found


def _without_debug_info(path: Path) -> None:
    """The exporter annotates every node with its Python stack and module path; a deployed graph needs neither."""
    onnx, _ = onnx_modules()
    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    _compact_names(model.graph)
    onnx.save(model, str(path))


def _compact_names(graph: Any) -> None:
    """Short tensor names, no node names and no intermediate shape annotations: the module paths and the
    quantizer's suffixes in them were a twentieth of a small int8 graph's file (ResNet-20: 20 KB of 312), and the
    graph runs the same without them. The graph's input and output keep their names."""
    if any(a.type in (a.GRAPH, a.GRAPHS) for node in graph.node for a in node.attribute):
        return  # control flow holds subgraphs whose names refer outwards; anytime's graphs have none
    keep = {v.name for v in graph.input} | {v.name for v in graph.output}
    names: dict[str, str] = {}

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        return names.setdefault(name, f"t{len(names):x}")

    for tensor in graph.initializer:
        tensor.name = short(tensor.name)
    for node in graph.node:
        node.name = ""
        renamed_inputs, renamed_outputs = [short(n) for n in node.input], [short(n) for n in node.output]
        del node.input[:], node.output[:]
        node.input.extend(renamed_inputs)
        node.output.extend(renamed_outputs)
    del graph.value_info[:]


def _quantize_onnx(float_path: Path, path: Path, batches: Sequence[np.ndarray], what: str,
                   float_modules: Sequence[str] = (), folded: dict[str, str] | None = None, *, logits: bool = True,
                   ) -> None:  # fmt: skip
    onnx_modules()
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):  # the inputs this part saw on the calibration images
        def __init__(self) -> None:
            self._batches = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {"input": batch}

    reader = Reader()
    prepared = path.with_name(path.stem + ".pre.onnx")
    try:
        excluded = _nodes_of_modules(float_path, float_modules, folded)
        if logits:
            excluded += [name for name in _logits_tail(float_path) if name not in excluded]
        try:
            quant_pre_process(str(float_path), str(prepared))
        except Exception:  # noqa: BLE001  its symbolic shape inference knows no ReduceMax with axes as an input
            quant_pre_process(str(float_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(path), reader, quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=x86_without_vnni(),
            nodes_to_exclude=excluded, extra_options={"OpTypesToExcludeOutputQuantization": ["Gemm", "MatMul"]},
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(f"ONNX Runtime could not quantize {what} ({first_line(exc)})") from None
    else:
        _without_debug_info(path)
    finally:
        prepared.unlink(missing_ok=True)
        float_path.unlink(missing_ok=True)


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
            _export_onnx(part, example, path, what)
        else:
            float_path = path.with_name(path.stem + ".float.onnx")
            _export_onnx(part, example, float_path, what, to_quantize=True)
            kept = float_names[i] if float_names else ()
            # every part answers logits but a segment with a head after it (MSDNet's segments answer a 2-D tensor too)
            logits = role != "segment" or i == len(parts) - 1
            _quantize_onnx(float_path, path, [b.detach().float().numpy() for b in calibration[i]], what, kept,
                           _normalised_by(part, example) if kept else None, logits=logits)  # fmt: skip
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


def export_model(
    model: nn.Module, fmt: str, precision: str, folder: Path, *, input_shape: tuple[int, ...], num_classes: int,
    name: str, calibration: Sequence[Tensor] | None = None, state: dict[str, Tensor] | None = None,
    qat: bool = False, parent_run: str = "", parent_fingerprint: str = "", calibration_images: int | None = None,
    backend: str | None = None, float_layers: Sequence[str] = (),
) -> ExportManifest:  # fmt: skip
    """Write a float model's steps (eval mode, on the CPU) as ``fmt`` artifacts at ``precision`` into the existing
    ``folder``, with the manifest; return it. int8 needs ``calibration`` batches (training images) or, for
    ``.pt2``, the ``state`` of an earlier conversion (``qat``: of quantization-aware training); it keeps
    ``float_layers`` (names in ``model``) in float."""
    from anytime.precision.model import convert, float_flops, float_parts, layers_per_part, layout_of, part_inputs

    check_exportable(fmt, precision)
    model = model.eval()
    layout = layout_of(model)
    floats = float_parts(model)
    dtype = _DTYPES[precision]
    with torch.no_grad():
        examples = [x.to(dtype) for x in part_inputs(layout, floats, torch.zeros(2, *input_shape))]
    parts: list[nn.Module] = floats
    per_part: list[list[Tensor]] | None = None
    if precision in ("bf16", "fp16"):  # a cast: exporting traces it, so fp16 exports on a CPU too
        parts = [copy.deepcopy(part).to(dtype) for part in floats]
    elif precision == "int8" and fmt == "pt2":
        converted, _ = convert(model, "int8", input_shape=input_shape, calibration=calibration, state=state,
                               compile=False, qat=qat, backend=backend, float_layers=float_layers)  # fmt: skip
        parts = list(converted.parts)
        backend = converted.spec.backend
    elif precision == "int8":
        if qat:
            raise AnytimeError("a model fine-tuned for int8 (QAT) exports as pt2: ONNX int8 artifacts are quantized by "
                               "ONNX Runtime from float weights, which would drop the fine-tuning")  # fmt: skip
        per_part = [[] for _ in floats]
        with torch.no_grad():
            for x in calibration or ():
                for i, inputs in enumerate(part_inputs(layout, floats, x)):
                    per_part[i].append(inputs)
        if not per_part[0]:
            raise AnytimeError("int8 ONNX artifacts need calibration images from the training split")
    float_names = layers_per_part(model, floats, float_layers) if precision == "int8" else []
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
        fmt, precision, layout, name, num_classes, tuple(input_shape),
        float_flops(model, tuple(input_shape), step_count(model)), tuple(written), parent_run,
        parent_fingerprint, datetime.now(timezone.utc).isoformat(timespec="seconds"), quantizer,
        calibration_images if precision == "int8" else None, _versions(),
        tuple(float_layers) if precision == "int8" else (),
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
            sizes.append(export_model(model, fmt, precision, folder, input_shape=input_shape, num_classes=num_classes,
                                      name=name, calibration=calibration).bytes)  # fmt: skip
    fp32, int8 = sizes
    if fp32 / int8 < min_size_ratio:
        raise AnytimeError(f"with every layer in int8 the {fmt} artifact is {fp32 / int8:.2f}x smaller than fp32, "
                           f"below --min-size-ratio {min_size_ratio:g}: lower it or leave it out")  # fmt: skip
    return int((fp32 / min_size_ratio - int8) // 3)


def read_manifest(folder: str | os.PathLike[str]) -> ExportManifest:
    """The manifest of an export folder, checked against the files: each present, of its size and checksum."""
    root = Path(folder)
    path = root / MANIFEST
    if not root.is_dir():
        raise AnytimeError(f"no export at {folder}; write one with `anytime export RUN --format pt2 --out {folder}`")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise AnytimeError(f"{folder} is not an export (no {MANIFEST}); write one with `anytime export`") from None
    except (OSError, ValueError):
        raise AnytimeError(f"{path} is not readable JSON; was it truncated? Export the run again") from None
    manifest = ExportManifest.from_dict(doc, where=str(path))
    for part in manifest.parts:
        file = root / part.file
        if Path(part.file).name != part.file or not file.is_file():
            raise AnytimeError(f"{file} is missing; the export is incomplete, export the run again")
        size = file.stat().st_size
        if size != part.bytes:
            raise AnytimeError(
                f"{file} has {size} bytes but the manifest says {part.bytes} (truncated or replaced); export the run again"
            )
        if sha256_of(file) != part.sha256:
            raise AnytimeError(
                f"{file} does not match its checksum in the manifest (changed since export); export the run again"
            )
    return manifest


def _refuse_pickles(path: Path) -> None:
    """A ``.pt2`` archive stores tensor subclasses and custom objects as pickles; refuse those before loading."""
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith("_config.json") and ("/weights/" in name or "/constants/" in name):
                    config = json.loads(archive.read(name)).get("config", {})
                    if any(entry.get("use_pickle") for entry in config.values()):
                        raise AnytimeError(
                            f"{path} holds pickled objects, which anytime never loads; export the run with anytime"
                        )
    except (zipfile.BadZipFile, ValueError, AttributeError):
        raise AnytimeError(f"{path} is not a readable .pt2 archive; export the run again") from None


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """Every ``torch.load`` inside (the archive's example inputs) refuses to unpickle code."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_pt2(path: Path, precision: str) -> nn.Module:
    _refuse_pickles(path)
    if precision == "int8":  # registers the quantize/dequantize operators the int8 graphs call
        with quiet_torchao():
            import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a failed load logs the whole traceback as warnings; the error says it in one line
    try:
        with _weights_only():
            return torch.export.load(str(path)).module()
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(
            f"{path} could not be loaded as a .pt2 program ({first_line(exc)}); export the run again"
        ) from None
    finally:
        logger.setLevel(level)


class _OrtPart(nn.Module):
    """One ONNX artifact run by an ONNX Runtime session, as a module of tensors."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self.input_name = session.get_inputs()[0].name

    def forward(self, x: Tensor) -> Tensor:
        array = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        return torch.from_numpy(self.session.run(None, {self.input_name: array})[0])


def onnxruntime_providers() -> tuple[str, ...]:
    """The execution providers of the installed ONNX Runtime build (none when it is not installed)."""
    try:
        import onnxruntime
    except ImportError:
        return ()
    return tuple(onnxruntime.get_available_providers())


class ExportedModel(PartsModel):
    """An export's artifacts under the step contract: ``.pt2`` programs (int8 lowered to oneDNN kernels unless
    ``lower=False``) or ONNX graphs run by ONNX Runtime. ``manifest`` says what they are."""

    def __init__(self, manifest: ExportManifest, parts: list[nn.Module], backend: str,
                 onnx: tuple[Path, str, int] | None = None) -> None:  # fmt: skip
        super().__init__(manifest.layout, parts, dtype=_DTYPES[manifest.precision], step_flops=manifest.step_flops)
        self.manifest = manifest
        self.backend = backend
        self._onnx = onnx  # (folder, provider, threads) of ONNX artifacts
        self._programs: dict[ExitPolicy, ExitProgram | None] = {}

    @property
    def onnx_location(self) -> tuple[Path, str, int] | None:
        """Where ONNX artifacts are loaded from and how they run: (folder, provider, threads); ``None`` for .pt2."""
        return self._onnx

    def exit_program(self, policy: ExitPolicy) -> ExitProgram | None:
        """``policy`` compiled into this export's ONNX graphs (made on first use, then kept): what
        ``policy.run(self, x)`` runs; ``None`` where it cannot be compiled (see :func:`compile_policy`)."""
        if policy not in self._programs:
            from anytime.deploy.exit_program import compile_policy

            self._programs[policy] = compile_policy(self, policy)
        return self._programs[policy]

    @property
    def artifact_bytes(self) -> int:
        """The artifacts' size on disk (what a profile reports as the model's bytes)."""
        return self.manifest.bytes


def load_export(
    folder: str | os.PathLike[str], *, provider: str = "cpu", lower: bool = True, threads: int | None = None,
) -> ExportedModel:  # fmt: skip
    """Load an export's artifacts after checking them against the manifest; never unpickles code."""
    root = Path(folder)
    manifest = read_manifest(root)
    parts: list[nn.Module] = []
    if manifest.format == "pt2":
        if provider != "cpu":
            raise AnytimeError(".pt2 artifacts run through PyTorch here; --provider applies to ONNX artifacts")
        if manifest.precision == "int8" and lower and x86_without_vnni() and "7-bit" not in (manifest.quantizer or ""):
            raise AnytimeError(f"{root}'s int8 graphs were quantized for a CPU with VNNI (8-bit activations); this CPU has "
                               "none, so its int8 kernels would overflow: export the run again on this machine")  # fmt: skip
        for part in manifest.parts:
            module = _load_pt2(root / part.file, manifest.precision)
            if manifest.precision == "int8" and lower:
                module = lower_int8(module, torch.zeros(2, *part.input_shape))
            parts.append(module)
        backend = "torch (oneDNN int8)" if manifest.precision == "int8" and lower else "torch"
    else:
        count = threads or torch.get_num_threads()
        parts = [_OrtPart(ort_session(root / part.file, provider, count)) for part in manifest.parts]
        backend = f"onnxruntime ({PROVIDERS[provider]})"
        return ExportedModel(manifest, parts, backend, onnx=(root, provider, count))
    return ExportedModel(manifest, parts, backend)
