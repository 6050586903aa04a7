"""Study: precision as a dimension of every model: eager fp32, compiled fp32, int8 PTQ (and QAT), bf16, ONNX Runtime
fp32 and int8, side by side.

For each model and variant: latency p50/p99 at batch 1 and throughput at batch 32 (all variants of a model timed
interleaved on the same inputs), the artifact's size on disk (.pt2 for PyTorch variants, .onnx for ONNX Runtime),
the largest logit difference and the top-1 agreement with eager fp32, and, for trained runs, test accuracy. The
columns reproduce the seed's torch2trt table (name, data type, input shape, max error, throughput, latency).

Models: torchvision's classifiers at 3x224x224 and the zoo's CIFAR models at 3x32x32, both with random weights
(time, size and error only: batch-norm statistics, inputs and int8 calibration images are random; their logits
are nearly tied, so read their error, not their top-1 agreement), and the trained CIFAR-10 runs on disk
(RUNS, those present; the last step of a multi-exit run), calibrated on training images, scored on test images,
and fine-tuned by QAT_EPOCHS of quantization-aware training (full mode only).

On a CUDA GPU (`--device cuda`) the variants are what a GPU runs: eager and compiled fp32, eager and compiled fp16,
eager bf16, and ONNX Runtime fp32 through its CUDA provider where the installed build has one; int8 static
quantization (PT2E, X86InductorQuantizer) runs on x86 CPUs only, and a GPU's int8 is a TensorRT engine built from the
ONNX export (docs/guides/export.md, "On a Jetson").

Run: `anytime experiment precision [--quick] [--device cpu|cuda] [--out DIR] [--overwrite]` (quick: a few minutes;
full: about an hour on 2 CPU cores). Writes: results.csv, results.json, config.json and precision.png / .svg.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from anytime.backbones import create_model
from anytime.data import make_loader
from anytime.deploy.export import ManifestLabels, export_model
from anytime.deploy.loader import load_export, onnxruntime_providers
from anytime.plotting.precision import plot_precision
from anytime.precision import Int8Recipe, convert
from anytime.precision.tuning import Int8Settings
from anytime.profile import per_sample_latency
from anytime.profile.stats import quantile_of
from anytime.tasks.quantize import QuantizeSettings, calibration_batches, quantize_run
from anytime.train import load_splits
from anytime.train.runs import load_run
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import cpu_model, device_label, resolve_device
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress, write_line
from anytime.utils.results import study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
TV_MODELS = ("resnet18", "resnet50", "mobilenet_v2", "squeezenet1_1", "densenet121", "vgg11_bn")  # 3x224x224
ZOO_MODELS = ("resnet20", "resnet32", "resnet18", "mobilenetv2", "vgg11")  # 3x32x32
RUNS = ("runs/cifar10-resnet20", "runs/cifar10-resnet20-5ep", "runs/cifar10-resnet32-exits",
        "runs/cifar10-resnet32-exits-12ep")  # trained CIFAR-10 runs, used when present  # fmt: skip
CALIBRATION_IMAGES = 512  # int8 calibration: training images (runs) or random images (random weights)
EVAL_IMAGES = 1000  # images compared with eager fp32 (error, agreement); test images for runs
ACCURACY_IMAGES = 10_000  # test images scored for accuracy (runs)
LATENCY_REPEATS = 100  # batch-1 timings per variant (a p99 needs at least 100)
THROUGHPUT_BATCHES = 5  # timed batches of 32 per variant
WARMUP = 5  # untimed calls first (compiled variants compile here)
QAT_EPOCHS = 1  # quantization-aware training of the runs (0: none)
QAT_LR = 1e-3
SEED = 0
QUICK = {"TV_MODELS": ("resnet18", "mobilenet_v2"), "ZOO_MODELS": ("resnet20",), "EVAL_IMAGES": 200,
         "ACCURACY_IMAGES": 2000, "LATENCY_REPEATS": 20, "THROUGHPUT_BATCHES": 2, "QAT_EPOCHS": 0, "RUNS": 1}  # fmt: skip
# ------------------------------------------------------------------------------------------------------
TAKES_DEVICE = True  # `anytime experiment precision --device cuda` passes it on


class _LastStep(nn.Module):
    """A model of several steps answering with its last (the whole network)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        steps = int(getattr(self.model, "num_steps", 1))
        return self.model.forward_until(x, steps - 1) if steps > 1 else self.model(x)  # type: ignore[operator]


