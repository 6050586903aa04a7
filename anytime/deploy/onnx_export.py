"""Writing a model's parts as ONNX graphs: adaptive poolings rewritten in forms ONNX Runtime runs fast, one table
of the exporter's functions shared by every graph of an export, fp32 graphs stripped of debug names, and int8 graphs
quantized by ONNX Runtime's ``quantize_static`` with chosen layers (and a logits tail) left in float.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from anytime.deploy.manifest import dynamic_batch
from anytime.deploy.runtimes import DEPLOY_HINT, onnx_modules
from anytime.errors import AnytimeError, first_line
from anytime.precision.int8 import x86_without_vnni


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


def export_onnx(part: nn.Module, example: Tensor, path: Path, what: str, *, to_quantize: bool = False) -> None:
    """``part`` as an fp32 ONNX graph; ``to_quantize``: the float graph ONNX Runtime's quantizer starts from (it
    keeps the exporter's debug names, which map nodes to modules)."""
    onnx_modules()
    part = _plain_poolings(part, example, matrices=not to_quantize)
    try:
        # the exporter reports its progress on stdout; a library stays quiet
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), _one_onnx_table():
            torch.onnx.export(
                part, (example,), str(path), dynamo=True, external_data=False, input_names=["input"],
                output_names=["output"], dynamic_shapes=dynamic_batch(), verbose=False,
            )  # fmt: skip
    except ImportError as exc:
        raise AnytimeError(f"ONNX export needs {exc.name or 'onnxscript'}; {DEPLOY_HINT}") from None
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(f"{what} cannot be exported as an ONNX graph ({first_line(exc)})") from None
    if not to_quantize:
        _without_debug_info(path)


_WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # what ONNX Runtime quantizes with int8 weights


def normalised_by(part: nn.Module, example: Tensor) -> dict[str, str]:
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


def quantize_onnx(float_path: Path, path: Path, batches: Sequence[np.ndarray], what: str,
                  float_modules: Sequence[str] = (), folded: dict[str, str] | None = None, *, logits: bool = True,
                  ) -> None:  # fmt: skip
    """``float_path``'s graph quantized to int8 by ONNX Runtime, calibrated on ``batches``, written to ``path``."""
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
