"""Figures of the ensemble studies: torchensemble's methods side by side."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from anytime.plotting.figures import save_figure


def plot_baselines(rows: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], *, title: str) -> list[Path]:
    """Grouped bars, one group per method and one bar per model: test accuracy (left) and training time (right)."""
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    methods = list(dict.fromkeys(str(r["method"]) for r in rows))
    width = 0.8 / max(len(models), 1)
    fig = Figure(figsize=(11, 4))
    ax_acc, ax_time = fig.subplots(1, 2)
    for i, model in enumerate(models):
        mine = {str(r["method"]): r for r in rows if r["model"] == model}
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(methods))]
        ax_acc.bar(xs, [100 * float(mine[m]["test_acc"]) if m in mine else 0 for m in methods], width, label=model)
        ax_time.bar(xs, [float(mine[m]["train_time_s"]) if m in mine else 0 for m in methods], width, label=model)
    for ax, label in ((ax_acc, "test accuracy (%)"), (ax_time, "training time (s, all members)")):
        ax.set_xticks(range(len(methods)), methods, rotation=20)
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.suptitle(title)
    return save_figure(fig, stem)