def _with_batch_statistics(model: nn.Module, shape: tuple[int, ...], generator: torch.Generator) -> nn.Module:
    """Random weights with batch-norm statistics measured on random images: without them a fresh network's
    activations vanish layer by layer (torchvision's MobileNetV2 answers logits of about 1e-9), and every
    error would look negligible."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # a plain average over the batches below
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, *shape, generator=generator))
    return model.eval()


def _exported_sizes(model: nn.Module, shape: tuple[int, ...], calibration: list[Tensor], scratch: Path,
                    artifacts: tuple[tuple[str, str], ...]) -> dict[str, int]:  # fmt: skip
    """Export ``model`` as every (format, precision) of ``artifacts`` into ``scratch``; each one's bytes on disk."""
    sizes = {}
    for fmt, precision in artifacts:
        folder = scratch / f"{fmt}-{precision}"
        folder.mkdir()
        manifest = export_model(model, fmt, precision, folder, input_shape=shape, labels=ManifestLabels("study", 10),
                                int8=Int8Recipe(calibration=calibration))  # fmt: skip
        sizes[f"{fmt}-{precision}"] = manifest.bytes
    return sizes


def _gpu_variants(model: nn.Module, shape: tuple[int, ...], scratch: Path,
                  device: torch.device) -> tuple[dict[str, Callable[[Tensor], Tensor]], dict[str, int]]:  # fmt: skip
    """The variants a CUDA GPU runs (``model`` on the CPU; the variants on ``device``) and their artifacts' sizes."""
    sizes = _exported_sizes(
        model, shape, [], scratch, (("pt2", "fp32"), ("pt2", "fp16"), ("pt2", "bf16"), ("onnx", "fp32"))
    )
    fp16, _ = convert(model, "fp16", input_shape=shape, compile=False, device=device)
    bf16, _ = convert(model, "bf16", input_shape=shape, compile=False, device=device)
    fp16_compiled, _ = convert(model, "fp16", input_shape=shape, compile=True, device=device)
    fp32 = copy.deepcopy(model).to(device)
    variants: dict[str, Callable[[Tensor], Tensor]] = {
        "fp32 eager": _LastStep(fp32), "fp32 compiled": torch.compile(_LastStep(copy.deepcopy(fp32))),
        "fp16 eager": _LastStep(fp16.to(device)), "fp16 compiled": _LastStep(fp16_compiled.to(device)),
        "bf16 eager": _LastStep(bf16.to(device)),
    }  # fmt: skip
    size_of = {"fp32 eager": sizes["pt2-fp32"], "fp32 compiled": sizes["pt2-fp32"], "fp16 eager": sizes["pt2-fp16"],
               "fp16 compiled": sizes["pt2-fp16"], "bf16 eager": sizes["pt2-bf16"]}  # fmt: skip
    if "CUDAExecutionProvider" in onnxruntime_providers():
        variants["onnxruntime fp32 (CUDA)"] = _LastStep(load_export(scratch / "onnx-fp32", provider="cuda"))
        size_of["onnxruntime fp32 (CUDA)"] = sizes["onnx-fp32"]
    return variants, size_of


def _variants(model: nn.Module, shape: tuple[int, ...], calibration: list[Tensor], scratch: Path,
              qat: nn.Module | None) -> tuple[dict[str, Callable[[Tensor], Tensor]], dict[str, int]]:  # fmt: skip
    """Every CPU variant of ``model`` as a function of a batch, and each one's artifact size on disk (bytes)."""
    sizes = _exported_sizes(
        model,
        shape,
        calibration,
        scratch,
        (("pt2", "fp32"), ("pt2", "int8"), ("pt2", "bf16"), ("onnx", "fp32"), ("onnx", "int8")),
    )
    int8, _ = convert(model, "int8", input_shape=shape, int8=Int8Recipe(calibration=calibration), compile=True)
    bf16, _ = convert(model, "bf16", input_shape=shape, compile=False)
    variants: dict[str, Callable[[Tensor], Tensor]] = {
        "fp32 eager": _LastStep(model), "fp32 compiled": torch.compile(_LastStep(copy.deepcopy(model))),
        "int8 PTQ (oneDNN)": _LastStep(int8), "bf16 eager": _LastStep(bf16),
        "onnxruntime fp32": _LastStep(load_export(scratch / "onnx-fp32")),
        "onnxruntime int8": _LastStep(load_export(scratch / "onnx-int8")),
    }  # fmt: skip
    size_of = {"fp32 eager": sizes["pt2-fp32"], "fp32 compiled": sizes["pt2-fp32"], "int8 PTQ (oneDNN)": sizes["pt2-int8"],
               "bf16 eager": sizes["pt2-bf16"], "onnxruntime fp32": sizes["onnx-fp32"], "onnxruntime int8": sizes["onnx-int8"]}  # fmt: skip
    if qat is not None:
        variants["int8 QAT (oneDNN)"] = _LastStep(qat)
        size_of["int8 QAT (oneDNN)"] = sizes["pt2-int8"]  # the same graph, other weights and ranges
    return variants, size_of


