"""``anytime quantize RUN --precision P``: a run whose steps are the parent run's steps at another precision.

The new run holds the parent's recipe and float weights, the precision record (precision, backend, compile
mode, parent run and fingerprint, library versions) and, for int8, the calibration statistics measured on
training images only; ``load_run`` rebuilds the converted model from them, so collect, sweep, calibrate,
evaluate, profile, schedule and the runtime take the new run as they take any run. Its summary reports every
step's validation and test accuracy beside the parent's.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from anytime.data import make_loader
from anytime.data.base import DatasetSplits
from anytime.data.text import TOKENIZER_FILE
from anytime.errors import AnytimeError
from anytime.precision import Int8Recipe, PrecisionModel, backend_for, convert
from anytime.precision.int8 import graph_state, prepare_qat
from anytime.precision.parts import layout_of, run_parts
from anytime.precision.tuning import Int8Settings, Int8Tuning, tune_int8
from anytime.train.evaluation import evaluate_exits
from anytime.train.records import QUANT_STATE, WEIGHTS, baseline_record, ensemble_record, precision_record
from anytime.train.runs import LoadedRun, dataset_input_shape, load_run, run_config
from anytime.train.splits import run_splits
from anytime.train.summary import RunSummary
from anytime.utils.io import atomic_path, read_json, write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.outputs import RUN, RUN_ENTRIES, check_replaceable, staged_dir
from anytime.utils.quiet import quiet_torchao


@dataclass(frozen=True)
class QuantizeSettings:
    """How :func:`quantize_run` builds the converted run's graphs beyond int8's calibration (:class:`Int8Settings`).

    ``compile``: ``torch.compile`` the graphs (what makes int8 run as int8 kernels on a CPU); False keeps them
    eager, reference arithmetic: the same values, not int8 speed. ``qat_epochs``: int8 only, epochs of
    quantization-aware training after calibration (0: post-training quantization alone), from the initial
    learning rate ``qat_lr`` (SGD, cosine)."""

    compile: bool = True
    qat_epochs: int = 0
    qat_lr: float = 1e-3


_BATCH = 64


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _parent_accuracy(run_dir: Path, num_steps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    summary = read_json(run_dir / "summary.json", what="training summary", make="its training has not finished",
                        redo="train the run again")  # fmt: skip
    try:
        steps = [dict(e) for e in summary["exits"]] if num_steps > 1 else []
        final = dict(summary["final"])
    except (KeyError, TypeError):
        raise AnytimeError(f"{run_dir / 'summary.json'} does not hold every step's accuracy; was it edited?") from None
    if num_steps > 1 and len(steps) != num_steps:
        raise AnytimeError(f"{run_dir / 'summary.json'} has {len(steps)} steps but the model has {num_steps}")
    return steps, final


def calibration_batches(run: LoadedRun, count: int) -> Iterator[Tensor]:
    """``count`` training images of the run's data (seeded), in batches: what int8 calibration sees. Never
    validation (it picks thresholds) or test (it is only reported)."""
    splits = run_splits(run)
    chosen = splits.train.sample(min(count, len(splits.train)), run.config.seed)
    return (x for x, _ in make_loader(chosen, splits.info, batch_size=_BATCH, train=False, seed=run.config.seed))


def tuning_images(run: LoadedRun, count: int) -> Tensor:
    """``count`` validation images of the run's data (seeded), on which accuracy-aware int8 measures each step's
    agreement with the float model; their labels are not read, and calibration never sees them."""
    splits = run_splits(run)
    chosen = splits.val.sample(min(count, len(splits.val)), run.config.seed)
    loader = make_loader(chosen, splits.info, batch_size=_BATCH, train=False, seed=run.config.seed)
    return torch.cat([x for x, _ in loader])


def fine_tune_int8(
    run: LoadedRun, shape: tuple[int, ...], *, epochs: int, lr: float, calibration_images: int,
    progress: Callable[[str], None] | None = None, float_layers: Sequence[str] = (),
) -> dict[str, Tensor]:  # fmt: skip
    """Quantization-aware training: the run's parts as PT2E QAT graphs (fake-quantized weights and activations,
    batch norm folded into the convolutions), their ranges first set on ``calibration_images`` training images,
    then ``epochs`` epochs of SGD (momentum 0.9, the run's weight decay, cosine from ``lr``) on the training
    split with the run's augmentation, the mean cross-entropy of every step as the loss; observers are frozen
    for the second half of the epochs. Returns the trained graphs' state (what ``convert`` rebuilds the int8
    model from, as the ``state`` of an ``Int8Recipe`` with ``qat=True``)."""
    import torch.nn.functional as F

    with quiet_torchao():
        from torchao.quantization.pt2e import disable_observer
    layout = layout_of(run.model)
    prepared = prepare_qat(run.model, shape, float_layers=float_layers)
    with torch.no_grad():
        for x in calibration_batches(run, calibration_images):
            run_parts(layout, prepared, x)
    splits = run_splits(run)
    config = run.config
    params = [p for part in prepared for p in part.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=config.weight_decay)
    per_epoch = max(1, len(splits.train) // config.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / (epochs * per_epoch)))
    )
    for epoch in range(epochs):
        if epochs > 1 and epoch == (epochs + 1) // 2:
            for part in prepared:
                part.apply(disable_observer)
        total, count = 0.0, 0
        loader = make_loader(splits.train, splits.info, batch_size=config.batch_size, train=True,
                             seed=config.seed + 1000 + epoch, drop_last=True)  # fmt: skip
        for x, y in loader:
            outputs = run_parts(layout, prepared, x)
            loss = sum(F.cross_entropy(o, y) for o in outputs) / len(outputs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total, count = total + float(loss.detach()) * y.numel(), count + y.numel()
        if progress is not None:
            progress(f"QAT epoch {epoch + 1}/{epochs}: training loss {total / max(count, 1):.4f}")
    return graph_state(prepared)


def _check_quantize_options(parent: Path, precision: str, device: str, calibration_images: int,
                            settings: QuantizeSettings) -> torch.device:  # fmt: skip
    """One-line errors for a run or an option ``quantize_run`` cannot take, before any work; returns the device the
    converted run runs on."""
    run_config(parent)  # a clear error for a folder that is not a run
    if precision_record(parent) is not None:
        raise AnytimeError(f"{parent} is already a converted run; quantize the float run it came from")
    if ensemble_record(parent) is not None or baseline_record(parent) is not None:
        raise AnytimeError(f"{parent} is an ensemble; quantize its members (anytime quantize MEMBER) and build an "
                           "ensemble of the quantized runs")  # fmt: skip
    # static int8 (PT2E, x86) runs on the CPU only: there "auto" can only mean the CPU
    target_device = resolve_device("cpu" if device == "auto" and precision == "int8" else device)
    backend_for(precision, target_device)  # refuses a precision this device cannot run, before any work
    if calibration_images < 1:
        raise AnytimeError(f"--calibration-images must be at least 1 (got {calibration_images})")
    epochs, lr = settings.qat_epochs, settings.qat_lr
    if epochs < 0 or (epochs and precision != "int8"):
        raise AnytimeError(f"--qat-epochs fine-tunes int8 (a whole number of epochs, got {epochs} for {precision})")
    if not (math.isfinite(lr) and lr > 0):
        raise AnytimeError(f"--qat-lr must be a positive learning rate (got {lr})")
    return target_device


def _check_quantizable(parent: Path, run: LoadedRun, precision: str, text: bool) -> None:
    """One-line errors for a loaded run static int8 cannot convert (a text run, or one that halts by position)."""
    if text and precision == "int8":
        raise AnytimeError(f"{parent} is a text run: static int8 (PT2E) quantizes convolutional image networks; "
                           "quantize a text encoder with --precision int8-dynamic (int8 Linear layers, the usual form "
                           "for transformers), bf16 or fp16")  # fmt: skip
    if precision == "int8" and getattr(run.model, "data_dependent_cost", False):
        raise AnytimeError(f"{parent} halts position by position (SACT), which torch.export cannot trace into an int8 "
                           "graph; quantize it with --precision int8-dynamic, bf16 or fp16")  # fmt: skip


def _tune_model(
    run: LoadedRun, shape: tuple[int, ...], calibration: list[Tensor], int8: Int8Settings, *, compile: bool,
    progress: Callable[[str], None] | None,
) -> tuple[PrecisionModel, dict[str, Tensor], Int8Tuning]:  # fmt: skip
    """The int8 model whose float layers :func:`tune_int8` chose for ``int8.min_agreement``, its state and the
    search."""
    budget = None
    if int8.min_size_ratio is not None:
        from anytime.deploy.export import float_weight_budget

        budget = float_weight_budget(run.model.eval(), "pt2", input_shape=shape, name=run.config.model,
                                     num_classes=int(run.dataset["num_classes"]), calibration=calibration,
                                     min_size_ratio=int8.min_size_ratio)  # fmt: skip
    return tune_int8(run.model, int8, input_shape=shape, calibration=calibration,
                     images=tuning_images(run, int8.agreement_images), max_float_weights=budget, compile=compile,
                     progress=progress)  # fmt: skip


def _accuracies(model: nn.Module, splits: DatasetSplits, seed: int,
                device: torch.device) -> tuple[list[float], list[float]]:  # fmt: skip
    """Every step's validation and test accuracy of ``model``."""
    loader_kw = {"batch_size": 256, "train": False, "seed": seed}
    _, val_accs = evaluate_exits(model, make_loader(splits.val, splits.info, **loader_kw), device)
    _, test_accs = evaluate_exits(model, make_loader(splits.test, splits.info, **loader_kw), device)
    return val_accs, test_accs


