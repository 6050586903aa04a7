"""Any model under the step contract at another precision: int8 (PT2E static, per stage and head), int8-dynamic
(Linear layers), bf16 or fp16 casts. The result keeps the step contract, so collect, sweep, calibrate, evaluate,
profile, schedule and the runtime take it unchanged; early exit still skips the stages it does not need, because
each stage and each exit head of a multi-exit model is a graph of its own.
"""

from __future__ import annotations

import copy
import platform
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from anytime.backbones.base import example_input, takes_tokens
from anytime.contract import is_segmented, step_count
from anytime.errors import AnytimeError
from anytime.utils.quiet import quiet_torchao

PRECISIONS: tuple[str, ...] = ("int8", "int8-dynamic", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES_PER_PART = 16  # input shapes (batch sizes, sentence lengths) each compiled part may meet and stay compiled
_OBSERVER = "activation_post_process"
_QUANTIZED_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # what X86InductorQuantizer quantizes with weights


@dataclass(frozen=True)
class PrecisionSpec:
    """How a run's steps were converted: the precision, the backend that runs it, and whether the graphs are
    compiled (``torch.compile`` is what makes int8 run as int8 kernels on a CPU; uncompiled int8 graphs run
    quantize/dequantize reference arithmetic, right in value but not in speed). ``float_layers``: int8 only, the
    convolutions and linear layers (module names in the float model) kept in float inside the int8 graphs."""

    precision: str
    backend: str
    compile: bool
    float_layers: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        """How the graphs run: ``onednn`` (int8 lowered to oneDNN kernels), ``reference`` (int8 as
        quantize/dequantize arithmetic), ``inductor`` (``torch.compile``) or ``eager``."""
        if self.precision == "int8":
            return "onednn" if self.compile else "reference"
        return "inductor" if self.compile else "eager"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"precision": self.precision, "backend": self.backend, "compile": self.compile, "mode": self.mode,
                "float_layers": list(self.float_layers)}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "precision record") -> PrecisionSpec:
        """Rebuild from :meth:`to_dict`; a malformed record is a one-line error."""
        try:
            layers = doc.get("float_layers") or []
            if not isinstance(layers, list) or not all(isinstance(name, str) for name in layers):
                raise TypeError
            spec = cls(str(doc["precision"]), str(doc["backend"]), bool(doc["compile"]), tuple(layers))
        except (KeyError, TypeError, AttributeError):
            raise AnytimeError(f"{where} does not say which precision the run is in; was it edited?") from None
        if spec.precision not in PRECISIONS:
            raise AnytimeError(f"{where}: unknown precision '{spec.precision}'; one of {', '.join(PRECISIONS)}")
        return spec


FBGEMM_DYNAMIC = "fbgemm-dynamic"  # torch.ao's dynamic Linear: x86 CPUs
TORCHAO_DYNAMIC = "torchao-dynamic"
X86_FULL = "x86-inductor"
X86_7BIT = "x86-inductor-7bit"  # activations quantized to 0..127: what a CPU without VNNI computes without overflow


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def x86_without_vnni() -> bool:
    """An x86 CPU without VNNI (AVX2, or AVX-512 without it). Its int8 kernels multiply uint8 activations by int8
    weights and add pairs of products in 16 bits (vpmaddubsw), which saturate on full-range values: a multi-exit
    CIFAR network's oneDNN int8 graphs agreed with their own reference arithmetic on 82-85% of test images on
    such a CPU. 7-bit activations (int8 PT2E) or weights (ONNX Runtime) keep every pair in range, as PyTorch's and
    ONNX Runtime's documentation advise for these CPUs."""
    return platform.machine().lower() in ("x86_64", "amd64") and not getattr(torch.cpu, "_is_vnni_supported",
                                                                             lambda: True)()  # fmt: skip


