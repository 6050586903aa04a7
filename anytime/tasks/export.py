"""``anytime export RUN --format pt2|onnx [--precision P] --out DIR``: deployable artifacts of a run's steps,
a manifest, and the parity table (the torch2trt columns: step, data type, input shape, max abs error vs eager
fp32, top-1 agreement on real test images, latency and throughput of eager PyTorch vs the artifact).

A float run exports at fp32, or at int8 after calibration on its training images; a converted run
(``anytime quantize``) exports at its own precision, from its own calibration statistics, so the artifacts
compute what the quantized run computes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from anytime.contract import step_count
from anytime.deploy.export import ManifestLabels, export_model, float_weight_budget
from anytime.deploy.loader import ExportedModel, load_export
from anytime.deploy.manifest import EXPORT, MANIFEST, ExportManifest, check_exportable
from anytime.errors import AnytimeError
from anytime.precision import Int8Recipe, backend_for
from anytime.precision.tuning import Int8Settings, Int8Tuning, search_float_layers
from anytime.profile.latency import per_sample_latency
from anytime.profile.stats import quantile_of
from anytime.tasks.quantize import calibration_batches, tuning_images
from anytime.train.records import QUANT_STATE, precision_record, run_weights_fingerprint
from anytime.train.runs import LoadedRun, load_run, require_images, run_config
from anytime.train.splits import run_splits
from anytime.utils.io import write_csv, write_json
from anytime.utils.outputs import check_replaceable, staged_dir

PARITY_COLUMNS = (
    "step", "dtype", "input_shape", "images", "max_abs_err", "top1_agreement", "eager_p50_ms", "artifact_p50_ms",
    "eager_images_per_s", "artifact_images_per_s",
)  # fmt: skip
THROUGHPUT_BATCH = 32
TUNING = "tuning.json"


@dataclass(frozen=True)
class ParityRow:
    """One step of an artifact against the eager fp32 model: error, agreement, latency at batch 1 (p50) and
    throughput at batch 32."""

    step: int
    dtype: str
    input_shape: str
    images: int
    max_abs_err: float
    top1_agreement: float
    eager_p50_ms: float
    artifact_p50_ms: float
    eager_images_per_s: float
    artifact_images_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record, in the table's column order."""
        return {name: getattr(self, name) for name in PARITY_COLUMNS}


@dataclass(frozen=True)
class ParitySettings:
    """How :func:`export_run` measures the parity table: on ``images`` test images (0: no table), the batch-1
    latency the p50 over ``latency_images`` of them."""

    images: int = 1000
    latency_images: int = 50


@dataclass(frozen=True)
class ExportReport:
    """What ``export_run`` wrote: the folder, its manifest and the parity table (empty if not measured)."""

    out: Path
    manifest: ExportManifest
    parity: tuple[ParityRow, ...]
    tuning: Int8Tuning | None = None


def _step_logits(model: nn.Module, x: Tensor, k: int) -> Tensor:
    return model.forward_until(x, k) if step_count(model) > 1 else model(x)  # type: ignore[operator]


@torch.inference_mode()
def _compare(float_model: nn.Module, exported: ExportedModel, images: Tensor, k: int) -> tuple[float, float]:
    """Step ``k`` of an artifact against the eager float model on ``images``: the largest absolute logit
    difference and the share of images whose top-1 class agrees."""
    errors, agree = [], 0
    for start in range(0, images.shape[0], 256):
        x = images[start : start + 256]
        reference, answer = _step_logits(float_model, x, k).float(), exported.forward_until(x, k).float()
        errors.append(float((answer - reference).abs().max()))
        agree += int((answer.argmax(1) == reference.argmax(1)).sum())
    return max(errors), agree / images.shape[0]


@torch.inference_mode()
def parity_table(
    float_model: nn.Module, exported: ExportedModel, images: Tensor, *, latency_images: int = 50, batches: int = 4,
) -> list[ParityRow]:  # fmt: skip
    """Every step of ``exported`` against the eager fp32 model on ``images`` (real test images): the largest
    absolute difference of the logits and the share of images whose top-1 class agrees; then latency at batch 1
    (p50 over ``latency_images`` images) and throughput at batch 32 (median over ``batches`` batches), the two
    interleaved on the same inputs."""
    manifest = exported.manifest
    rows = []
    for k in range(manifest.num_steps):
        error, agreement = _compare(float_model, exported, images, k)
        functions = {
            "eager": lambda x, k=k: _step_logits(float_model, x, k),
            "artifact": lambda x, k=k: exported.forward_until(x, k),
        }
        single = per_sample_latency(functions, images[: latency_images + 5], warmup=5)
        count = min(images.shape[0], THROUGHPUT_BATCH * (batches + 1))
        batched = per_sample_latency(functions, images[:count], warmup=1, batch_size=THROUGHPUT_BATCH)
        rows.append(ParityRow(
            k, manifest.precision, "x".join(str(v) for v in manifest.input_shape), int(images.shape[0]),
            error, agreement, 1000 * quantile_of(single["eager"], 0.5),
            1000 * quantile_of(single["artifact"], 0.5), THROUGHPUT_BATCH / float(np.median(batched["eager"])),
            THROUGHPUT_BATCH / float(np.median(batched["artifact"])),
        ))  # fmt: skip
    return rows


