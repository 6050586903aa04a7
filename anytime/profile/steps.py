"""Measure every step of an anytime model on this device: the device profile.

Any model obeying the step contract (:mod:`anytime.contract`) is profiled on synthetic inputs of its input shape, so a board needs only the package and the weights.
A plain ``nn.Module`` is profiled as a single step.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.base import example_input, takes_tokens
from anytime.contract import is_incremental, run_step, step_count
from anytime.errors import AnytimeError
from anytime.profile.energy import BatchEnergy, EnergyMeter, EnergySettings, idle_power, measure_energy
from anytime.profile.energy_readers import EnergyReader
from anytime.profile.latency import paused_gc
from anytime.profile.store import BatchLatency, DeviceProfile
from anytime.profile.training import measure_train_step
from anytime.utils.machine import describe_machine, device_label
from anytime.utils.memory import allocator_state
from anytime.utils.progress import Bar, progress_bar
from anytime.utils.timer import Clock, monotonic

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 8, 16, 32)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _flops(model: nn.Module, x: Tensor, k: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        run_step(model, x, k)
    return int(counter.get_total_flops())


def _float_graph_flops(model: nn.Module, x: Tensor, k: int) -> int:
    """FLOPs of step ``k`` on ``x``, counted on a converted model's float graph (a quantized one counts as zero)."""
    graph = getattr(model, "float_model", model)
    device = next((p.device for p in graph.parameters()), x.device)
    return _flops(graph, x.to(device), k)


def _step_flops(model: nn.Module, x: Tensor, num_steps: int, tokens: bool) -> tuple[int, ...]:
    """FLOPs of each step on one sample ``x``. An image model's recorded FLOPs serve (its input has one shape); a
    sentence costs what its length costs, so a text model's are counted at this length: a converted model's on its
    float graph, an ensemble's from its members'."""
    recorded = getattr(model, "step_flops", None)
    if recorded is not None and not tokens:
        return tuple(recorded)
    infos = getattr(model, "infos", None)
    if infos is not None and hasattr(model, "step_flops_from"):
        members = [_float_graph_flops(m, x, i.step if i.step is not None else 0) for m, i in zip(model.members, infos)]
        return tuple(model.step_flops_from(members))
    return tuple(_float_graph_flops(model, x, k) for k in range(num_steps))


def _step_params(model: nn.Module, num_steps: int) -> tuple[int, ...]:
    info = getattr(model, "exit_info", None)
    if info is not None and len(info) == num_steps:
        return tuple(int(e.params) for e in info)
    total = sum(p.numel() for p in model.parameters())
    return (total,) * num_steps


