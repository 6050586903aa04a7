"""Figures for runs and studies, saved as PNG, SVG and PDF side by side."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.layout_engine import LayoutEngine

from anytime.plotting.layout import fit_to_size, panels
from anytime.utils.io import atomic_path

DPI = 150  # of the PNG files
PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "step": "#55A868", "data": "#8172B3"}


def save_figure(
    fig: Figure, stem: str | os.PathLike[str], formats: Sequence[str] = ("png", "svg", "pdf")
) -> list[Path]:
    """Save ``fig`` as ``stem.png``, ``stem.svg`` and ``stem.pdf`` (each atomically), its titles wrapped to fit
    when it is drawn at a paper's width (:func:`anytime.plotting.figure_size`).

    Figures are built with :class:`matplotlib.figure.Figure` directly, never through pyplot, so plotting
    neither selects a backend for the user's process nor leaves figures open in it.
    """
    fit_to_size(fig)
    # Laid out once and cropped once for every format: left to savefig, each format would run the constrained
    # layout again and draw twice (to find the tight box, then to render): 1.04 s for a three-panel figure, 0.7 s now.
    engine, dpi = fig.get_layout_engine(), fig.dpi
    fig.set_dpi(DPI)  # laid out at the raster's resolution, as savefig would (text extents vary with it)
    fig.draw_without_rendering()
    box = fig.get_tightbbox().padded(float(mpl.rcParams["savefig.pad_inches"]))
    _set_layout(fig, None)  # None, not "none", which savefig would still draw once more for
    paths = []
    try:
        for fmt in formats:
            path = Path(f"{os.fspath(stem)}.{fmt}")
            with atomic_path(path) as tmp:
                fig.savefig(tmp, format=fmt, dpi=DPI, bbox_inches=box)
            paths.append(path)
    finally:
        _set_layout(fig, engine)
        fig.set_dpi(dpi)
    return paths


def _set_layout(fig: Figure, engine: LayoutEngine | None) -> None:
    """The figure's layout engine set as given, None meaning none whatever the user's matplotlibrc asks."""
    with mpl.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
        fig.set_layout_engine(engine)


def plot_training_curves(rows: Sequence[Mapping[str, Any]], title: str, stem: str | os.PathLike[str]) -> list[Path]:
    """Loss and accuracy per epoch (train and validation) of one run, from its ``metrics.csv`` rows."""
    epochs = [int(r["epoch"]) + 1 for r in rows]
    fig, (ax_loss, ax_acc) = panels(2, (5, 3.8))
    ax_loss.plot(epochs, [float(r["train_loss"]) for r in rows], marker="o", label="train")
    ax_loss.plot(epochs, [float(r["val_loss"]) for r in rows], marker="s", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss (log scale)", title="loss", yscale="log")
    ax_acc.plot(epochs, [100 * float(r["train_acc"]) for r in rows], marker="o", label="train")
    ax_acc.plot(epochs, [100 * float(r["val_acc"]) for r in rows], marker="s", label="validation")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return save_figure(fig, stem)


def plot_batch_time(
    model: str, results: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], device: str
) -> list[Path]:
    """Stacked bars of forward / backward / optimizer-step time per mini-batch, one bar per batch size."""
    sizes = [str(int(r["batch_size"])) for r in results]
    fig, (ax_time, ax_rate) = panels(2, (5, 3.8))
    bottom = [0.0] * len(results)
    for phase in ("forward", "backward", "step"):
        values = [1000 * float(r[f"{phase}_p50_s"]) for r in results]
        ax_time.bar(sizes, values, bottom=bottom, label=phase, color=PHASE_COLOURS[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.set(xlabel="batch size (images)", ylabel="time per mini-batch (ms, median)", title="time per mini-batch")
    ax_time.legend()
    ax_rate.bar(sizes, [float(r["images_per_s"]) for r in results], color="#937860")
    ax_rate.set(xlabel="batch size (images)", ylabel="training throughput (images/s)", title="throughput")
    for ax in (ax_time, ax_rate):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{model} on {device}")
    return save_figure(fig, stem)


def plot_memory(
    by_batch: Mapping[str, Sequence[Mapping[str, Any]]],
    by_workers: Sequence[Mapping[str, Any]],
    stem: str | os.PathLike[str],
    device: str,
) -> list[Path]:
    """Peak memory vs batch size (one line per model) and vs DataLoader workers (one bar group per pipeline)."""
    fig, (ax_batch, ax_workers) = panels(2, (5.5, 4))
    for model, rows in by_batch.items():
        ax_batch.plot(
            [int(r["batch_size"]) for r in rows], [float(r["peak_rss_mb"]) for r in rows], marker="o", label=model
        )
    ax_batch.set(xlabel="batch size (images)", ylabel="peak RSS of the process (MiB)", title="training memory")
    ax_batch.set_xscale("log", base=2)
    ax_batch.grid(alpha=0.3)
    ax_batch.legend(fontsize=8)
    labels = [f"{r['pipeline']}\n{int(r['workers'])} workers" for r in by_workers]
    xs = range(len(by_workers))
    ax_workers.bar([x - 0.2 for x in xs], [float(r["peak_pss_mb"]) for r in by_workers], width=0.4, label="PSS")
    ax_workers.bar([x + 0.2 for x in xs], [float(r["peak_rss_mb"]) for r in by_workers], width=0.4, label="RSS sum")
    ax_workers.set_xticks(list(xs), labels, fontsize=8)
    ax_workers.set(ylabel="peak memory of process + workers (MiB)", title="data loading workers")
    ax_workers.grid(alpha=0.3, axis="y")
    ax_workers.legend(fontsize=8)
    fig.suptitle(f"memory on {device}")
    return save_figure(fig, stem)


def plot_time_accuracy(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], stem: str | os.PathLike[str], title: str
) -> list[Path]:
    """Validation accuracy against cumulative wall-clock training time, one curve per model."""
    fig, (ax,) = panels(1, (6.5, 4.2))
    for model, rows in curves.items():
        ax.plot(
            [float(r["elapsed_s"]) / 60 for r in rows],
            [100 * float(r["val_acc"]) for r in rows],
            marker="o",
            label=model,
        )
    ax.set(xlabel="wall-clock time (minutes, training + validation)", ylabel="validation accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, stem)
