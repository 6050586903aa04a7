"""Peak-memory probes, each meant to run in a fresh process through :func:`run_isolated`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from anytime.train.memory import TreeMemorySampler, current_rss_bytes, peak_rss_bytes
from anytime.utils.timer import monotonic

MIB = 2**20


def train_step_memory(
    model_name: str,
    batch_size: int,
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    iterations: int = 3,
    threads: int | None = None,
) -> dict[str, Any]:
    """Peak RSS of a process that builds ``model_name`` and trains it for a few SGD iterations on CPU."""
    from anytime.backbones import create_model
    from anytime.profile.training import measure_train_step

    if threads is not None:
        torch.set_num_threads(threads)
    baseline = current_rss_bytes()
    torch.manual_seed(0)
    model = create_model(model_name, num_classes=num_classes, in_channels=in_channels)
    images = torch.randn(batch_size, in_channels, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    timing = measure_train_step(model, images, labels, warmup=1, repeats=iterations)
    return {
        "model": model_name,
        "batch_size": batch_size,
        "baseline_rss_mb": baseline / MIB,
        "peak_rss_mb": peak_rss_bytes() / MIB,
        "parameters": sum(p.numel() for p in model.parameters()),
        "iteration_p50_s": timing.summary()["total_p50_s"],
    }


def loader_memory(
    pipeline: str,
    root: str | os.PathLike[str],
    *,
    workers: int,
    batches: int,
    batch_size: int = 128,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Peak memory of this process and its DataLoader workers while ``batches`` training batches are drawn.

    ``pipeline`` is ``anytime`` (the uint8 tensor cache with batched augmentation) or ``torchvision``
    (ImageFolder with per-image PIL transforms). ``root`` is an image-folder tree with ``train/``.
    """
    from anytime.data import Delivery, load_dataset, make_loader
    from anytime.data.torchvision_pipeline import torchvision_loader

    baseline = current_rss_bytes()
    if pipeline == "anytime":
        splits = load_dataset("folder", root, cache_dir=cache_dir)
        loader: Any = make_loader(splits.train, splits.info, batch_size=batch_size, train=True,
                                  delivery=Delivery(workers=workers))  # fmt: skip
    elif pipeline == "torchvision":
        loader = torchvision_loader(os.path.join(root, "train"), batch_size=batch_size, workers=workers)
    else:
        raise ValueError(f"unknown pipeline {pipeline!r}")
    images = 0
    with TreeMemorySampler(interval_s=0.02) as sampler:
        start = monotonic()
        for i, (x, _) in enumerate(loader):
            images += x.shape[0]
            if i + 1 >= batches:
                break
        elapsed = monotonic() - start
    return {
        "pipeline": pipeline,
        "workers": workers,
        "batches": batches,
        "batch_size": batch_size,
        "baseline_rss_mb": baseline / MIB,
        "peak_rss_mb": sampler.peak_rss_bytes_ / MIB,
        "peak_pss_mb": sampler.peak_pss_bytes_ / MIB,
        "processes": sampler.peak_processes_,
        "images_per_s": images / elapsed if elapsed > 0 else float("nan"),
    }


def _reset_peak_rss() -> bool:
    # Linux resets the process's high-water mark (VmHWM) on writing 5 to clear_refs; ru_maxrss never resets.
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5\n")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def inference_memory(run_dir: str, batch_size: int, *, threads: int | None = None) -> dict[str, Any]:
    """Peak RSS of this process while a run's model answers a batch with its last step; meant for a fresh
    process (:func:`run_isolated`), one per batch size, so no earlier batch's freed memory hides this one's.

    The peak is reset first where Linux allows it (VmHWM via ``/proc/self/clear_refs``); otherwise
    ``ru_maxrss`` is read, which also counts loading. ``activations_mb`` is the peak above the RSS with the
    model and the input loaded.
    """
    from anytime.backbones.base import example_input
    from anytime.contract import run_step, step_count
    from anytime.deploy.loader import load_export
    from anytime.deploy.manifest import MANIFEST
    from anytime.train.runs import dataset_input_shape, load_run

    if threads is not None:
        torch.set_num_threads(threads)
    if (Path(run_dir) / MANIFEST).is_file():  # an export's artifacts
        exported = load_export(run_dir, threads=threads)
        model: torch.nn.Module = exported
        x = torch.randn(batch_size, *exported.manifest.input_shape)
    else:
        run = load_run(run_dir, "cpu")
        model = run.model
        # a text run at its longest sentence: the peak of any length
        x = example_input(
            dataset_input_shape(run.dataset),
            batch_size,
            tokens=run.dataset.get("modality") == "text",
            generator=torch.Generator().manual_seed(0),
        )
    with torch.inference_mode():
        loaded = current_rss_bytes()
        reset = _reset_peak_rss()
        for _ in range(2):
            run_step(model, x, step_count(model) - 1)
        peak = (_hwm_bytes() if reset else None) or peak_rss_bytes()
    how = "VmHWM after a reset" if reset else "ru_maxrss, loading included"
    return {"peak_mb": peak / MIB, "activations_mb": max(0, peak - loaded) / MIB,
            "how": f"peak RSS of a fresh process ({how}), above its RSS with the model and input loaded"}  # fmt: skip
