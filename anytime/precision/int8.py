"""Static int8 (PT2E) machinery behind :func:`~anytime.precision.model.convert`: the CPUs whose int8 kernels need
7-bit activations, the float parts exported and prepared with X86InductorQuantizer (post-training observers or
quantization-aware fake quantization, chosen layers left in float), their calibration statistics saved and loaded,
and converted graphs lowered to oneDNN's int8 kernels.
"""

from __future__ import annotations

import copy
import platform
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError
from anytime.precision.parts import StepPart, example_for, float_parts, layout_of, part_inputs, run_parts
from anytime.utils.quiet import quiet_torchao

_OBSERVER = "activation_post_process"
_QUANTIZED_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # what X86InductorQuantizer quantizes with weights


def x86_without_vnni() -> bool:
    """An x86 CPU without VNNI (AVX2, or AVX-512 without it). Its int8 kernels multiply uint8 activations by int8
    weights and add pairs of products in 16 bits (vpmaddubsw), which saturate on full-range values: a multi-exit
    CIFAR network's oneDNN int8 graphs agreed with their own reference arithmetic on 82-85% of test images on
    such a CPU. 7-bit activations (int8 PT2E) or weights (ONNX Runtime) keep every pair in range, as PyTorch's and
    ONNX Runtime's documentation advise for these CPUs."""
    return platform.machine().lower() in ("x86_64", "amd64") and not getattr(torch.cpu, "_is_vnni_supported",
                                                                             lambda: True)()  # fmt: skip


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
    for strict in (False,) if isinstance(part, StepPart) else (True, False):
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


def prepare_int8(parts: list[nn.Module], inputs: list[Tensor], *, qat: bool = False, reduce_range: bool = False,
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
    :func:`graph_state` of them to :func:`convert` as the ``state`` of an ``Int8Recipe`` with ``qat=True``."""
    if reduce_range is None:
        reduce_range = x86_without_vnni()
    copied = copy.deepcopy(model).eval()
    parts = float_parts(copied)
    with torch.no_grad():
        inputs = part_inputs(layout_of(copied), parts, example_for(model, input_shape, 2))
    names = layers_per_part(copied, parts, float_layers)
    prepared = prepare_int8(parts, inputs, qat=True, reduce_range=reduce_range, float_names=names)
    with quiet_torchao():
        from torchao.quantization.pt2e import move_exported_model_to_train
    for part in prepared:
        move_exported_model_to_train(part)
    return prepared


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


def calibrate_prepared(layout: str, prepared: list[nn.Module], batches: Iterable[Tensor]) -> int:
    """Run prepared int8 graphs on calibration batches, so that their observers record the ranges; the images seen."""
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


def load_observers(prepared: list[nn.Module], state: dict[str, Tensor], *, everything: bool = False) -> None:
    """Load recorded int8 statistics (``everything``: every parameter and buffer) into prepared graphs."""
    for i, part in enumerate(prepared):
        mine = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"part{i}.")}
        expected = {k for k in part.state_dict() if everything or _OBSERVER in k}
        if set(mine) != expected:
            raise AnytimeError("the run's int8 statistics do not fit its model (another model or torchao version?); "
                               "quantize the parent run again")  # fmt: skip
        part.load_state_dict(mine, strict=False)