def _precision_entry(model: PrecisionModel, parent: Path, run: LoadedRun, precision: str, calibration_images: int,
                     train_images: int, settings: QuantizeSettings,
                     tuning: Int8Tuning | None) -> dict[str, Any]:  # fmt: skip
    """The precision record the converted run's config and summary hold."""
    qat_epochs, qat_lr = settings.qat_epochs, settings.qat_lr
    return {
        **model.spec.to_dict(), "parent_run": str(parent), "parent_fingerprint": run.fingerprint,
        "calibration_images": min(calibration_images, train_images) if precision == "int8" else None,
        "calibration_split": "train" if precision == "int8" else None,
        "qat_epochs": qat_epochs or None, "qat_lr": qat_lr if qat_epochs else None,
        "agreement_tuning": tuning.to_dict() if tuning is not None else None,
        "torch": torch.__version__, "torchao": _version("torchao"),
    }  # fmt: skip


def _quantized_summary(
    target: Path, run: LoadedRun, model: PrecisionModel, record: dict[str, Any], accs: tuple[list[float], list[float]],
    ptq: tuple[list[float], list[float]] | None, parent_acc: tuple[list[dict[str, Any]], dict[str, Any]],
    device: torch.device, now: str,
) -> dict[str, Any]:  # fmt: skip
    """The converted run's summary: every step's accuracy beside the parent's (and after PTQ alone, with QAT)."""
    (val_accs, test_accs), (parent_steps, parent_final) = accs, parent_acc
    qat = {"ptq_val_acc": ptq[0][-1], "ptq_test_acc": ptq[1][-1]} if ptq is not None else {}
    steps = [{**e, "val_acc": val_accs[k], "test_acc": test_accs[k], "parent_val_acc": e.get("val_acc"),
              "parent_test_acc": e.get("test_acc"),
              **({"ptq_val_acc": ptq[0][k], "ptq_test_acc": ptq[1][k]} if ptq is not None else {})}
             for k, e in enumerate(parent_steps)]  # fmt: skip
    summary: dict[str, Any] = {
        "run_dir": str(target), "model": run.config.model, "data": run.config.data, "precision": record,
        "dataset": {k: run.dataset.get(k) for k in ("name", "num_classes", "in_channels", "image_size", "source")},
        "final": {"val_acc": val_accs[-1], "test_acc": test_accs[-1], "parent_val_acc": parent_final.get("val_acc"),
                  "parent_test_acc": parent_final.get("test_acc"), **qat},
        "step_flops": list(model.step_flops), "device": device_label(device), "created": now,
    }  # fmt: skip
    if steps:
        summary["exits"] = steps
        summary["backbone_flops"] = int(model.backbone_flops)
    return summary


