"""Accuracy-aware int8: keep the layers that int8 hurts most in float until every step agrees with the float model.

Post-training int8 loses most of its agreement in a few layers, usually the ones that see the input image or a
large activation map (on a CPU without VNNI, activations have 7 bits, so the image's 256 levels become 128). Ranking
the layers by what int8 costs each of them, alone, and keeping the worst in float is the usual remedy (Intel Neural
Compressor's accuracy-driven fallback, NVIDIA's sensitivity analysis). Here the ranking is simulated (each layer's
input and weights fake-quantized as X86InductorQuantizer quantizes them, the rest of the network left in float); the
layers then go back to float in the order that buys the most simulated agreement per weight kept in float, since a
large layer in float undoes much of int8's size; and every choice is checked on the real converted graphs, so what
is reported is what the int8 model does.

Agreement is top-1 agreement with the float model, per step, on images that are neither the calibration images nor
test images (validation images; their labels are not read).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError
from anytime.precision.int8 import quantizable_layers
from anytime.precision.model import X86_7BIT, Int8Recipe, PrecisionModel, backend_for, convert
from anytime.precision.parts import float_parts, layout_of, run_parts

_BATCH = 256
# Images the simulations rank and order the layers on: some hundred simulations of the whole network decide only
# the order, while every real conversion is measured on all the images the caller gives.
_SIMULATION_IMAGES = 1000
T = TypeVar("T")
DEFAULT_CALIBRATION_IMAGES = 512
DEFAULT_AGREEMENT_IMAGES = 1000  # validation images accuracy-aware int8 measures agreement on


@dataclass(frozen=True)
class Int8Settings:
    """The int8 options of ``anytime quantize`` and ``anytime export``: what calibrates int8 and which of its layers
    stay in float.

    ``calibration_images``: how many training images calibrate the activations (never validation or test).
    ``float_layers``: convolutions and linear layers (module names in the float model) kept in float. Or
    ``min_agreement`` (a fraction of images in (0, 1]) chooses them: the layers int8 hurts most go back to float,
    at most ``max_float_layers`` of them, until every step agrees top-1 with the float model on at least that
    share of ``agreement_images`` validation images (labels unread), keeping no more weights in float than leave
    the int8 artifact ``min_size_ratio`` times smaller than the fp32 one (None: no bound)."""

    calibration_images: int = DEFAULT_CALIBRATION_IMAGES
    float_layers: tuple[str, ...] = ()
    min_agreement: float | None = None
    max_float_layers: int = 8
    agreement_images: int = DEFAULT_AGREEMENT_IMAGES
    min_size_ratio: float | None = None

    def check(self, precision: str) -> None:
        """One-line errors for the options that keep int8 layers in float, before any work: an option
        ``precision`` does not take, two that exclude each other, or a value out of range."""
        agreement, ratio = self.min_agreement, self.min_size_ratio
        if (self.float_layers or agreement is not None) and precision != "int8":
            raise AnytimeError(f"--float-layers and --min-agreement are int8 options (got --precision {precision})")
        if self.float_layers and agreement is not None:
            raise AnytimeError(
                "--float-layers names the layers kept in float and --min-agreement chooses them; give one"
            )
        if agreement is not None and not (math.isfinite(agreement) and 0.0 < agreement <= 1.0):
            raise AnytimeError(f"--min-agreement is a fraction of images in (0, 1], e.g. 0.99 (got {agreement})")
        if ratio is not None and agreement is None:
            raise AnytimeError(
                "--min-size-ratio bounds the layers --min-agreement keeps in float; give --min-agreement too"
            )
        if ratio is not None and not (math.isfinite(ratio) and ratio > 1.0):
            raise AnytimeError(f"--min-size-ratio is how many times smaller than fp32 the int8 artifact must stay, "
                               f"above 1 (e.g. 3.5; got {ratio})")  # fmt: skip
        if self.max_float_layers < 0 or self.agreement_images < 1:
            raise AnytimeError(f"--max-float-layers must be at least 0 and --agreement-images at least 1 "
                               f"(got {self.max_float_layers} and {self.agreement_images})")  # fmt: skip


@dataclass(frozen=True)
class LayerSensitivity:
    """What int8 costs one layer alone: the lowest per-step top-1 agreement with the float model when only this
    layer's input and weights are quantized (simulated)."""

    name: str
    agreement: float