def backend_for(precision: str, device: torch.device) -> str:
    """The backend that runs ``precision`` on ``device``, or a one-line error naming one that runs here."""
    if precision not in PRECISIONS:
        raise AnytimeError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    if precision == "int8":
        if device.type != "cpu":
            raise AnytimeError(f"int8 static quantization runs on the CPU here (PT2E, X86InductorQuantizer); on "
                               f"{device.type} export the fp32 run and build a TensorRT int8 engine, or use bf16/fp16")  # fmt: skip
        if not x86:
            raise AnytimeError(
                f"int8 static quantization here uses X86InductorQuantizer, which needs an x86 CPU ({platform.machine()} "
                "found); on ARM boards use XNNPACKQuantizer with ExecuTorch, or TensorRT int8 on a Jetson; "
                "int8-dynamic and bf16 run here"
            )
        return X86_7BIT if x86_without_vnni() else X86_FULL
    if precision == "int8-dynamic":
        # torchao's int8 dynamic Linear ran 8-25x slower than fp32 on this x86 CPU (AVX2; docs/benchmarks-archive.md, "int8-dynamic
        # on an x86 CPU"; pytorch/ao#4365); torch.ao's fbgemm kernels run about as fast as fp32 with int8 weights.
        return FBGEMM_DYNAMIC if device.type == "cpu" and x86 and _has_fbgemm() else TORCHAO_DYNAMIC
    if precision == "fp16" and device.type == "cpu":
        raise AnytimeError("fp16 runs on CUDA devices; on this CPU choose bf16, int8 or int8-dynamic")
    return "cast"


class _Step(nn.Module):
    """Step ``k`` of a model whose steps are separate forwards, as a module of its own (to export it)."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.model = model
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        return self.model.forward_until(x, self.k)  # type: ignore[operator]


def layout_of(model: nn.Module) -> str:
    """How a model's steps are computed: ``exits`` (segments and heads), ``steps`` (one forward per step) or ``plain``."""
    if is_segmented(model):
        return "exits"
    if step_count(model) > 1:
        return "steps"
    return "plain"


def float_parts(model: nn.Module) -> list[nn.Module]:
    """The graphs a model is converted as: for a multi-exit model segment 0, head 0, segment 1, ...,
    the last segment; for separate steps one module per step; otherwise the model itself."""
    layout = layout_of(model)
    if layout == "exits":
        segments, heads = list(model.segments), list(model.heads)  # type: ignore[arg-type]
        parts: list[nn.Module] = []
        for k, segment in enumerate(segments):
            parts.append(segment)
            if k < len(heads):
                parts.append(heads[k])
        return parts
    if layout == "steps":
        return [_Step(model, k) for k in range(int(model.num_steps))]  # type: ignore[arg-type]
    return [model]


def part_inputs(layout: str, parts: list[nn.Module], x: Tensor) -> list[Tensor]:
    """The input each part sees when the model runs on ``x`` (a multi-exit model's head sees its segment's output)."""
    if layout != "exits":
        return [x] * len(parts)
    inputs, h = [], x
    for i, part in enumerate(parts):
        if i % 2 == 0:
            inputs.append(h)
            h = part(h)
        else:
            inputs.append(h)
    return inputs