def _payload(value: Any) -> list[Tensor]:
    """The plain tensors that hold a state entry's data: a tensor itself, a tensor subclass's inner tensors
    (torchao's int8 weights keep int8 values and float scales inside a tensor that reports the float dtype), the
    tensors of a tuple (torch.ao's packed weight and bias); nothing for other entries (a dtype)."""
    if isinstance(value, (tuple, list)):
        return [inner for item in value for inner in _payload(item)]
    if not isinstance(value, Tensor):
        return []
    if type(value) in (torch.Tensor, nn.Parameter) or not hasattr(value, "__tensor_flatten__"):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [inner for name in names for inner in _payload(getattr(value, name))]


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (the serialised payload)."""
    seen: set[int] = set()
    total = 0
    for tensor in (inner for value in model.state_dict().values() for inner in _payload(value)):
        try:
            key = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        except NotImplementedError:  # an opaque tensor (oneDNN's prepacked int8 weights) has no storage to share
            key = id(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _time_batch(model: nn.Module, x: Tensor, num_steps: int, incremental: bool, flip: bool,
                sync: Callable[[], None], clock: Callable[[], float]) -> tuple[list[float], list[float] | None]:  # fmt: skip
    """One repetition: each step alone (order flipped every other repetition, so that no step always runs
    on caches another one warmed) and, for incremental models, the stages of one pass through all steps."""
    stages: list[float] | None = None
    if incremental:
        stages = []
        sync()
        before = clock()
        for _ in model.steps(x):  # type: ignore[operator]
            sync()
            now = clock()
            stages.append((now - before) * 1000)
            before = now
        if len(stages) != num_steps:
            raise AnytimeError(f"the model's steps() yielded {len(stages)} steps but num_steps is {num_steps}")
    alone = [0.0] * num_steps
    order = range(num_steps - 1, -1, -1) if flip else range(num_steps)
    for k in order:
        sync()
        start = clock()
        run_step(model, x, k)
        sync()
        alone[k] = (clock() - start) * 1000
    return alone, stages


def _time_suffixes(
    parts: tuple[Sequence[nn.Module], Sequence[nn.Module]],
    x: Tensor,
    sync: Callable[[], None],
    clock: Callable[[], float],
    wait: Callable[[float], None],
    gap_s: float,
) -> list[list[float]]:
    """For each partition k before the last segment: segments 0..k run untimed, then, after the idle gap,
    stages k+1.. are timed as a split server runs them from a received activation (per stage, ms)."""
    segments, heads = parts
    last = len(segments) - 1
    out = []
    for k in range(last):
        h = x
        for segment in segments[: k + 1]:
            h = segment(h)
        if gap_s:
            wait(gap_s)
        times = []
        sync()
        before = clock()
        for j in range(k + 1, last + 1):
            h = segments[j](h)
            if j < last:
                heads[j](h)
            sync()
            now = clock()
            times.append((now - before) * 1000)
            before = now
        out.append(times)
    return out


def _energy(model: nn.Module, x: Tensor, num_steps: int, incremental: bool, sync: Callable[[], None],
            reader: EnergyReader, settings: EnergySettings, clock: Clock) -> BatchEnergy:  # fmt: skip
    """Joules per inference of every step alone and, for incremental models, of every exit path (one pass
    through exits 0..k, stopped there as an early exit stops)."""
    batch = x.shape[0]

    def alone(k: int) -> Callable[[], None]:
        def call() -> None:
            run_step(model, x, k)
            sync()

        return call

    def path(k: int) -> Callable[[], None]:
        def call() -> None:
            running = model.steps(x)  # type: ignore[operator]
            for i, _ in enumerate(running):
                if i == k:
                    break
            running.close()
            sync()

        return call

    steps = tuple(measure_energy(alone(k), reader, batch, settings, clock=clock, what=f"step {k} at batch {batch}")
                  for k in range(num_steps))  # fmt: skip
    paths = None
    if incremental:
        paths = tuple(measure_energy(path(k), reader, batch, settings, clock=clock, what=f"exit path {k} at batch {batch}")
                      for k in range(num_steps))  # fmt: skip
    return BatchEnergy(steps, paths)


def _cuda_memory(model: nn.Module, x: Tensor, num_steps: int) -> dict[str, Any]:
    device = x.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step(model, x, num_steps - 1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mb": peak / 2**20, "activations_mb": (peak - before) / 2**20, "how": "CUDA allocator peak"}


class _TrainedSteps(nn.Module):
    """The steps one training mini-batch runs, stacked: every one, or those the model's ``training_steps`` picks
    (SACT trains its last threshold only)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        if not hasattr(self.model, "training_steps"):
            return self.model(x)
        return torch.stack([self.model.forward_until(x, k) for k in self.model.training_steps()])  # type: ignore[operator]


def _training(model: nn.Module, x: Tensor, num_classes: int, repeats: int) -> dict[str, float]:
    trainee = copy.deepcopy(model)
    labels = torch.randint(0, num_classes, (x.shape[0],), device=x.device)
    multi = step_count(model) > 1

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        # Every trained step's cross-entropy, as joint training of an anytime model computes it, and the model's
        # own term (SACT's ponder cost)
        loss = sum(F.cross_entropy(o, y) for o in out) if multi else F.cross_entropy(out, y)
        return loss + trainee.auxiliary_loss() if hasattr(trainee, "auxiliary_loss") else loss  # type: ignore[return-value,operator]

    timing = measure_train_step(_TrainedSteps(trainee), x, labels, warmup=2, repeats=repeats, loss_fn=loss_fn)
    summary = timing.summary()
    return {
        key: summary[key] for key in ("forward_p50_s", "backward_p50_s", "step_p50_s", "total_p50_s", "images_per_s")
    }