@dataclass(frozen=True)
class Int8Tuning:
    """The outcome of :func:`tune_int8`: the layers kept in float, each step's agreement with the float model on
    the tuning images (measured on the converted graphs), every candidate tried, the simulated ranking, and the
    weights kept in float against the budget the size target allowed (``None``: no budget)."""

    float_layers: tuple[str, ...]
    agreement: tuple[float, ...]
    target: float
    images: int
    tried: tuple[tuple[tuple[str, ...], float], ...]
    ranking: tuple[LayerSensitivity, ...]
    float_weights: int = 0
    max_float_weights: int | None = None

    @property
    def met(self) -> bool:
        """Whether every step reached the target."""
        return min(self.agreement) >= self.target

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record."""
        return {"float_layers": list(self.float_layers), "agreement": list(self.agreement), "target": self.target,
                "images": self.images, "met": self.met, "float_weights": self.float_weights,
                "max_float_weights": self.max_float_weights,
                "tried": [{"float_layers": list(layers), "min_agreement": a} for layers, a in self.tried],
                "ranking": [{"layer": r.name, "agreement": r.agreement} for r in self.ranking]}  # fmt: skip


def _predictions(layout: str, parts: Sequence[nn.Module], images: Tensor) -> list[Tensor]:
    """Each step's top-1 class on ``images``, in batches."""
    chunks: list[list[Tensor]] = []
    with torch.no_grad():
        for start in range(0, images.shape[0], _BATCH):
            outputs = run_parts(layout, parts, images[start : start + _BATCH])
            chunks.append([o.float().argmax(1) for o in outputs])
    return [torch.cat([c[k] for c in chunks]) for k in range(len(chunks[0]))]


def step_agreement(model: nn.Module, converted: PrecisionModel, images: Tensor) -> tuple[float, ...]:
    """Each step's top-1 agreement between a float model and its converted form on ``images``."""
    layout = layout_of(model)
    reference = _predictions(layout, float_parts(model.eval()), images)
    mine = _predictions(converted.layout, list(converted.parts), images)
    return tuple(float((a == b).float().mean()) for a, b in zip(reference, mine))


