"""Any model under the step contract at another precision: int8 (PT2E static, per stage and head), int8-dynamic
(Linear layers), bf16 or fp16 casts. The result keeps the step contract, so collect, sweep, calibrate, evaluate,
profile, schedule and the runtime take it unchanged; early exit still skips the stages it does not need, because
each stage and each exit head of a multi-exit model is a graph of its own.
"""

from __future__ import annotations

import copy
import platform
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from anytime.backbones.base import takes_tokens
from anytime.contract import step_count
from anytime.errors import AnytimeError
from anytime.precision.int8 import (
    calibrate_prepared,
    layers_per_part,
    load_observers,
    lower_int8,
    observer_state,
    prepare_int8,
    prepare_qat,
    x86_without_vnni,
)
from anytime.precision.parts import (
    PartsModel,
    example_for,
    float_parts,
    layout_of,
    part_inputs,
    room_for_compiled_parts,
)
from anytime.utils.quiet import quiet_torchao

PRECISIONS: tuple[str, ...] = ("int8", "int8-dynamic", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


def float_flops(model: nn.Module, shape: tuple[int, ...], num_steps: int) -> tuple[int, ...]:
    """FLOPs of each step of a float model on one sample of ``shape`` (``FlopCounterMode``), or those it measured on
    images when its cost depends on them (SACT)."""
    from torch.utils.flop_counter import FlopCounterMode

    if getattr(model, "data_dependent_cost", False):
        return tuple(model.step_flops)  # type: ignore[union-attr]

    flops = []
    sample = example_for(model, shape, 1)
    for k in range(num_steps):
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model.forward_until(sample, k) if num_steps > 1 else model(sample)  # type: ignore[operator]
        flops.append(int(counter.get_total_flops()))
    return tuple(flops)


@dataclass(frozen=True)
class Int8Recipe:
    """What a conversion to int8 is built from (the other precisions need none of it).

    The activation ranges come from ``calibration`` batches (training images: never validation or test) or from
    the ``state`` an earlier conversion of the same weights recorded; with ``qat`` that state is
    :func:`~anytime.precision.int8.graph_state` of graphs from :func:`~anytime.precision.int8.prepare_qat` after
    training. ``backend``: the one the recorded conversion used (full or 7-bit activations), default the one this
    device runs. ``float_layers``: layers (names in the float model, see
    :func:`~anytime.precision.int8.quantizable_layers`) kept in float inside the int8 graphs."""

    calibration: Iterable[Tensor] | None = None
    state: dict[str, Tensor] | None = None
    qat: bool = False
    backend: str | None = None
    float_layers: tuple[str, ...] = ()


def convert(
    model: nn.Module, precision: str, *, input_shape: tuple[int, ...], int8: Int8Recipe | None = None,
    compile: bool = True, device: torch.device | None = None, step_flops: Sequence[int] | None = None,
) -> tuple[PrecisionModel, dict[str, Tensor]]:  # fmt: skip
    """Convert a float model (on the CPU, eval mode) to ``precision``; return it and the state that rebuilds it.

    int8 is built from ``int8`` (:class:`Int8Recipe`: calibration batches or the state of an earlier conversion,
    the layers kept in float); the other precisions need none of it. ``step_flops``: the float model's FLOPs per
    step as counted when the run was made (counted here when not given).
    """
    recipe = int8 or Int8Recipe()
    target = device or torch.device("cpu")
    here = backend_for(precision, target)
    if recipe.float_layers and precision != "int8":
        raise AnytimeError(
            f"layers kept in float are an int8 option; a {precision} model has every layer at {precision}"
        )
    spec = PrecisionSpec(precision, recipe.backend or here, compile, tuple(recipe.float_layers))
    reduce_range = spec.backend == X86_7BIT
    if precision == "int8" and compile and here == X86_7BIT and not reduce_range:
        raise AnytimeError("this int8 run was quantized for a CPU with VNNI (8-bit activations); this CPU has none, so "
                           "its int8 kernels would overflow: quantize the float run again on this machine")  # fmt: skip
    model = model.eval()
    num_steps = step_count(model)
    known = step_flops is not None and len(step_flops) == num_steps
    flops = tuple(int(f) for f in step_flops) if known else float_flops(model, input_shape, num_steps)  # type: ignore[union-attr]
    if precision == "int8" and takes_tokens(model):
        raise AnytimeError("static int8 (PT2E) quantizes convolutional image networks; quantize a text encoder with "
                           "--precision int8-dynamic (int8 Linear layers, the usual form for transformers), bf16 or fp16")  # fmt: skip
    state: dict[str, Tensor] = {}
    if precision == "int8":
        converted, state = _int8_graphs(model, input_shape, recipe, reduce_range, compile)
    elif precision == "int8-dynamic":
        converted, spec = _dynamic_graphs(model, here, compile)
    else:
        converted = float_parts(copy.deepcopy(model).to(target, _DTYPES[precision]))
    if spec.compile and precision != "int8":
        room_for_compiled_parts(len(converted))
        converted = [torch.compile(p) for p in converted]  # type: ignore[misc]  # a compiled module is one
    return PrecisionModel(model, converted, spec, flops), state


def _int8_graphs(model: nn.Module, input_shape: tuple[int, ...], recipe: Int8Recipe, reduce_range: bool,
                 compile: bool) -> tuple[list[nn.Module], dict[str, Tensor]]:  # fmt: skip
    """A float model's parts as PT2E int8 graphs (lowered to oneDNN's kernels when ``compile``), their ranges
    calibrated or loaded as ``recipe`` says, and the state that rebuilds them."""
    layout = layout_of(model)
    with torch.no_grad():
        inputs = part_inputs(layout, float_parts(model), example_for(model, input_shape, 2))
    state = recipe.state
    if recipe.qat:
        if state is None:
            raise AnytimeError("a quantization-aware int8 model is rebuilt from its trained graphs' state")
        prepared = prepare_qat(model, input_shape, reduce_range=reduce_range, float_layers=recipe.float_layers)
        load_observers(prepared, state, everything=True)
        with quiet_torchao():
            from torchao.quantization.pt2e import move_exported_model_to_eval
        for part in prepared:
            move_exported_model_to_eval(part)
    else:
        parts = float_parts(model)
        prepared = prepare_int8(parts, inputs, reduce_range=reduce_range,
                                float_names=layers_per_part(model, parts, recipe.float_layers))  # fmt: skip
        if state is None:
            if recipe.calibration is None or calibrate_prepared(layout, prepared, recipe.calibration) == 0:
                raise AnytimeError("int8 static quantization needs calibration images from the training split")
            state = observer_state(prepared)
        else:
            load_observers(prepared, state)
    with quiet_torchao():
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        converted: list[nn.Module] = [convert_pt2e(p) for p in prepared]
    if compile:
        converted = [lower_int8(p, example[:2]) for p, example in zip(converted, inputs)]
    return converted, state


def _dynamic_graphs(model: nn.Module, backend: str, compile: bool) -> tuple[list[nn.Module], PrecisionSpec]:
    """int8-dynamic: the parts of a copy of ``model`` whose Linear layers run ``backend``'s int8 kernels, and the
    spec they run under."""
    if backend == FBGEMM_DYNAMIC:
        with warnings.catch_warnings():  # torch.ao's deprecation notice: the choice is ours, not the user's
            warnings.simplefilter("ignore")
            copied = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
        # compiled, these kernels ran slower at batch 1 (1.28 against 1.04 ms, SST-2 encoder)
        return float_parts(copied), PrecisionSpec("int8-dynamic", FBGEMM_DYNAMIC, False)
    with quiet_torchao():
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    copied = copy.deepcopy(model)
    quantize_(copied, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda m, _: isinstance(m, nn.Linear))
    return float_parts(copied), PrecisionSpec("int8-dynamic", TORCHAO_DYNAMIC, compile)
