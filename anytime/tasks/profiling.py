"""Profile a run on this device: every step's latency, the runtime's answer prices, memory and energy."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from anytime.backbones.footprint import check_forward_memory
from anytime.calibrate import (
    ExitPolicy,
)
from anytime.errors import AnytimeError
from anytime.profile.energy import EnergySettings
from anytime.profile.energy_readers import open_energy_reader
from anytime.profile.store import PROFILE_FORMAT, STEADY_WITHIN, DeviceProfile, Steadiness, device_slug
from anytime.scheduler.pricing import DEFAULT_GAP_MS, AnswerPricing, price_answers
from anytime.scheduler.query import (
    CALIBRATION,
    load_calibration,
)  # fmt: skip
from anytime.tasks.collect import input_shape
from anytime.train.folder import RunFolder
from anytime.train.runs import LoadedRun, load_run
from anytime.train.splits import load_splits
from anytime.utils.machine import device_label, resolve_device
from anytime.utils.memory import hold_freed_memory
from anytime.utils.outputs import check_output_file, output_lock
from anytime.utils.threads import set_threads


def default_profile_path(run_dir: str | Path, device: torch.device, *, length: int | None = None) -> Path:
    """Where ``anytime profile`` writes by default: ``RUN/profile-<device>.json``, named as the profile names
    the device (``-T<length>`` added for a text run's sentence length)."""
    bucket = "" if length is None else f"-T{length}"
    return Path(run_dir) / f"profile-{device_slug({'type': device.type, 'label': device_label(device)})}{bucket}.json"


PROFILE_IMAGES = 512  # validation images a data-dependent model is timed on


@dataclass(frozen=True)
class ProfileSettings:
    """What a profile measures and how (:func:`profile_run`).

    ``batch_sizes`` (default the profile's usual set), ``repeats`` timed and ``warmup`` untimed calls per step and
    batch size; ``train`` times training steps instead; ``memory`` measures the peak memory of each batch size.
    ``form`` is the inference form measured and ``threads`` the torch threads (a number, ``auto``: chosen from the
    cores the machine leaves free, or None: as they are); both are recorded in the profile, and the runtime runs
    with them. ``energy`` adds joules per inference. ``execution`` is a SACT model's (``sparse`` or ``dense``).
    ``slowdown`` > 1 profiles a slower board emulated here. ``gap_ms`` idles before every timed repetition;
    ``suffixes`` also times what a split-computing server runs after each partition point. ``length`` is a text
    run's sentence length in tokens. ``steady_within`` and ``attempts`` take the profile again while the machine
    is not steady; ``answer_gap_ms`` spaces the requests whose answer prices are timed (None: no prices)."""

    batch_sizes: tuple[int, ...] | None = None
    repeats: int = 200
    warmup: int = 10
    train: bool = False
    memory: bool = True
    form: str = "eager"
    threads: int | str | None = None
    energy: EnergySettings | None = None
    execution: str | None = None
    slowdown: float = 1.0
    gap_ms: float = 0.0
    suffixes: bool = False
    length: int | None = None
    steady_within: float | None = STEADY_WITHIN
    attempts: int = 3
    answer_gap_ms: float | None = DEFAULT_GAP_MS

    def __post_init__(self) -> None:
        if self.steady_within is not None and not (self.steady_within > 0 and math.isfinite(self.steady_within)):
            raise AnytimeError(f"--steady-within is a share above 0, e.g. 0.25, or off (got {self.steady_within})")
        if self.attempts < 1:
            raise AnytimeError(f"attempts must be at least 1 (got {self.attempts})")
        if not 0 <= self.gap_ms < 60_000:
            raise AnytimeError(f"--gap-ms is an idle time in milliseconds between 0 and 60000 (got {self.gap_ms:g})")


def _real_inputs(run: LoadedRun, model: torch.nn.Module) -> torch.Tensor | None:
    """The validation images to time a model whose cost depends on them (None for any other)."""
    if not getattr(model, "data_dependent_cost", False):
        return None
    from anytime.data.augment import normalize

    splits = load_splits(run.config, run.run_dir)
    count = min(PROFILE_IMAGES, len(splits.val))
    return normalize(splits.val.images[torch.arange(count)], splits.info.mean, splits.info.std)


def _pricing_policy(run_dir: str | Path, fingerprint: str | None, num_steps: int) -> ExitPolicy | None:
    """The run's calibrated policy, if it has one: what its requests consult on the way through the heads."""
    path = Path(run_dir) / CALIBRATION
    if num_steps < 2 or not path.is_file():
        return None
    policy, _ = load_calibration(path, fingerprint=fingerprint, num_steps=num_steps)
    return policy


def profile_run(
    run: RunFolder | str | Path, settings: ProfileSettings | None = None, *, device: str = "cpu",
    out: str | Path | None = None, progress: bool = False,
) -> tuple[DeviceProfile, Path]:  # fmt: skip
    """Profile a finished run's model (an open :class:`~anytime.train.folder.RunFolder`, or its path), or an
    export's artifacts (the folder ``anytime export`` wrote), on this device as
    ``settings`` say (default :class:`ProfileSettings`; synthetic inputs, so no dataset is needed, except for
    SACT: see below) and save it. ``energy`` is measured with the device's energy source (refused before any
    measurement when none is readable). A model whose cost depends on the image (SACT) is timed on the run's
    validation images instead (so its data must be on this machine), in its ``execution`` (default the model's
    own), which the profile records and the runtime runs. ``slowdown`` > 1 emulates a slower board
    (:func:`anytime.profile.slowed.slowed_model`), recorded as ``emulated_slowdown``, for ``anytime split-run
    --emulate-slowdown``. ``gap_ms`` idles as a server idles between sporadic requests; ``suffixes`` times what
    ``anytime split`` prices the server's part from. A text run is timed on sentences of ``length`` tokens (default
    its maximum length), as a sentence costs what its length costs; its default file is
    ``RUN/profile-<device>-T<length>.json``, one per length bucket.

    On a CPU the peak memory of each batch size is measured in a fresh process (random inputs, the model's default
    execution); on a GPU, by the allocator.

    A profile taken while other work came and went on the machine is taken again: where the tails of the
    repetitions' two halves part by more than ``steady_within`` (a share; :meth:`DeviceProfile.steadiness`), up to
    ``attempts`` profiles in all, and the steadiest is kept, its spread recorded (``settings.steadiness``).
    ``steady_within=None`` takes one profile, as does an energy measurement.

    Last, the runtime's answer prices are timed (:func:`anytime.scheduler.pricing.price_answers`, the run's
    calibrated policy consulted on the way through the heads where it has one), requests spaced by idle gaps of
    mean ``answer_gap_ms`` (0: back to back; None: no prices, the model's own latencies price the options).
    """
    from anytime.profile import DEFAULT_BATCH_SIZES

    settings = settings or ProfileSettings()
    choice = set_threads(settings.threads)
    hold_freed_memory()  # the runtime holds it too (runner_for_run): both meet the same allocator
    folder = run if isinstance(run, RunFolder) else None
    run_dir = run.path if isinstance(run, RunFolder) else run
    timed = _timed_model(run_dir, folder, device, settings)
    sizes = list(settings.batch_sizes or DEFAULT_BATCH_SIZES)
    shape = timed.shape
    default = default_profile_path(run_dir, timed.device, length=shape[0] if len(shape) == 1 else None)
    target = check_output_file(Path(out) if out else default, what="profile", format_tag=PROFILE_FORMAT, create_parents=out is None,
                               example="profile.json")  # fmt: skip
    largest = max(sizes)
    check_forward_memory(timed.model, shape, largest, training=settings.train, what=f"profiling at batch {largest}",
                         hint="profile smaller --batch-sizes, e.g. 1,8,16,32")  # fmt: skip
    energy = settings.energy
    reader = None if energy is None else open_energy_reader(timed.device.type, timed.device.index)
    try:
        with output_lock(target):
            profile = _steadiest(run_dir, timed, sizes, settings, reader, progress)
            if choice is not None:
                profile = replace(profile, settings={**profile.settings, "threads_chosen": choice.to_dict()})
            if settings.slowdown != 1:
                profile = replace(profile, settings={**profile.settings, "emulated_slowdown": float(settings.slowdown)})
            if settings.answer_gap_ms is not None:
                policy = _pricing_policy(run_dir, timed.fingerprint, profile.num_steps)
                pricing = AnswerPricing(repeats=settings.repeats, gap_ms=settings.answer_gap_ms)
                profile = price_answers(timed.model, profile, pricing=pricing, policy=policy, inputs=timed.inputs)
            path = profile.save(target)
    finally:
        if reader is not None:
            reader.close()
    return profile, path


@dataclass(frozen=True)
class _Timed:
    """What a profile times: the model (or export) with its input shape, names and device."""

    model: torch.nn.Module
    shape: tuple[int, ...]
    name: str
    fingerprint: str | None
    classes: int | None
    device: torch.device
    inputs: torch.Tensor | None  # real validation images, for a model whose cost depends on them


def _timed_model(run_dir: str | Path, folder: RunFolder | None, device: str, settings: ProfileSettings) -> _Timed:
    """The run's model (in the profiled form, execution and emulated slowdown) or the export's artifacts."""
    from anytime.deploy.manifest import MANIFEST

    length, form, train = settings.length, settings.form, settings.train
    if (Path(run_dir) / MANIFEST).is_file():
        if length is not None:
            raise AnytimeError(f"{run_dir} is an export of images; --length is a text run's sentence length")
        if form != "eager":
            raise AnytimeError(f"{run_dir} is an export: its artifacts run as exported; --form applies to a run")
        model, shape, name, fingerprint, classes, target_device = _export_target(run_dir, device, train)
        inputs = None
    else:
        if train and form != "eager":
            raise AnytimeError("--train times the training graph: profile it with --form eager")
        run = folder.load(device, form=form) if folder is not None else load_run(run_dir, device, form=form)
        model, shape, name, fingerprint = run.model, input_shape(run), run.name, run.fingerprint
        if run.dataset.get("modality") == "text":
            if length is not None and not 2 <= length <= shape[0]:
                raise AnytimeError(f"--length {length}: {run_dir} reads sentences of 2 to {shape[0]} tokens "
                                   "([CLS] included; longer ones are cut to its maximum)")  # fmt: skip
            shape = (length or shape[0],)
        classes, target_device = int(run.dataset["num_classes"]), run.device
        inputs = _real_inputs(run, model)
    if settings.execution is not None:
        if not hasattr(model, "execution"):
            raise AnytimeError("--execution chooses how a SACT run skips positions; this run has no such choice")
        model.execution = settings.execution  # type: ignore[assignment]
    if settings.slowdown != 1:
        from anytime.profile.slowed import slowed_model

        if train or settings.energy is not None:
            raise AnytimeError("--emulate-slowdown emulates a board's inference time; profile --train or --energy "
                               "without it")  # fmt: skip
        model = slowed_model(model, settings.slowdown)
    if length is not None and len(shape) != 1:
        raise AnytimeError(f"--length is a sentence length in tokens; {run_dir} is an image run")
    return _Timed(model, tuple(shape), name, fingerprint, classes, target_device, inputs)


def _steadiest(run_dir: str | Path, timed: _Timed, sizes: list[int], settings: ProfileSettings,
               reader: Any, progress: bool) -> DeviceProfile:  # fmt: skip
    """Profile up to ``settings.attempts`` times while the machine is not steady; the steadiest profile, with
    the peak memory of the first and its spread recorded."""
    from anytime.profile import Instruments, ModelIdentity, ProfileInputs, StepTiming, profile_model, run_isolated
    from anytime.profile.memory import inference_memory

    def probe(sizes: list[int]) -> dict[int, dict[str, Any]]:
        threads = torch.get_num_threads()
        try:
            return {b: run_isolated(inference_memory, str(run_dir), b, threads=threads, timeout_s=600) for b in sizes}
        except RuntimeError as exc:
            raise AnytimeError(f"the peak-memory measurement failed ({exc}); profile with --no-memory") from None

    steady_within, inputs = settings.steady_within, timed.inputs
    timing = StepTiming(batch_sizes=tuple(sizes), repeats=settings.repeats, warmup=settings.warmup,
                        gap_s=settings.gap_ms / 1000, suffixes=settings.suffixes, train=settings.train)  # fmt: skip
    identity = ModelIdentity(timed.name, timed.fingerprint, timed.classes)
    fed = ProfileInputs(inputs, f"{0 if inputs is None else inputs.shape[0]} validation images, in turn")
    tries = 1 if steady_within is None or settings.energy is not None else settings.attempts
    profile: DeviceProfile | None = None
    kept: Steadiness | None = None
    for attempt in range(1, tries + 1):
        taken = profile_model(
            timed.model, timed.shape, timing, device=timed.device, identity=identity, inputs=fed,
            instruments=Instruments(memory=probe if settings.memory and attempt == 1 else None, energy=reader,
                                    energy_settings=settings.energy or EnergySettings()),
            progress=progress,
        )  # fmt: skip
        steady = taken.steadiness()
        if profile is None:
            first = taken
        elif kept is not None and steady.spread >= kept.spread:
            continue
        profile, kept = taken, steady
        if steady_within is not None and steady.spread <= steady_within:
            break
    assert profile is not None and kept is not None
    if profile is not first:  # the peak memory was measured once, with the first attempt
        profile = replace(profile, latency={b: replace(at, memory=first.latency[b].memory)
                                            for b, at in profile.latency.items()})  # fmt: skip
    steadiness = {"spread": round(kept.spread, 4), "where": kept.where, "attempts": attempt, "within": steady_within}
    return replace(profile, settings={**profile.settings, "steadiness": steadiness})


def _export_target(
    folder: str | Path, device: str, train: bool
) -> tuple[torch.nn.Module, tuple[int, ...], str, str, int, torch.device]:
    """An export's artifacts as ``profile_run`` measures them: on the CPU (ONNX through ONNX Runtime)."""
    from anytime.deploy.loader import load_export

    if train:
        raise AnytimeError(f"{folder} is an export (inference artifacts); profile training with its float run")
    if resolve_device(device).type != "cpu":
        raise AnytimeError(f"{folder} is profiled on the CPU here; on a GPU board build a TensorRT engine from the ONNX "
                           "export and time it with trtexec (see docs/guides/export.md, On a Jetson)")  # fmt: skip
    exported = load_export(folder)
    manifest = exported.manifest
    name = f"{manifest.model} ({manifest.format} {manifest.precision}, {exported.backend})"
    return exported, manifest.input_shape, name, manifest.fingerprint, manifest.num_classes, torch.device("cpu")
