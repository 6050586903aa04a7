"""Figures of the ensemble studies: torchensemble's methods side by side."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels


def plot_baselines(rows: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], *, title: str) -> list[Path]:
    """Grouped bars, one group per method and one bar per model: test accuracy (left) and training time (right)."""
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    methods = list(dict.fromkeys(str(r["method"]) for r in rows))
    width = 0.8 / max(len(models), 1)
    fig, (ax_acc, ax_time) = panels(2, (5.5, 4))
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


_STYLE = {"fp32": "-", "int8": "--"}


def plot_ensemble_study(rows: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], *, title: str) -> list[Path]:
    """Test accuracy against p99 latency: every ensemble ladder (one line per fuser and precision, the MLP's bold),
    every member alone (points: circles fp32, crosses int8) and the early-exit ladder."""
    fig, (ax,) = panels(1, (8, 5.5))
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault((str(row["kind"]), str(row["precision"])), []).append(row)
    for (kind, precision), members in groups.items():
        xs = [float(r["p99_ms"]) for r in members]
        ys = [100 * float(r["test_acc"]) for r in members]
        if kind == "member alone":
            ax.scatter(xs, ys, marker="o" if precision == "fp32" else "x", color="black", zorder=3,
                       label=f"members alone ({precision})")  # fmt: skip
            for x, y, r in zip(xs, ys, members):
                ax.annotate(str(r["step"]), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
        elif kind == "early exits":
            ax.plot(xs, ys, marker="s", color="#8172B3", label="early exits (fp32)")
        else:
            bold = kind.endswith("mlp")
            ax.plot(xs, ys, _STYLE.get(precision, "-"), marker=".", linewidth=2.2 if bold else 1.0,
                    alpha=1.0 if bold else 0.5, label=f"{kind} ({precision})")  # fmt: skip
    ax.set(xlabel="p99 latency at batch 1 (ms)", ylabel="test accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, stem)