def _write_quantized(work: Path, parent: Path, run: LoadedRun, record: dict[str, Any], device: torch.device,
                     now: str, text: bool, state: dict[str, Tensor], summary: dict[str, Any]) -> None:  # fmt: skip
    """Write the converted run's files into the staged folder ``work``."""
    write_json(work / "config.json", {
        "train": run.config.to_dict(), "dataset": run.dataset, "precision": record, "device": str(device),
        "machine": describe_machine(), "git_sha": git_sha(), "created": now,
    })  # fmt: skip
    for name in (WEIGHTS, TOKENIZER_FILE) if text else (WEIGHTS,):  # a text run's token ids need its tokenizer
        with atomic_path(work / name) as tmp:
            shutil.copyfile(parent / name, tmp)
    if state:
        from safetensors.torch import save_file

        with atomic_path(work / QUANT_STATE) as tmp:
            save_file(state, str(tmp))
    write_json(work / "summary.json", summary)


def quantize_run(
    run_dir: str | Path, precision: str, settings: QuantizeSettings | None = None, int8: Int8Settings | None = None,
    *, device: str = "cpu", out: str | Path | None = None, overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> RunSummary:  # fmt: skip
    """Write ``out`` (default ``RUN-PRECISION`` beside the run): the run's steps at ``precision``, built as
    ``settings`` say (default :class:`QuantizeSettings`), and return its summary. int8 is calibrated on
    ``int8.calibration_images`` training images (never validation or test); with ``settings.qat_epochs`` it is
    then fine-tuned by quantization-aware training (:func:`fine_tune_int8`), and the summary reports every step
    after post-training quantization (``ptq_*``) and after QAT.

    int8 keeps ``int8.float_layers`` in float; or, with ``int8.min_agreement``, chooses them (:func:`tune_int8`: at
    most ``max_float_layers``) so that every step agrees with the float run on that share of ``agreement_images``
    validation images, keeping no more weights in float than leave the run's .pt2 int8 artifact
    ``min_size_ratio`` times smaller than the fp32 one (when given)."""
    settings = settings or QuantizeSettings()
    int8 = int8 or Int8Settings()
    parent = Path(run_dir)
    target_device = _check_quantize_options(parent, precision, device, int8.calibration_images, settings)
    int8.check(precision)
    target = Path(out) if out is not None else parent.with_name(f"{parent.name}-{precision}")
    check_replaceable(target, RUN, overwrite=overwrite, create_parents=out is None)
    run = load_run(parent, "cpu")
    text = run.dataset.get("modality") == "text"
    _check_quantizable(parent, run, precision, text)
    shape = dataset_input_shape(run.dataset)
    parent_acc = _parent_accuracy(parent, run.num_steps)
    splits = run_splits(run)
    seed = run.config.seed
    calibration = list(calibration_batches(run, int8.calibration_images)) if precision == "int8" else None
    tuning = None
    if int8.min_agreement is not None:
        model, state, tuning = _tune_model(run, shape, calibration or [], int8, compile=settings.compile,
                                           progress=progress)  # fmt: skip
    else:
        model, state = convert(run.model, precision, input_shape=shape, compile=settings.compile, device=target_device,
                               int8=Int8Recipe(calibration=calibration, float_layers=int8.float_layers))  # fmt: skip
    model = model.to(target_device)
    accs = _accuracies(model, splits, seed, target_device)
    ptq = None
    if settings.qat_epochs:
        ptq, layers = accs, model.spec.float_layers
        state = fine_tune_int8(run, shape, epochs=settings.qat_epochs, lr=settings.qat_lr,
                               calibration_images=int8.calibration_images, progress=progress,
                               float_layers=layers)  # fmt: skip
        model, _ = convert(run.model, "int8", input_shape=shape, compile=settings.compile,
                           int8=Int8Recipe(state=state, qat=True, float_layers=layers))  # fmt: skip
        accs = _accuracies(model, splits, seed, target_device)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = _precision_entry(model, parent, run, precision, int8.calibration_images, len(splits.train), settings,
                              tuning)  # fmt: skip
    summary = _quantized_summary(target, run, model, record, accs, ptq, parent_acc, target_device, now)
    with staged_dir(target, RUN, overwrite=overwrite, create_parents=out is None, entries=RUN_ENTRIES) as work:
        _write_quantized(work, parent, run, record, target_device, now, text, state, summary)
    return RunSummary.from_dict(summary)