@dataclass(frozen=True)
class _Calibration:
    """What int8 export calibrates from: a quantized run's own statistics (``state``) or training batches, and how
    many images either saw."""

    state: dict[str, Tensor] | None = None
    batches: list[Tensor] | None = None
    images: int | None = None


def _export_precision(source: Path, fmt: str, precision: str | None, record: dict[str, Any] | None,
                      calibration_images: int, parity_images: int) -> tuple[str, bool]:  # fmt: skip
    """One-line errors for a precision, format or count ``export_run`` cannot take; returns the precision to export
    at and whether the run was fine-tuned for int8 (QAT)."""
    own = record["precision"] if record is not None else "fp32"
    precision = precision or own
    check_exportable(fmt, precision)
    if record is not None and precision != own:
        raise AnytimeError(
            f"{source} is a {own} run; export it at {own}, or export the float run it came from at {precision}"
        )
    if precision == "int8" and fmt == "pt2":
        backend_for("int8", torch.device("cpu"))
    if calibration_images < 1 or parity_images < 0:
        raise AnytimeError("--calibration-images must be at least 1 and --parity-images at least 0")
    qat = bool(record and record.get("qat_epochs"))
    if qat and fmt == "onnx":
        raise AnytimeError(f"{source} was fine-tuned for int8 (QAT); export it as pt2 (ONNX int8 artifacts are "
                           "quantized by ONNX Runtime from float weights, which would drop the fine-tuning)")  # fmt: skip
    return precision, qat


def _int8_calibration(run: LoadedRun, source: Path, record: dict[str, Any] | None, fmt: str, precision: str,
                      calibration_images: int) -> _Calibration:  # fmt: skip
    """The statistics int8 export calibrates from (none for another precision)."""
    if precision == "int8" and record is not None and fmt == "pt2":  # the quantized run's own statistics
        from anytime.train.checkpoint import read_weights

        return _Calibration(state=read_weights(source / QUANT_STATE), images=record.get("calibration_images"))
    if precision == "int8":
        calibration = list(calibration_batches(run, calibration_images))
        return _Calibration(batches=calibration, images=sum(int(x.shape[0]) for x in calibration))
    return _Calibration()


def _search_layers(
    write: Callable[[Path, Sequence[str]], ExportManifest], float_model: nn.Module, run: LoadedRun, fmt: str,
    shape: tuple[int, ...], calibration: list[Tensor], int8: Int8Settings, progress: Callable[[str], None] | None,
) -> Int8Tuning:  # fmt: skip
    """The search for the layers int8 keeps in float: each choice exported by ``write`` and compared with the
    float model on validation images."""
    agreement_on = tuning_images(run, int8.agreement_images)
    budget = None
    if int8.min_size_ratio is not None:
        budget = float_weight_budget(float_model, fmt, input_shape=shape, num_classes=int(run.dataset["num_classes"]),
                                     name=run.config.model, calibration=calibration,
                                     min_size_ratio=int8.min_size_ratio)  # fmt: skip

    def measure(layers: tuple[str, ...]) -> tuple[tuple[float, ...], None]:
        with tempfile.TemporaryDirectory() as trial:
            manifest = write(Path(trial), layers)
            exported = load_export(trial)
            return tuple(_compare(float_model, exported, agreement_on, k)[1] for k in range(manifest.num_steps)), None

    _, tuning = search_float_layers(
        float_model, measure, int8, calibration=calibration, images=agreement_on, max_float_weights=budget,
        activation_levels=_activation_levels(fmt), progress=progress)  # fmt: skip
    return tuning


def _write_export(work: Path, manifest: ExportManifest, tuning: Int8Tuning | None, float_model: nn.Module,
                  images: Tensor | None, latency_images: int) -> list[ParityRow]:  # fmt: skip
    """Write the search and (with ``images``) the parity table beside the artifacts in ``work``; returns the
    table's rows."""
    if tuning is not None:
        write_json(work / TUNING, tuning.to_dict())
    rows: list[ParityRow] = []
    if images is not None:
        exported = load_export(work)
        rows = parity_table(float_model, exported, images, latency_images=latency_images)
        write_csv(work / "parity.csv", [r.to_dict() for r in rows], PARITY_COLUMNS)
        write_json(work / "parity.json", {"export": manifest.to_dict(), "backend": exported.backend,
                                          "threads": torch.get_num_threads(), "rows": [r.to_dict() for r in rows]})  # fmt: skip
    return rows


