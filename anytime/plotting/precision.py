"""Figures of the precision study: latency of every precision per model, and accuracy against latency."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels


def plot_precision(rows: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], *, title: str = "") -> list[Path]:
    """Two panels from the study's rows (``model``, ``variant``, ``latency_b1_p50_ms``,
    ``accuracy``): batch-1 latency of each variant per model (log scale), and accuracy against batch-1 latency
    for the models with an accuracy (a colour per model, a marker per variant)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, (ax_latency, ax_accuracy) = panels(2, (7.5, 4.8), width_ratios=[2, 1])
    width = 0.8 / max(len(variants), 1)
    for j, variant in enumerate(variants):
        xs, ys = [], []
        for i, model in enumerate(models):
            row = next((r for r in rows if r["model"] == model and r["variant"] == variant), None)
            if row is not None:
                xs.append(i + (j - (len(variants) - 1) / 2) * width)
                ys.append(float(row["latency_b1_p50_ms"]))
        ax_latency.bar(xs, ys, width, label=variant)
    ax_latency.set_xticks(range(len(models)), models, rotation=20, ha="right", fontsize=8)
    ax_latency.set(ylabel="batch-1 latency, median (ms, log scale)", yscale="log", title="latency per precision")
    ax_latency.grid(alpha=0.3, axis="y")
    ax_latency.legend(fontsize=7, ncol=2)
    scored = [m for m in models if any(r["model"] == m and r.get("accuracy") not in (None, "") for r in rows)]
    markers = dict(zip(variants, "osD^v<>Pp*hX"))
    for model in scored:
        points = sorted((float(r["latency_b1_p50_ms"]), 100 * float(r["accuracy"]), r["variant"])
                        for r in rows if r["model"] == model and r.get("accuracy") not in (None, ""))  # fmt: skip
        line = ax_accuracy.plot([p[0] for p in points], [p[1] for p in points], ":", alpha=0.5, label=model)[0]
        for latency, accuracy, variant in points:
            ax_accuracy.plot([latency], [accuracy], linestyle="none", marker=markers[variant], color=line.get_color())
    for variant in variants:  # the marker legend: one entry per variant, in grey
        if any(r["variant"] == variant and r.get("accuracy") not in (None, "") for r in rows):
            ax_accuracy.plot([], [], linestyle="none", marker=markers[variant], color="grey", label=variant)
    ax_accuracy.set(xlabel="batch-1 latency, median (ms)", ylabel="test accuracy (%)", title="accuracy vs latency")
    ax_accuracy.grid(alpha=0.3)
    if scored:
        ax_accuracy.legend(fontsize=6, ncol=2)
    else:
        ax_accuracy.text(0.5, 0.5, "no trained run measured", ha="center", va="center", transform=ax_accuracy.transAxes)
    if title:
        fig.suptitle(title)
    return save_figure(fig, stem)
