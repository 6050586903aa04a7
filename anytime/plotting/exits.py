"""Figures of multi-exit runs: accuracy vs cost, accuracy vs threshold, exit histograms, per-exit curves."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels, scaled

if TYPE_CHECKING:
    from anytime.calibrate import Oracle, SweepResult
    from anytime.outputs import OutputCache


def plot_exit_pareto(
    results: Mapping[str, SweepResult],
    cache: OutputCache,
    best: Oracle,
    stem: str | os.PathLike[str],
    title: str,
    names: Sequence[str] | None = None,
) -> list[Path]:
    """Accuracy vs mean FLOPs per sample: the Pareto front of each criterion, every exit on its own (labelled with
    ``names``, default the cache's), the oracle."""
    fig, (ax,) = panels(1, (7, 4.8))
    # Criteria that rank samples alike (entropy and normalised entropy) give the same front: each gets its own
    # dash pattern and a thinner line than the one before, so that coinciding curves all stay visible.
    styles = ("-", "--", ":", "-.")
    for i, (name, result) in enumerate(results.items()):
        front = result.pareto()
        ax.plot(result.flops_ratio[front], 100 * result.accuracy[front], ls=styles[i % len(styles)],
                lw=max(3.0 - 0.7 * i, 0.8), label=f"{name} (Pareto front, area {100 * result.area():.1f}%)")  # fmt: skip
    from anytime.utils.stats import wilson

    ratio = cache.step_flops / cache.base_flops
    acc = 100 * cache.step_accuracy()
    n = cache.num_samples
    bounds = np.array([wilson(round(a / 100 * n), n) for a in acc]) * 100
    ax.errorbar(ratio, acc, yerr=[acc - bounds[:, 0], bounds[:, 1] - acc], fmt="s", color="black", capsize=3,
                zorder=3, label="each exit alone (95% Wilson interval)")  # fmt: skip
    for k, name in enumerate(names or cache.step_names):
        ax.annotate(name, (ratio[k], acc[k]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.scatter([best.flops_ratio], [100 * best.accuracy], marker="*", s=150, color="#C44E52", zorder=4,
               label="oracle (first correct exit)")  # fmt: skip
    ax.set(xlabel="mean FLOPs per sample / backbone FLOPs", ylabel=f"{cache.split} accuracy (%)",
           title=f"{title}: accuracy vs cost ({cache.num_samples} {cache.split} samples)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_figure(fig, stem)


def plot_threshold_curves(results: Mapping[str, SweepResult], stem: str | os.PathLike[str], title: str) -> list[Path]:
    """Accuracy and mean FLOPs against the threshold all exits share, one panel per criterion."""
    fig, axes = panels(len(results), (4, 3.6))
    for ax, (name, result) in zip(axes, results.items()):
        t = result.shared if result.shared is not None else result.thresholds[:, 0]
        keep = np.isfinite(t)
        ax.plot(t[keep], 100 * result.accuracy[keep], color="#4C72B0", label="accuracy")
        ax.set(xlabel=f"{name} threshold", ylabel="accuracy (%)", title=name)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(t[keep], result.flops_ratio[keep], color="#DD8452", label="FLOPs ratio")
        twin.set_ylabel("mean FLOPs / backbone FLOPs", color="#DD8452")
    fig.suptitle(f"{title}: accuracy (blue) and cost (orange) vs threshold")
    return save_figure(fig, stem)


def plot_exit_histogram(
    report: Mapping[str, Any], names: Sequence[str], stem: str | os.PathLike[str], title: str
) -> list[Path]:
    """Share of samples leaving at each exit under the calibrated policy, validation and test side by side."""
    fig, (ax,) = panels(1, (7, 3.8))
    x = np.arange(len(names))
    splits = [(s, report[s]) for s in ("validation", "test") if report.get(s)]
    width = 0.8 / max(len(splits), 1)
    for i, (split, figures) in enumerate(splits):
        ax.bar(x + i * width, 100 * np.asarray(figures["exit_share"]), width=width,
               label=f"{split}: {100 * figures['accuracy']:.2f}% at {figures['flops_ratio']:.2f}x FLOPs")  # fmt: skip
    ax.set_xticks(x + width * (len(splits) - 1) / 2, list(names), rotation=20, fontsize=8)
    ax.set(xlabel="exit", ylabel="samples leaving here (%)", title=f"{title}: exits under {report.get('rule')}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return save_figure(fig, stem)


def plot_exit_accuracy_epochs(
    rows: Sequence[Mapping[str, Any]], names: Sequence[str], stem: str | os.PathLike[str], title: str
) -> list[Path]:
    """Validation accuracy of every exit after each epoch, from a run's ``metrics.csv``."""
    fig, (ax,) = panels(1, (7, 4))
    epochs = [int(r["epoch"]) + 1 for r in rows]
    for k, name in enumerate(names):
        ax.plot(epochs, [100 * float(r[f"val_acc_exit{k}"]) for r in rows], marker=".", label=name)
    ax.set(xlabel="epoch", ylabel="validation accuracy (%)", title=f"{title}: accuracy of each exit")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, stem)


def plot_reliability(cache: OutputCache, names: Sequence[str], stem: str | os.PathLike[str], title: str) -> list[Path]:
    """A reliability diagram per exit (accuracy against confidence in 15 bins, with the bins' counts) and its ECE."""
    from anytime.utils.stats import expected_calibration_error, reliability, softmax

    fig, axes = panels(cache.num_steps, (2.6, 2.8), max_columns=5, sharex=True, sharey=True)
    for k, ax in enumerate(axes):
        p = softmax(cache.logits[k])
        conf, acc, counts = reliability(p, cache.labels)
        filled = counts > 0
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        ax.bar(conf[filled], acc[filled], width=1 / 15, alpha=0.75, color="#4C72B0", edgecolor="white")
        ax.set(
            title=f"{names[k]}: ECE {100 * expected_calibration_error(p, cache.labels):.1f}%", xlim=(0, 1), ylim=(0, 1)
        )
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    columns = axes[0].get_subplotspec().get_gridspec().ncols
    for k, ax in enumerate(axes):
        if k + columns >= len(axes):  # nothing below it
            ax.set_xlabel("confidence (max softmax)")
            ax.xaxis.set_tick_params(labelbottom=True)
        if k % columns == 0:
            ax.set_ylabel("accuracy")
    fig.suptitle(f"{title}: reliability of each exit ({cache.num_samples} {cache.split} samples, 15 bins)")
    return save_figure(fig, stem)


def plot_class_accuracy(
    cache: OutputCache, names: Sequence[str], classes: Sequence[str] | None, stem: str | os.PathLike[str], title: str
) -> list[Path]:
    """Accuracy of every exit on every class: a heat map with the values written in."""
    from anytime.utils.stats import class_accuracy

    table = 100 * class_accuracy(cache.logits, cache.labels, cache.num_classes)
    labels = (
        list(classes) if classes and len(classes) == cache.num_classes else [str(c) for c in range(cache.num_classes)]
    )
    fig = scaled((max(6.0, 0.62 * cache.num_classes + 1.8), 0.45 * cache.num_steps + 1.6), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(table, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    if cache.num_classes <= 20:
        for (k, c), value in np.ndenumerate(table):
            ax.text(
                c, k, f"{value:.0f}", ha="center", va="center", fontsize=7, color="white" if value < 60 else "black"
            )
    ax.set_xticks(range(cache.num_classes), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(cache.num_steps), list(names), fontsize=8)
    ax.set(title=f"{title}: accuracy (%) per class and exit ({cache.split})")
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    return save_figure(fig, stem)