def export_run(
    run_dir: str | Path, fmt: str, parity: ParitySettings | None = None, int8: Int8Settings | None = None, *,
    out: str | Path, precision: str | None = None, overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ExportReport:  # fmt: skip
    """Export a run's steps as ``fmt`` artifacts into ``out`` with a manifest and (unless ``parity.images`` is 0)
    the parity table (default :class:`ParitySettings`), written as ``parity.csv`` and ``parity.json``. int8 from a
    float run is calibrated on ``int8.calibration_images`` training images and keeps ``int8.float_layers`` in
    float; a run quantized by ``anytime quantize`` keeps its own statistics and layers. int8 from a float run with
    ``int8.min_agreement`` chooses the layers instead, for this format's own quantizer: each choice is exported and
    its every step compared with the float model on ``agreement_images`` validation images (labels unread),
    keeping as few layers in float as reach the target (at most ``max_float_layers``, and no more weights than
    leave the artifact ``min_size_ratio`` times smaller than the fp32 one, when given); the search is written as
    ``tuning.json``."""
    parity = parity or ParitySettings()
    int8 = int8 or Int8Settings()
    source = Path(run_dir)
    run_config(source)  # a clear error for a folder that is not a run
    record = precision_record(source)
    precision, qat = _export_precision(source, fmt, precision, record, int8.calibration_images, parity.images)
    if (int8.float_layers or int8.min_agreement is not None) and (precision != "int8" or record is not None):
        raise AnytimeError("--float-layers and --min-agreement are for int8 from a float run; a quantized run exports "
                           "with the layers it kept in float")  # fmt: skip
    int8.check(precision)
    float_layers: Sequence[str] = int8.float_layers
    if record is not None and precision == "int8":
        float_layers = tuple(record.get("float_layers") or ())
    run = load_run(source, "cpu", converted=False)
    require_images(run, "anytime export")
    shape = (int(run.dataset["in_channels"]), *(int(v) for v in (run.dataset.get("image_size") or [32, 32])))
    calibrated = _int8_calibration(run, source, record, fmt, precision, int8.calibration_images)
    float_model = run.model.eval()
    images = _test_images(run, parity.images) if parity.images else None
    fingerprint = run_weights_fingerprint(source)

    def write(folder: Path, layers: Sequence[str]) -> ExportManifest:
        labels = ManifestLabels(run.config.model, int(run.dataset["num_classes"]), parent_run=str(source),
                                parent_fingerprint=fingerprint, calibration_images=calibrated.images)  # fmt: skip
        backend = record.get("backend") if record is not None and precision == "int8" else None
        recipe = Int8Recipe(calibration=calibrated.batches, state=calibrated.state, qat=qat, backend=backend,
                            float_layers=tuple(layers))  # fmt: skip
        return export_model(float_model, fmt, precision, folder, input_shape=shape, labels=labels, int8=recipe)

    tuning = None
    if int8.min_agreement is not None:
        check_replaceable(Path(out), EXPORT, overwrite=overwrite, create_parents=False)  # before minutes of search
        tuning = _search_layers(write, float_model, run, fmt, shape, calibrated.batches or [], int8, progress)
        float_layers = tuning.float_layers
    entries = (MANIFEST, "parity.csv", "parity.json", TUNING, f"*.{fmt}", "profile-*.json", "evaluation-*.json")
    with staged_dir(out, EXPORT, overwrite=overwrite, create_parents=False, entries=entries) as work:
        manifest = write(work, float_layers)
        rows = _write_export(work, manifest, tuning, float_model, images, parity.latency_images)
    return ExportReport(Path(out), manifest, tuple(rows), tuning)


def _activation_levels(fmt: str) -> int:
    """The activation levels the format's int8 quantizer uses on this CPU: PT2E's X86 quantizer keeps 7 bits
    where there is no VNNI; ONNX Runtime keeps 8-bit activations (it narrows the weights instead)."""
    from anytime.precision.model import X86_7BIT

    return 128 if fmt == "pt2" and backend_for("int8", torch.device("cpu")) == X86_7BIT else 256


def _test_images(run: LoadedRun, count: int) -> Tensor:
    from anytime.data import make_loader

    splits = run_splits(run)
    chosen = splits.test.sample(min(count, len(splits.test)), run.config.seed)
    return torch.cat(
        [x for x, _ in make_loader(chosen, splits.info, batch_size=256, train=False, seed=run.config.seed)]
    )