class PartsModel(nn.Module):
    """Steps computed by a chain of graphs (``float_parts`` of a model, converted or exported), under the step
    contract: a multi-exit model's parts are segment 0, head 0, segment 1, ..., the last segment; otherwise
    one part per step. Inputs are cast to ``dtype`` and logits come back in float32."""

    def __init__(
        self, layout: str, parts: list[nn.Module], *, dtype: torch.dtype, step_flops: tuple[int, ...],
        exit_info: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layout = layout
        self.parts = nn.ModuleList(parts)
        self.step_flops = step_flops
        self.exit_info = exit_info
        self.backbone_flops = step_flops[-1]
        self.incremental = layout == "exits"
        self._dtype = dtype
        self.training = False

    @property
    def num_steps(self) -> int:
        """The number of steps (exits, slices, ladder steps; 1 for a plain model)."""
        if self.layout == "exits":
            return (len(self.parts) + 1) // 2
        return len(self.parts)

    @property
    def segments(self) -> tuple[nn.Module, ...]:
        """Multi-exit models: the converted backbone segments (with the input cast of the first)."""
        return self._wrapped()[0]

    @property
    def heads(self) -> list[nn.Module]:
        """Multi-exit models: the converted exit heads (logits returned in float32)."""
        return list(self._wrapped()[1])

    def _wrapped(self) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
        # Made once: building the wrapper modules on every early-exit call cost 30 us at batch 1 (LeNet: 110 us
        # in all). Kept in a plain attribute, so the parts are not registered twice.
        wrapped = self.__dict__.get("_wrappers")
        if wrapped is None:
            segments = tuple(_Cast(p, self._dtype) if i == 0 else p for i, p in enumerate(self.parts[0::2]))
            wrapped = self.__dict__["_wrappers"] = (segments, tuple(_Float(p) for p in self.parts[1::2]))
        return wrapped

    def backbone(self, x: Tensor) -> Tensor:
        """The whole converted network to its last exit (what the plain backbone computes)."""
        return self.forward_until(x, self.num_steps - 1)

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        """Each step's logits in turn; for a multi-exit model each computed only when asked for."""
        if self.layout != "exits":
            for k in range(self.num_steps):
                yield self.forward_until(x, k)
            return
        h = _cast(x, self._dtype)
        last = self.num_steps - 1
        for k in range(self.num_steps):
            h = self.parts[2 * k](h)
            yield h.float() if k == last else self.parts[2 * k + 1](h).float()

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        """Logits ``[B, C]`` of step ``k``, computing no more than it needs."""
        if not isinstance(k, int) or not -self.num_steps <= k < self.num_steps:
            raise AnytimeError(f"step {k} does not exist; this model has steps 0..{self.num_steps - 1}")
        k %= self.num_steps
        if self.layout != "exits":
            return self.parts[k](_cast(x, self._dtype)).float()
        h = _cast(x, self._dtype)
        for i in range(k + 1):
            h = self.parts[2 * i](h)
        return h.float() if k == self.num_steps - 1 else self.parts[2 * k + 1](h).float()

    def forward_all(self, x: Tensor) -> Tensor:
        """Logits of every step, ``[K, B, C]``, cheapest first."""
        return torch.stack(list(self.steps(x)))

    def forward(self, x: Tensor) -> Tensor:
        """``forward_all`` for a model of several steps, the logits ``[B, C]`` for a plain one."""
        return self.forward_until(x, 0) if self.layout == "plain" else self.forward_all(x)

    def train(self, mode: bool = True) -> PartsModel:
        """Always in inference mode: the converted graphs were exported in eval mode and have no other."""
        if mode:
            raise AnytimeError("a converted model is for inference; train the float run it came from")
        self.training = False  # not passed down: exported graphs refuse train()/eval()
        return self


class PrecisionModel(PartsModel):
    """A model's steps at another precision, under the same step contract as the float model it came from.

    ``float_model`` is the float original (for FLOPs, memory estimates and comparisons); ``step_flops`` are
    the float graph's FLOPs per step (a quantized graph counts as zero in ``FlopCounterMode``).
    """

    def __init__(
        self, float_model: nn.Module, parts: list[nn.Module], spec: PrecisionSpec, step_flops: tuple[int, ...]
    ) -> None:
        super().__init__(layout_of(float_model), parts, dtype=_DTYPES.get(spec.precision, torch.float32),
                         step_flops=step_flops, exit_info=getattr(float_model, "exit_info", None))  # fmt: skip
        self.spec = spec
        if takes_tokens(float_model):  # what it reads is what the float model reads: token ids
            self.modality = "text"
        object.__setattr__(self, "float_model", float_model)  # not a submodule: saved and moved by its owner
        self.backbone_flops = getattr(float_model, "backbone_flops", step_flops[-1])


class _Cast(nn.Module):
    def __init__(self, part: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.part, self.dtype = part, dtype

    def forward(self, x: Tensor) -> Tensor:
        return self.part(_cast(x, self.dtype))


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Images to the model's precision; token ids stay integers."""
    return x.to(dtype) if x.is_floating_point() else x


class _Float(nn.Module):
    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part

    def forward(self, x: Tensor) -> Tensor:
        return self.part(x).float()


def room_for_compiled_parts(count: int) -> None:
    """Let ``count`` compiled parts each meet :data:`SHAPES_PER_PART` input shapes. Every module torch.compile
    wraps runs through one shared function, whose graph cache holds 8 entries by default: a model of five parts
    seen at two batch sizes fills it, and past it TorchDynamo runs the module eagerly, with only a log warning."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(int(getattr(config, name)), SHAPES_PER_PART * count))


def lower_int8(part: nn.Module, example: Tensor) -> nn.Module:
    """An int8 graph lowered to oneDNN's int8 kernels: exported again with a dynamic batch, then inductor's
    freezing passes (the X86 patterns torchao registers: weight prepacking, fused ReLU and residual adds)
    and constant folding, as torchao's ``lower_pt2e_quantized_to_x86`` does for one fixed batch size."""
    from torch._inductor.constant_folding import constant_fold
    from torch._inductor.fx_passes.freezing_patterns import freezing_passes

    with quiet_torchao():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401  registers the patterns
    keep = {k: v for k, v in torch.export.default_decompositions().items() if torch._export.utils._is_cia_op(k)}
    with torch.no_grad():
        exported = torch.export.export(part, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=True)
        lowered = exported.run_decompositions(keep).module()
        graph = lowered.graph
        for node in list(graph.nodes):
            if node.target == torch.ops.aten.t.default:  # the linear patterns expect permute, not t
                with graph.inserting_before(node):
                    permuted = graph.call_function(torch.ops.aten.permute.default, args=(node.args[0], [1, 0]))
                node.replace_all_uses_with(permuted)
                graph.erase_node(node)
            elif node.target == torch.ops.aten.view.default:  # oneDNN hands on channels-last tensors
                node.target = torch.ops.aten.reshape.default
        lowered.recompile()
        freezing_passes(lowered, (example,))
        constant_fold(lowered)
    return lowered


def _export_for_quantization(part: nn.Module, sample: Tensor) -> torch.fx.GraphModule:
    """The part as an exported graph with a dynamic batch. Strict (TorchDynamo) tracing first: the non-strict
    graph of torchvision's ResNets splits a residual add in a way X86InductorQuantizer's fusion patterns refuse;
    non-strict when Dynamo cannot trace the part, and for a step of a sliced or skipping model, whose forward
    sets Python state (the width, the blocks skipped) that non-strict tracing runs as plain Python."""
    dynamic = ({0: torch.export.Dim.AUTO},)
    failure: Exception | None = None
    for strict in (False,) if isinstance(part, _Step) else (True, False):
        try:
            return torch.export.export(part, (sample,), dynamic_shapes=dynamic, strict=strict).module()
        except Exception as exc:  # noqa: BLE001  torch.export fails in many ways; name the part and the first line
            failure = failure or exc
    first = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
    raise AnytimeError(f"{type(part).__name__} cannot be exported for int8 quantization ({first})") from None


def quantizable_layers(model: nn.Module) -> list[str]:
    """The names of the layers int8 quantizes in ``model`` (its convolutions and linear layers, in the order of
    ``named_modules``): what ``float_layers`` may name."""
    return [name for name, module in model.named_modules() if isinstance(module, _QUANTIZED_TYPES)]


def layers_per_part(model: nn.Module, parts: Sequence[nn.Module], float_layers: Sequence[str]) -> list[list[str]]:
    """``float_layers`` (names in ``model``) as each part's own module names, found by identity (a multi-exit
    model's segments are containers of its modules under other names); an unknown name is a one-line error."""
    known = quantizable_layers(model)
    unknown = [name for name in float_layers if name not in known]
    if unknown:
        raise AnytimeError(f"no convolution or linear layer named '{unknown[0]}' in this model; name one of "
                           f"{', '.join(known[:6])}{', ...' if len(known) > 6 else ''}")  # fmt: skip
    modules = dict(model.named_modules())
    wanted = {id(modules[name]) for name in float_layers}
    return [[name for name, module in part.named_modules() if id(module) in wanted] for part in parts]


def _prepare_int8(parts: list[nn.Module], inputs: list[Tensor], *, qat: bool = False, reduce_range: bool = False,
                  float_names: Sequence[Sequence[str]] = ()) -> list[nn.Module]:  # fmt: skip
    """Each part exported and prepared for int8: observers (post-training) or fake quantization (``qat``: the
    parts are exported in training mode, so batch norm keeps training and folds into the convolution).
    ``float_names``: per part, the names of its modules left in float."""
    with quiet_torchao():
        from torchao.quantization.pt2e.constant_fold import constant_fold
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )
    prepared = []
    for i, (part, example) in enumerate(zip(parts, inputs)):
        sample = example[:2] if example.shape[0] >= 2 else torch.cat([example, example])
        part.train(qat)
        try:
            exported = _export_for_quantization(part, sample)
        finally:
            part.eval()
        if not qat:  # fine-tuned weights must stay parameters; folding is for the post-training graphs
            constant_fold(exported)  # weights computed from parameters (a slice's leading channels) become constants
            _folded_as_parameters(exported)
        quantizer = X86InductorQuantizer()
        quantizer.set_global(get_default_x86_inductor_quantization_config(is_qat=qat, reduce_range=reduce_range))
        for name in float_names[i] if float_names else ():
            quantizer.set_module_name_qconfig(name, None)
        try:
            prepared.append(prepare_qat_pt2e(exported, quantizer) if qat else prepare_pt2e(exported, quantizer))
        except Exception as exc:  # noqa: BLE001  the quantizer's pattern matching fails with plain ValueErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AnytimeError(f"X86InductorQuantizer cannot quantize {type(part).__name__} ({first})") from None
    return prepared


def prepare_qat(model: nn.Module, input_shape: tuple[int, ...], *, reduce_range: bool | None = None,
                float_layers: Sequence[str] = ()) -> list[nn.Module]:  # fmt: skip
    """Quantization-aware training graphs of a float model's parts (a copy: the model is left as it was), in
    training mode, with fake quantization of weights and activations (7-bit activations with ``reduce_range``,
    by default where this CPU has no VNNI; ``float_layers`` left in float); train them, then pass
    :func:`graph_state` of them to :func:`convert` with ``qat=True``."""
    if reduce_range is None:
        reduce_range = x86_without_vnni()
    copied = copy.deepcopy(model).eval()
    parts = float_parts(copied)
    with torch.no_grad():
        inputs = part_inputs(layout_of(copied), parts, _example(model, input_shape, 2))
    names = layers_per_part(copied, parts, float_layers)
    prepared = _prepare_int8(parts, inputs, qat=True, reduce_range=reduce_range, float_names=names)
    with quiet_torchao():
        from torchao.quantization.pt2e import move_exported_model_to_train
    for part in prepared:
        move_exported_model_to_train(part)
    return prepared


def run_parts(layout: str, parts: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """Every step's output of a chain of parts (segments and heads, or one part per step) on ``x``."""
    if layout != "exits":
        return [part(x) for part in parts]
    outputs, h = [], x
    for i in range(0, len(parts), 2):
        h = parts[i](h)
        outputs.append(parts[i + 1](h) if i + 1 < len(parts) else h)
    return outputs


def graph_state(prepared: Sequence[nn.Module]) -> dict[str, Tensor]:
    """Every parameter and buffer of prepared graphs (after quantization-aware training: the fine-tuned
    weights, batch-norm statistics and fake-quantization ranges), what rebuilds them exactly."""
    return {f"part{i}.{key}": value.detach().clone().contiguous() for i, part in enumerate(prepared)
            for key, value in part.state_dict().items()}  # fmt: skip


def _folded_as_parameters(graph_module: torch.fx.GraphModule) -> None:
    """Folded constants become frozen parameters: prepare_pt2e folds batch norm into a convolution by assigning a
    parameter at the convolution weight's name, which a plain tensor attribute of that name refuses."""
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("_frozen_param"):
            value = getattr(graph_module, node.target)
            if not isinstance(value, nn.Parameter):
                delattr(graph_module, node.target)
                graph_module.register_parameter(node.target, nn.Parameter(value, requires_grad=False))


def _calibrate(layout: str, prepared: list[nn.Module], batches: Iterable[Tensor]) -> int:
    seen = 0
    with torch.no_grad():
        for x in batches:
            run_parts(layout, prepared, x)
            seen += x.shape[0]
    return seen


def observer_state(prepared: list[nn.Module]) -> dict[str, Tensor]:
    """The calibration statistics of prepared int8 graphs (what, with the float weights, rebuilds them)."""
    return {f"part{i}.{key}": value.detach().clone().contiguous() for i, part in enumerate(prepared)
            for key, value in part.state_dict().items() if _OBSERVER in key}  # fmt: skip


def _load_observers(prepared: list[nn.Module], state: dict[str, Tensor], *, everything: bool = False) -> None:
    for i, part in enumerate(prepared):
        mine = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"part{i}.")}
        expected = {k for k in part.state_dict() if everything or _OBSERVER in k}
        if set(mine) != expected:
            raise AnytimeError("the run's int8 statistics do not fit its model (another model or torchao version?); "
                               "quantize the parent run again")  # fmt: skip
        part.load_state_dict(mine, strict=False)