def _real_batches(images: Tensor, size: int, count: int, device: torch.device) -> list[Tensor]:
    """``count`` batches of ``size`` taken in turn from ``images`` (wrapping round), at most as many as differ."""
    n = images.shape[0]
    count = min(count, max(1, n // math.gcd(n, size)))
    return [images[(torch.arange(size) + i * size) % n].to(device) for i in range(count)]


@dataclass(frozen=True)
class StepTiming:
    """How :func:`profile_model` times the steps.

    At each of ``batch_sizes`` (samples per batch, each at least 1), ``repeats`` (at least 1) timed repetitions
    follow ``warmup`` (at least 0) untimed ones.
    ``gap_s`` idles that long (seconds, 0 to 60) before every timed repetition, as a lightly loaded server idles
    between requests (a core that has idled runs the next request slower than one timed back to back).
    ``suffixes`` (a model with ``segments`` and ``heads``: exits, ensembles) also times, in every repetition, the
    stages after each partition point started from a stored activation after the same gap, as a split-computing
    server runs them (:attr:`BatchLatency.suffixes`). ``train`` adds a training mini-batch's forward, backward and
    optimiser times at each batch size (on a copy of the model), from ``train_repeats`` timed training steps.
    """

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    repeats: int = 200
    warmup: int = 10
    gap_s: float = 0.0
    suffixes: bool = False
    train: bool = False
    train_repeats: int = 10

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise AnytimeError(f"repeats must be at least 1 and warmup at least 0 (got {self.repeats}, {self.warmup})")
        if not (0 <= self.gap_s < 60):
            raise AnytimeError(f"the gap between repetitions must be between 0 and 60 s (got {self.gap_s})")


@dataclass(frozen=True)
class ModelIdentity:
    """What a profile records the model as: its ``name``, the ``fingerprint`` of its weights (None: none) and the
    ``num_classes`` it answers (the labels of a timed training step; None: read off its output)."""

    name: str = "model"
    fingerprint: str | None = None
    num_classes: int | None = None


@dataclass(frozen=True)
class ProfileInputs:
    """What the model is fed: random inputs drawn from ``seed``, since latency does not depend on the pixel values,
    unless ``images`` (real ones, ``[N, *input_shape]``, named ``label`` in the profile) are given for a model whose
    cost does (SACT): each repetition then takes the next images in turn."""

    images: Tensor | None = None
    label: str = "images given"
    seed: int = 0


@dataclass(frozen=True)
class Instruments:
    """What a profile reads and waits with: its clock, its sleep, and the probes of memory and energy.

    ``clock`` (seconds, monotonic) times the steps and ``sleep`` (seconds; None: :func:`time.sleep`) waits out the
    idle gaps and the idle power: tests inject fake ones. ``memory`` is a probe that measures the peak memory of
    each batch size elsewhere (e.g. in a fresh process) on a CPU; on a GPU it comes from the CUDA allocator.
    ``energy`` (a reader from :func:`anytime.profile.energy_readers.open_energy_reader`) adds joules per inference
    of every step (and exit path) at every batch size, measured as ``energy_settings`` says after the machine's
    idle power.
    """

    clock: Clock = monotonic
    sleep: Callable[[float], None] | None = None
    memory: Callable[[Sequence[int]], dict[int, dict[str, Any]]] | None = None
    energy: EnergyReader | None = None
    energy_settings: EnergySettings = EnergySettings()


@dataclass(frozen=True)
class _Bench:
    """What every batch size is measured with: the model, how its steps run, and how they are timed and waited."""

    model: nn.Module
    target: torch.device
    num_steps: int
    incremental: bool
    sync: Callable[[], None]
    clock: Clock
    wait: Callable[[float], None]
    parts: tuple[Sequence[nn.Module], Sequence[nn.Module]] | None


def profile_model(
    model: nn.Module, input_shape: Sequence[int], timing: StepTiming | None = None, *,
    device: str | torch.device = "cpu", identity: ModelIdentity | None = None, inputs: ProfileInputs | None = None,
    instruments: Instruments | None = None, progress: bool = False,
) -> DeviceProfile:  # fmt: skip
    """Measure every step (and, for incremental models, every stage) at each batch size, as ``timing`` says
    (default :class:`StepTiming`).

    ``input_shape`` is one sample's shape (``(3, 32, 32)``); the model is fed as ``inputs`` say (default
    :class:`ProfileInputs`: random ones) and recorded as ``identity`` says (default :class:`ModelIdentity`). On
    CUDA every timing is synchronised; peak memory comes from the CUDA allocator on a GPU, or from the memory probe
    of ``instruments`` (default :class:`Instruments`, which also holds the clock, the sleep and the energy reader)
    on a CPU. ``progress``: a bar on stderr.
    """
    timing = timing or StepTiming()
    identity = identity or ModelIdentity()
    inputs = inputs or ProfileInputs()
    tools = instruments or Instruments()
    wait = tools.sleep or time.sleep
    if timing.train and getattr(model, "spec", None) is not None:
        raise AnytimeError(
            "a converted (quantized or cast) model has no training step to time; profile its float run with --train"
        )
    parts = _suffix_parts(model) if timing.suffixes else None
    sizes = sorted({int(b) for b in timing.batch_sizes})
    if not sizes or sizes[0] < 1:
        raise AnytimeError(f"batch sizes must be positive whole numbers (got {list(timing.batch_sizes)})")
    target = _profiled_device(model, device)
    was_training = model.training
    model.eval()
    num_steps = step_count(model)
    incremental = is_incremental(model) and num_steps > 1
    bench = _Bench(model, target, num_steps, incremental, _sync(target), tools.clock, wait, parts)
    generator = torch.Generator().manual_seed(inputs.seed)
    latency: dict[int, BatchLatency] = {}
    meter = None
    if tools.energy is not None:
        idle = idle_power(tools.energy, tools.energy_settings.idle_s, clock=tools.clock, sleep=tools.sleep)
        meter = EnergyMeter(tools.energy.source, tools.energy_settings, idle)
    bar = progress_bar(len(sizes) * (timing.warmup + timing.repeats), "profile", enabled=progress, unit="rep")
    try:
        with torch.inference_mode():
            tokens = takes_tokens(model)
            sample = example_input(input_shape, 1, tokens=tokens, generator=generator).to(target)
            flops = _step_flops(model, sample, num_steps, tokens)
            classes = identity.num_classes or int(run_step(model, sample, num_steps - 1).shape[-1])
            for b in sizes:
                x = example_input(input_shape, b, tokens=tokens, generator=generator).to(target)
                images, count = inputs.images, timing.warmup + timing.repeats
                batches = [x] if images is None else _real_batches(images, b, count, target)
                latency[b] = _batch_latency(bench, b, x, batches, timing, tools, bar)
        if timing.train:
            for b in sizes:
                x = example_input(input_shape, b, tokens=tokens, generator=generator).to(target)
                latency[b] = replace(latency[b], training=_training(model, x, classes, timing.train_repeats))
    finally:
        bar.close()
        model.train(was_training)
    if tools.memory is not None and target.type != "cuda":
        for b, figures in tools.memory(sizes).items():
            latency[b] = replace(latency[b], memory=figures)
    return _device_profile(bench, input_shape, timing, identity, inputs, flops, latency, meter)


def _suffix_parts(model: nn.Module) -> tuple[Sequence[nn.Module], Sequence[nn.Module]]:
    """The segments and heads a split-computing server runs after each partition point (refused for a model
    without)."""
    segments, heads = getattr(model, "segments", None), getattr(model, "heads", None)
    if not isinstance(segments, (tuple, list)) or heads is None or len(segments) < 2:
        raise AnytimeError("--suffixes times what a split-computing server runs after each partition point: it "
                           "needs a run with exits or an ensemble")  # fmt: skip
    return (tuple(segments), list(heads))  # fetched once: an ensemble's segments share one pass's state


def _profiled_device(model: nn.Module, device: str | torch.device) -> torch.device:
    """The device the profile is asked for, refused where the model is on another kind of device."""
    target = torch.device(device)
    where = next((t.device for t in list(model.parameters()) + list(model.buffers())), target)
    if where.type != target.type:
        raise AnytimeError(
            f"the model is on {where} but the profile is asked for {target}; move it first (model.to('{target}'))"
        )
    return target


def _batch_latency(bench: _Bench, b: int, x: Tensor, batches: list[Tensor], timing: StepTiming, tools: Instruments,
                   bar: Bar) -> BatchLatency:  # fmt: skip
    """One batch size: the untimed warmup, the timed repetitions (each after the idle gap, the suffixes timed too
    where asked), then the peak memory on CUDA and the energy where a reader is given."""
    model, sync, clock = bench.model, bench.sync, bench.clock
    num_steps, incremental = bench.num_steps, bench.incremental
    for i in range(timing.warmup):
        _time_batch(model, batches[i % len(batches)], num_steps, incremental, i % 2 == 1, sync, clock)
        bar.update(1)
    alone: list[list[float]] = []
    stages: list[list[float]] = []
    after: list[list[list[float]]] = []
    with paused_gc():
        for i in range(timing.repeats):
            if timing.gap_s:
                bench.wait(timing.gap_s)
            batch = batches[(timing.warmup + i) % len(batches)]
            a, s = _time_batch(model, batch, num_steps, incremental, i % 2 == 1, sync, clock)
            alone.append(a)
            if s is not None:
                stages.append(s)
            if bench.parts is not None:
                after.append(_time_suffixes(bench.parts, batch, sync, clock, bench.wait, timing.gap_s))
            bar.update(1)
    mem = _cuda_memory(model, x, num_steps) if bench.target.type == "cuda" else None
    joules = None if tools.energy is None else _energy(model, x, num_steps, incremental, sync, tools.energy,
                                                       tools.energy_settings, clock)  # fmt: skip
    return BatchLatency(
        b, tuple(np.asarray(alone).T.copy()), tuple(np.asarray(stages).T.copy()) if incremental else None,
        memory=mem, energy=joules,
        suffixes=None if bench.parts is None else tuple(
            tuple(np.asarray([rep[k] for rep in after]).T.copy()) for k in range(num_steps - 1)),
    )  # fmt: skip


def _device_profile(bench: _Bench, input_shape: Sequence[int], timing: StepTiming, identity: ModelIdentity,
                    inputs: ProfileInputs, flops: tuple[int, ...], latency: dict[int, BatchLatency],
                    meter: EnergyMeter | None) -> DeviceProfile:  # fmt: skip
    """The profile of what was measured, with the machine and the settings it was measured under."""
    model, num_steps, target = bench.model, bench.num_steps, bench.target
    return DeviceProfile(
        model_fingerprint=identity.fingerprint, model=identity.name, input_shape=tuple(int(v) for v in input_shape),
        incremental=bench.incremental, step_names=step_names(model, num_steps), step_flops=flops,
        step_params=_step_params(model, num_steps), model_bytes=getattr(model, "artifact_bytes", None) or weights_bytes(model), latency=latency,
        device={**describe_machine(), "type": target.type, "index": target.index, "label": device_label(target)},
        settings={"repeats": timing.repeats, "warmup": timing.warmup, "threads": torch.get_num_threads(),
                  "seed": inputs.seed, "precision": _precision(model),
                  "form": getattr(model, "inference_form", "eager"),
                  "inputs": "random normal" if inputs.images is None else inputs.label, "gap_ms": 1000 * timing.gap_s,
                  "suffixes": timing.suffixes, "allocator": allocator_state(),
                  **({"execution": model.execution} if hasattr(model, "execution") else {}),
                  "timer": "perf_counter" + (", CUDA synchronised" if target.type == "cuda" else "")},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), energy=meter,
    )  # fmt: skip


def _precision(model: nn.Module) -> dict[str, Any]:
    """What the profile measured: the precision, the backend that ran it and whether it was compiled."""
    spec = getattr(model, "spec", None)
    if spec is not None:
        return spec.to_dict()
    members = getattr(model, "member_precisions", None)  # an ensemble: each member at its own precision
    if members:
        return {"precision": "+".join(dict.fromkeys(members)), "backend": "each member's own", "compile": None,
                "members": list(members)}  # fmt: skip
    return {"precision": "fp32", "backend": "eager", "compile": False}


def step_names(model: nn.Module, num_steps: int) -> tuple[str, ...]:
    """``exit0``, ``exit1``... for exits (their own names are points in the backbone); the names other
    families give their steps (``x0.5``, ``4/9 blocks``); ``step0``... for anything else."""
    from anytime.families import MultiExitModel

    info = getattr(model, "exit_info", None)
    if info is not None and len(info) == num_steps:
        exits = isinstance(getattr(model, "float_model", model), MultiExitModel)
        return tuple(f"exit{e.index}" if exits else e.name for e in info)
    return tuple(f"step{k}" for k in range(num_steps))
