"""Figures of the residual-cutting study (accuracy against blocks cut, against the block cut alone, and
against measured latency) and of families of steps compared at matched latency."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels

_STYLES = {"shortcut": "--", "branch": "-"}


def _series(rows: Sequence[Mapping[str, Any]], scope: str, kind: str) -> list[Mapping[str, Any]]:
    return [r for r in rows if r["scope"] == scope and r["kind"] == kind]


def plot_cut_study(
    studies: Mapping[str, Sequence[Mapping[str, Any]]], stem: str | os.PathLike[str], *, title: str = ""
) -> list[Path]:
    """Three panels for one or more studies (``{label: CutStudy.rows}``): the cumulative ladder's accuracy by
    blocks cut from the top, each block cut alone, and accuracy against batch-1 latency; recomputed batch-norm
    statistics, where measured, are drawn with hollow markers."""
    fig, (ax_ladder, ax_single, ax_latency) = panels(3, (5, 4.2))
    for label, rows in studies.items():
        base = next(r for r in rows if r["scope"] == "none")
        kinds = [k for k in ("branch", "shortcut") if _series(rows, "ladder", k)]
        for kind in kinds:
            name = f"{label}, {kind} {'skipped' if kind == 'branch' else 'cut'}"
            ladder = sorted(_series(rows, "ladder", kind), key=lambda r: r["blocks_cut"])
            xs = [0, *(r["blocks_cut"] for r in ladder)]
            line = ax_ladder.plot(xs, [100 * base["accuracy"], *(100 * r["accuracy"] for r in ladder)],
                                  _STYLES[kind], marker="o", label=name)[0]  # fmt: skip
            colour = line.get_color()
            recal = [r for r in ladder if r.get("accuracy_recalibrated") not in (None, "")]
            if recal:
                ax_ladder.plot([r["blocks_cut"] for r in recal], [100 * float(r["accuracy_recalibrated"]) for r in recal],
                               _STYLES[kind], marker="o", mfc="none", color=colour, alpha=0.6,
                               label=f"{name}, BN recomputed")  # fmt: skip
            single = sorted(_series(rows, "single", kind), key=lambda r: int(r["blocks"]))
            ax_single.plot([int(r["blocks"]) for r in single], [100 * r["accuracy"] for r in single],
                           _STYLES[kind], marker="o", color=colour, label=name)  # fmt: skip
            ax_latency.plot([base["latency_p50_ms"], *(r["latency_p50_ms"] for r in ladder)],
                            [100 * base["accuracy"], *(100 * r["accuracy"] for r in ladder)],
                            _STYLES[kind], marker="o", color=colour, label=f"{name} (ladder)")  # fmt: skip
        ax_latency.plot([base["latency_p50_ms"]], [100 * base["accuracy"]], "k*", markersize=12)
    ax_ladder.set(xlabel="blocks cut, from the top down", ylabel="accuracy (%)", title="cumulative ladder")
    ax_single.set(xlabel="block cut alone (0 = first)", ylabel="accuracy (%)", title="one block at a time")
    ax_latency.set(
        xlabel="batch-1 latency, median (ms)", ylabel="accuracy (%)", title="accuracy vs latency (* = whole)"
    )
    for ax in (ax_ladder, ax_single, ax_latency):
        ax.grid(alpha=0.3)
    ax_ladder.legend(fontsize=7)
    ax_single.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return save_figure(fig, stem)


def plot_step_families(
    families: Mapping[str, Sequence[Any]], stem: str | os.PathLike[str], *, title: str = "",
    budgets: Sequence[Mapping[str, Any]] | None = None,
) -> list[Path]:  # fmt: skip
    """Test accuracy against measured mean latency of every step, one line per family (``{label: StepPoints}``);
    with ``budgets`` (rows of :func:`anytime.tasks.compare.matched_table`), a second panel of each family's accuracy
    at matched latency budgets."""
    fig, axes = panels(2 if budgets else 1, (6 if budgets else 6.5, 4.5))
    ax = axes[0]
    for label, points in families.items():
        ordered = sorted(points, key=lambda p: p.mean_ms)
        ax.plot([p.mean_ms for p in ordered], [100 * p.test_acc for p in ordered], marker="o", label=label)
    ax.set(xlabel="latency alone, mean at batch 1 (ms)", ylabel="test accuracy (%)", title="every step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if budgets:
        right = axes[1]
        xs = [row["budget_ms"] for row in budgets]
        for label in families:
            ys = [None if row[f"{label}_acc"] is None else 100 * row[f"{label}_acc"] for row in budgets]
            right.step(xs, [float("nan") if y is None else y for y in ys], where="post", label=label)
        right.set(xlabel="latency budget, mean (ms)", ylabel="test accuracy of the chosen step (%)",
                  title="matched latency: best step within the budget")  # fmt: skip
        right.grid(alpha=0.3)
        right.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, stem)