def _example(model: nn.Module, shape: tuple[int, ...], batch: int) -> Tensor:
    """Inputs of one sample's ``shape`` for ``model``: zeros, or a sentence's token ids for a text encoder."""
    return example_input(shape, batch, tokens=takes_tokens(model))


def float_flops(model: nn.Module, shape: tuple[int, ...], num_steps: int) -> tuple[int, ...]:
    """FLOPs of each step of a float model on one sample of ``shape`` (``FlopCounterMode``), or those it measured on
    images when its cost depends on them (SACT)."""
    from torch.utils.flop_counter import FlopCounterMode

    if getattr(model, "data_dependent_cost", False):
        return tuple(model.step_flops)  # type: ignore[union-attr]

    flops = []
    sample = _example(model, shape, 1)
    for k in range(num_steps):
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model.forward_until(sample, k) if num_steps > 1 else model(sample)  # type: ignore[operator]
        flops.append(int(counter.get_total_flops()))
    return tuple(flops)


def convert(
    model: nn.Module, precision: str, *, input_shape: tuple[int, ...], calibration: Iterable[Tensor] | None = None,
    state: dict[str, Tensor] | None = None, compile: bool = True, device: torch.device | None = None,
    qat: bool = False, step_flops: Sequence[int] | None = None, backend: str | None = None,
    float_layers: Sequence[str] = (),
) -> tuple[PrecisionModel, dict[str, Tensor]]:  # fmt: skip
    """Convert a float model (on the CPU, eval mode) to ``precision``; return it and the state that rebuilds it.

    int8 needs either ``calibration`` batches (training images: never validation or test) or the ``state``
    recorded by an earlier conversion of the same weights; with ``qat`` the state is :func:`graph_state` of
    graphs from :func:`prepare_qat` after training. The other precisions need neither. ``step_flops``: the
    float model's FLOPs per step as counted when the run was made (counted here when not given). ``backend``:
    the one a recorded conversion used (int8: full or 7-bit activations), default the one this device runs.
    ``float_layers``: int8 only, layers (names in ``model``, see :func:`quantizable_layers`) kept in float.
    """
    target = device or torch.device("cpu")
    here = backend_for(precision, target)
    if float_layers and precision != "int8":
        raise AnytimeError(
            f"layers kept in float are an int8 option; a {precision} model has every layer at {precision}"
        )
    spec = PrecisionSpec(precision, backend or here, compile, tuple(float_layers))
    reduce_range = spec.backend == X86_7BIT
    if precision == "int8" and compile and here == X86_7BIT and not reduce_range:
        raise AnytimeError("this int8 run was quantized for a CPU with VNNI (8-bit activations); this CPU has none, so "
                           "its int8 kernels would overflow: quantize the float run again on this machine")  # fmt: skip
    model = model.eval()
    num_steps = step_count(model)
    layout = layout_of(model)
    known = step_flops is not None and len(step_flops) == num_steps
    flops = tuple(int(f) for f in step_flops) if known else float_flops(model, input_shape, num_steps)  # type: ignore[union-attr]
    if precision == "int8" and takes_tokens(model):
        raise AnytimeError("static int8 (PT2E) quantizes convolutional image networks; quantize a text encoder with "
                           "--precision int8-dynamic (int8 Linear layers, the usual form for transformers), bf16 or fp16")  # fmt: skip
    if precision == "int8":
        with torch.no_grad():
            inputs = part_inputs(layout, float_parts(model), _example(model, input_shape, 2))
    if precision == "int8" and qat:
        if state is None:
            raise AnytimeError("a quantization-aware int8 model is rebuilt from its trained graphs' state")
        prepared = prepare_qat(model, input_shape, reduce_range=reduce_range, float_layers=float_layers)
        _load_observers(prepared, state, everything=True)
        with quiet_torchao():
            from torchao.quantization.pt2e import move_exported_model_to_eval
        for part in prepared:
            move_exported_model_to_eval(part)
    elif precision == "int8":
        parts = float_parts(model)
        prepared = _prepare_int8(parts, inputs, reduce_range=reduce_range,
                                 float_names=layers_per_part(model, parts, float_layers))  # fmt: skip
        if state is None:
            if calibration is None or _calibrate(layout, prepared, calibration) == 0:
                raise AnytimeError("int8 static quantization needs calibration images from the training split")
            state = observer_state(prepared)
        else:
            _load_observers(prepared, state)
    if precision == "int8":
        with quiet_torchao():
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            converted: list[nn.Module] = [convert_pt2e(p) for p in prepared]
        if compile:
            converted = [lower_int8(p, example[:2]) for p, example in zip(converted, inputs)]
    elif precision == "int8-dynamic" and here == FBGEMM_DYNAMIC:
        with warnings.catch_warnings():  # torch.ao's deprecation notice: the choice is ours, not the user's
            warnings.simplefilter("ignore")
            copied = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
        compile = False  # compiled, these kernels ran slower at batch 1 (1.28 against 1.04 ms, SST-2 encoder)
        spec = PrecisionSpec(precision, FBGEMM_DYNAMIC, compile)
        converted, state = float_parts(copied), {}
    elif precision == "int8-dynamic":
        with quiet_torchao():
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        copied = copy.deepcopy(model)
        quantize_(copied, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda m, _: isinstance(m, nn.Linear))
        spec = PrecisionSpec(precision, TORCHAO_DYNAMIC, compile)
        converted, state = float_parts(copied), {}
    else:
        copied = copy.deepcopy(model).to(target, _DTYPES[precision])
        converted, state = float_parts(copied), {}
    if compile and precision != "int8":
        room_for_compiled_parts(len(converted))
        converted = [torch.compile(p) for p in converted]  # type: ignore[misc]  # a compiled module is one
    return PrecisionModel(model, converted, spec, flops), state or {}