@torch.inference_mode()
def _measure(name: str, source: str, shape: tuple[int, ...], variants: dict[str, Callable[[Tensor], Tensor]],
             sizes: dict[str, int], images: Tensor, scored: tuple[Tensor, Tensor] | None, repeats: int,
             batches: int) -> list[dict]:  # fmt: skip
    reference = torch.cat([variants["fp32 eager"](images[i : i + 256]).float() for i in range(0, len(images), 256)])
    single = per_sample_latency(variants, images[: repeats + WARMUP], warmup=WARMUP)
    pool = images.repeat(max(1, (32 * (batches + 1)) // len(images) + 1), 1, 1, 1)[: 32 * (batches + 1)]
    batched = per_sample_latency(variants, pool, warmup=1, batch_size=32)
    rows = []
    for variant, fn in variants.items():
        out = torch.cat([fn(images[i : i + 256]).float().to(reference.device) for i in range(0, len(images), 256)])
        accuracy = None
        if scored is not None:
            x, y = scored
            hits = sum(int((fn(x[i : i + 256]).argmax(1).cpu() == y[i : i + 256]).sum()) for i in range(0, len(x), 256))
            accuracy = hits / len(y)
        rows.append({
            "model": name, "source": source, "input_shape": "x".join(map(str, shape)), "variant": variant,
            "latency_b1_p50_ms": 1000 * quantile_of(single[variant], 0.5),
            "latency_b1_p99_ms": 1000 * quantile_of(single[variant], 0.99),
            "images_per_s_b32": 32 / float(np.median(batched[variant])), "size_bytes": sizes[variant],
            "max_abs_err": float((out - reference).abs().max()),
            "rel_err": float((out - reference).abs().max() / reference.abs().max().clamp_min(1e-12)),
            "top1_agreement": float((out.argmax(1) == reference.argmax(1)).float().mean()), "accuracy": accuracy,
        })  # fmt: skip
        row = rows[-1]
        write_line(f"{name:<22} {variant:<18} b1 {row['latency_b1_p50_ms']:8.2f} ms (p99 {row['latency_b1_p99_ms']:8.2f})  "
                   f"b32 {row['images_per_s_b32']:8.1f} img/s  {row['size_bytes'] / 1e6:7.2f} MB  agree "
                   f"{100 * row['top1_agreement']:6.2f}%" + (f"  acc {100 * accuracy:.2f}%" if accuracy is not None else ""))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = study_parser("precision", __doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: the device every variant runs on")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    out_dir, create_parents = study_output(args, "precision")
    tv_models, zoo_models, runs = (
        TV_MODELS,
        ZOO_MODELS,
        [Path(r) for r in RUNS if (Path(r) / "model.safetensors").is_file()],
    )
    eval_images, accuracy_images, repeats, batches, qat_epochs = (
        EVAL_IMAGES,
        ACCURACY_IMAGES,
        LATENCY_REPEATS,
        THROUGHPUT_BATCHES,
        QAT_EPOCHS,
    )
    if args.quick:
        tv_models, zoo_models, runs = QUICK["TV_MODELS"], QUICK["ZOO_MODELS"], runs[: QUICK["RUNS"]]
        eval_images, accuracy_images = QUICK["EVAL_IMAGES"], QUICK["ACCURACY_IMAGES"]
        repeats, batches, qat_epochs = QUICK["LATENCY_REPEATS"], QUICK["THROUGHPUT_BATCHES"], QUICK["QAT_EPOCHS"]
    generator = torch.Generator().manual_seed(SEED)
    rows: list[dict] = []
    notes = [f"trained runs measured: {', '.join(map(str, runs)) or 'none found'} (of {', '.join(RUNS)})",
             "random-weight models: batch-norm statistics and int8 calibration from random images, random inputs; "
             "their logits are nearly tied across classes, so top-1 agreement there is fragile: read max_abs_err "
             "and rel_err (max error over the largest logit) for them",
             f"threads: {torch.get_num_threads()}", f"device: {device_label(device)}"]  # fmt: skip
    if device.type == "cuda":
        notes.append("int8 static quantization (PT2E, X86InductorQuantizer) runs on x86 CPUs only: no int8 rows on a "
                     "GPU, where int8 is a TensorRT engine built from the ONNX export; ONNX Runtime's providers here: "
                     + (", ".join(onnxruntime_providers()) or "none (not installed)"))  # fmt: skip
        qat_epochs = 0  # QAT fine-tunes the CPU's int8 graphs
    random_models = [(f"tv:{n}", (3, 224, 224)) for n in tv_models] + [(n, (3, 32, 32)) for n in zoo_models]
    with (staged_dir(out_dir, "precision study", overwrite=args.overwrite, create_parents=create_parents) as out,
          StudyProgress(len(random_models) + len(runs), "precision", unit="model") as progress):  # fmt: skip
        for name, shape in random_models:
            torch.manual_seed(SEED)
            model = create_model(name, num_classes=1000 if name.startswith("tv:") else 10)
            model = _with_batch_statistics(model, shape, generator)
            calibration = [torch.randn(32, *shape, generator=generator) for _ in range(2)]
            images = torch.randn(min(eval_images, 64) if shape[1] > 64 else eval_images, *shape, generator=generator)
            with tempfile.TemporaryDirectory() as scratch:
                if device.type == "cuda":
                    variants, sizes = _gpu_variants(model, shape, Path(scratch), device)
                    images = images.to(device)
                else:
                    variants, sizes = _variants(model, shape, calibration, Path(scratch), None)
                rows += _measure(name, "random weights", shape, variants, sizes, images, None, repeats, batches)
            progress.done()
        for run_dir in runs:
            run = load_run(run_dir, converted=False)
            shape = (int(run.dataset["in_channels"]), *(int(v) for v in run.dataset.get("image_size") or [32, 32]))
            splits = load_splits(run.config)
            test = [
                b
                for b in make_loader(
                    splits.test.sample(accuracy_images, SEED), splits.info, batch_size=256, train=False
                )
            ]
            x, y = torch.cat([b[0] for b in test]), torch.cat([b[1] for b in test])
            with tempfile.TemporaryDirectory() as scratch:
                if device.type == "cuda":
                    variants, sizes = _gpu_variants(run.model, shape, Path(scratch), device)
                    x = x.to(device)
                else:
                    calibration = list(calibration_batches(run, CALIBRATION_IMAGES))
                    qat = None
                    if qat_epochs:
                        progress.say(f"{run_dir}: {qat_epochs} epochs of quantization-aware training...")
                        copy_dir = Path(scratch) / "qat"
                        quantize_run(run_dir, "int8", QuantizeSettings(qat_epochs=qat_epochs, qat_lr=QAT_LR),
                                     Int8Settings(calibration_images=CALIBRATION_IMAGES), out=copy_dir,
                                     progress=progress.say)  # fmt: skip
                        qat = load_run(copy_dir).model
                    variants, sizes = _variants(run.model, shape, calibration, Path(scratch), qat)
                rows += _measure(
                    run_dir.name, str(run_dir), shape, variants, sizes, x[:eval_images], (x, y), repeats, batches
                )
            progress.done()
        write_csv(out / "results.csv", rows)
        write_json(out / "results.json", rows)
        where = device_label(device) if device.type == "cuda" else f"{cpu_model()} ({torch.get_num_threads()} threads)"
        plot_precision(rows, out / "precision", title=f"precision on {where}")
        write_study_config(
            out, study="precision",
            hyper={"tv_models": tv_models, "zoo_models": zoo_models, "runs": [str(r) for r in runs],
                   "calibration_images": CALIBRATION_IMAGES, "eval_images": eval_images,
                   "accuracy_images": accuracy_images, "latency_repeats": repeats, "throughput_batches": batches,
                   "warmup": WARMUP, "qat_epochs": qat_epochs, "qat_lr": QAT_LR, "seed": SEED, "quick": args.quick,
                   "device": str(device)},
            notes=notes,
        )  # fmt: skip
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