def _fake_quantize(x: Tensor, low: float, high: float, levels: int) -> Tensor:
    """Affine per-tensor quantization to ``levels`` levels over [low, high] (zero kept exact), then back to float."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / (levels - 1), 1e-12)
    zero = round(-low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, levels - 1) - zero) * scale


def _fake_quantize_weight(w: Tensor) -> Tensor:
    """Symmetric per-output-channel int8 weights, as X86InductorQuantizer stores them, back in float."""
    amax = w.detach().abs().flatten(1).amax(1).clamp_min(1e-12)
    scale = (amax / 127.5).view(-1, *([1] * (w.dim() - 1)))
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def _input_ranges(
    model: nn.Module, names: Sequence[str], calibration: Sequence[Tensor]
) -> dict[str, tuple[float, float]]:
    """The smallest and largest input each named layer sees on the calibration batches (float model)."""
    layout, parts, modules = layout_of(model), float_parts(model), dict(model.named_modules())
    ranges: dict[str, list[float]] = {name: [math.inf, -math.inf] for name in names}

    def observe(name: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen = ranges[name]
            seen[0], seen[1] = min(seen[0], float(args[0].min())), max(seen[1], float(args[0].max()))

        return hook

    handles = [modules[name].register_forward_pre_hook(observe(name)) for name in names]
    try:
        with torch.no_grad():
            for x in calibration:
                run_parts(layout, parts, x)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (low, high) for name, (low, high) in ranges.items() if math.isfinite(low)}  # layers the steps reach


def _simulated_agreement(model: nn.Module, quantized: Sequence[str], ranges: dict[str, tuple[float, float]],
                         levels: int, images: Tensor, reference: list[Tensor]) -> float:  # fmt: skip
    """The lowest per-step agreement with ``reference`` when the ``quantized`` layers' inputs and weights are
    fake-quantized and everything else stays float."""
    layout, parts, modules = layout_of(model), float_parts(model), dict(model.named_modules())
    saved, handles = {}, []
    try:
        for name in quantized:
            module, (low, high) = modules[name], ranges[name]
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, lo=low, hi=high: (_fake_quantize(args[0], lo, hi, levels), *args[1:])))  # fmt: skip
            saved[name] = module.weight.data
            module.weight.data = _fake_quantize_weight(module.weight.data)
        predicted = _predictions(layout, parts, images)
    finally:
        for name, weight in saved.items():
            modules[name].weight.data = weight
        for handle in handles:
            handle.remove()
    return min(float((a == b).float().mean()) for a, b in zip(reference, predicted))


def layer_sensitivity(model: nn.Module, calibration: Sequence[Tensor], images: Tensor, *,
                      activation_levels: int = 256) -> tuple[LayerSensitivity, ...]:  # fmt: skip
    """Every quantizable layer of a float model ranked by what int8 costs it alone, worst first: its input range
    measured on ``calibration`` batches, then, one layer at a time, its input and weights fake-quantized while the
    rest stays float, and the lowest per-step top-1 agreement with the float model on ``images``."""
    model = model.eval()
    ranges = _input_ranges(model, quantizable_layers(model), calibration)
    reference = _predictions(layout_of(model), float_parts(model), images)
    return _ranked(model, ranges, activation_levels, images, reference)


def _ranked(model: nn.Module, ranges: dict[str, tuple[float, float]], levels: int, images: Tensor,
            reference: list[Tensor]) -> tuple[LayerSensitivity, ...]:  # fmt: skip
    ranked = [LayerSensitivity(name, _simulated_agreement(model, [name], ranges, levels, images, reference))
              for name in ranges]  # fmt: skip
    return tuple(sorted(ranked, key=lambda r: r.agreement))


def _cheapest_order(model: nn.Module, ranges: dict[str, tuple[float, float]], levels: int, images: Tensor,
                    reference: list[Tensor], ranking: Sequence[LayerSensitivity], limit: int,
                    max_float_weights: int | None = None) -> tuple[list[str], list[float]]:  # fmt: skip
    """The order in which layers go back to float: each time the one whose return to float raises the simulated
    agreement most per weight it keeps in float (a float weight costs 4 bytes instead of 1, so a large layer must
    earn its place), the single-layer ranking breaking ties, among the layers that still fit in
    ``max_float_weights``; and the simulated agreement with the first 0, 1, ... layers of that order in float (at
    most ``limit``; fewer when no layer left fits)."""
    modules = dict(model.named_modules())
    names = [r.name for r in ranking]

    def simulate(floats: Sequence[str]) -> float:
        return _simulated_agreement(model, [n for n in names if n not in floats], ranges, levels, images, reference)

    order: list[str] = []
    simulated = [simulate(order)]
    spare = math.inf if max_float_weights is None else max_float_weights
    while len(order) < limit:
        left = [n for n in names if n not in order and modules[n].weight.numel() <= spare]
        if not left:
            break
        gains = {n: simulate([*order, n]) for n in left}
        chosen = max(left, key=lambda n: ((gains[n] - simulated[-1]) / modules[n].weight.numel(), -names.index(n)))
        if gains[chosen] <= simulated[-1]:  # no layer helps alone: fall back on the single-layer ranking
            chosen = left[0]
        order.append(chosen)
        simulated.append(gains[chosen])
        spare -= modules[chosen].weight.numel()
    return order, simulated


def search_float_layers(
    model: nn.Module, measure: Callable[[tuple[str, ...]], tuple[tuple[float, ...], T]], settings: Int8Settings, *,
    calibration: Sequence[Tensor], images: Tensor, max_float_weights: int | None = None,
    activation_levels: int = 256, progress: Callable[[str], None] | None = None,
) -> tuple[T, Int8Tuning]:  # fmt: skip
    """Keep as few layers of a float model in float as it takes for every step of its int8 form to agree with it
    on at least ``settings.min_agreement`` of ``images`` (not calibration, not test).

    The layers are ranked by :func:`layer_sensitivity` on the first 1,000 of the images (inputs fake-quantized to
    ``activation_levels`` levels), then put in the order that buys the most simulated agreement per weight kept
    in float, so that the int8 artifact stays small. The search starts at the fewest layers of that order whose
    simulation meets the target, and keeps one more in float at a time until the target is met,
    ``settings.max_float_layers`` are float, or no layer left fits in ``max_float_weights`` (the size budget: see
    :func:`anytime.deploy.export.float_weight_budget`). The other ``settings`` are the tasks' (they choose the
    calibration batches, the images and the budget).

    ``measure(layers)`` builds the real int8 form with ``layers`` in float and returns each step's agreement on
    all the images and whatever the caller keeps of it; the best one's comes back with the :class:`Int8Tuning`.
    The target not met is not an error (the tuning says so), since a user may accept the closest."""
    min_agreement, max_float_layers = settings.min_agreement, settings.max_float_layers
    if min_agreement is None or not 0.0 < min_agreement <= 1.0:
        raise AnytimeError(f"--min-agreement is a fraction of images in (0, 1] (got {min_agreement})")
    if max_float_layers < 0 or (max_float_weights is not None and max_float_weights < 0):
        raise AnytimeError(f"--max-float-layers and the float weight budget must be at least 0 "
                           f"(got {max_float_layers} and {max_float_weights})")  # fmt: skip
    if images.shape[0] == 0:
        raise AnytimeError("accuracy-aware int8 needs images to measure agreement on")
    model = model.eval()
    ranges = _input_ranges(model, quantizable_layers(model), calibration)
    simulated_on = images[:_SIMULATION_IMAGES]
    reference = _predictions(layout_of(model), float_parts(model), simulated_on)
    ranking = _ranked(model, ranges, activation_levels, simulated_on, reference)
    limit = min(max_float_layers, len(ranking))
    order, simulated = _cheapest_order(model, ranges, activation_levels, simulated_on, reference, ranking, limit,
                                       max_float_weights)  # fmt: skip
    limit = len(order)
    # Where to start: the fewest float layers whose simulation (every other layer fake-quantized) meets the target;
    # each real conversion costs a calibration and a lowering, so the search starts there, not at none.
    start = next((k for k, agreement in enumerate(simulated) if agreement >= min_agreement), limit)
    tried: list[tuple[tuple[str, ...], float]] = []
    best: tuple[T, tuple[float, ...], tuple[str, ...]] | None = None
    for count in range(start, limit + 1):
        layers = tuple(order[:count])
        agreement, kept = measure(layers)
        tried.append((layers, min(agreement)))
        if progress is not None:
            shown = ", ".join(layers) if layers else "none"
            progress(
                f"int8 with {count} layer(s) in float ({shown}): lowest step agreement {100 * min(agreement):.2f}%"
            )
        if best is None or min(agreement) > min(best[1]):
            best = (kept, agreement, layers)
        if min(agreement) >= min_agreement:
            break
    assert best is not None
    kept, agreement, layers = best
    modules = dict(model.named_modules())
    weights = sum(modules[name].weight.numel() for name in layers)
    return kept, Int8Tuning(layers, agreement, min_agreement, int(images.shape[0]), tuple(tried), ranking, weights,
                            max_float_weights)  # fmt: skip


def tune_int8(
    model: nn.Module, settings: Int8Settings, *, input_shape: tuple[int, ...], calibration: Sequence[Tensor],
    images: Tensor, max_float_weights: int | None = None, compile: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[PrecisionModel, dict[str, Tensor], Int8Tuning]:  # fmt: skip
    """int8 of a float model (PT2E, calibrated on ``calibration``, training images) whose every step agrees with
    the float model on at least ``settings.min_agreement`` of ``images``, keeping as few layers in float as it
    takes (:func:`search_float_layers`, each choice converted and measured). Returns the converted model, its state
    and the :class:`Int8Tuning`."""
    levels = 128 if backend_for("int8", torch.device("cpu")) == X86_7BIT else 256
    model = model.eval()

    def measure(layers: tuple[str, ...]) -> tuple[tuple[float, ...], tuple[PrecisionModel, dict[str, Tensor]]]:
        converted, state = convert(model, "int8", input_shape=input_shape, compile=compile,
                                   int8=Int8Recipe(calibration=calibration, float_layers=layers))  # fmt: skip
        return step_agreement(model, converted, images), (converted, state)

    (converted, state), tuning = search_float_layers(
        model, measure, settings, calibration=calibration, images=images, max_float_weights=max_float_weights,
        activation_levels=levels, progress=progress)  # fmt: skip
    return converted, state, tuning
