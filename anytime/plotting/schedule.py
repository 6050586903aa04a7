"""Figures of deadline scheduling: accuracy the scheduler delivers vs deadline, latency distributions per
step, and the runtime's deadline-miss rate and accuracy vs deadline."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels

if TYPE_CHECKING:
    from anytime.profile import DeviceProfile
    from anytime.scheduler import DeadlineScheduler


def plot_deadline_accuracy(
    scheduler: DeadlineScheduler, stem: str | os.PathLike[str], title: str, *, quantile: float = 0.99,
    batch_size: int = 1, samples: int | None = None,
) -> list[Path]:  # fmt: skip
    """Validation accuracy of the scheduler's choice against the deadline (a step curve), with every step's
    latency at the quantile marked; with ``samples`` (the validation size) each frontier point carries its
    accuracy's 95% Wilson interval, and a step's point its latency quantile's 95% bootstrap interval."""
    from anytime.utils.stats import bootstrap_quantile, wilson

    frontier = scheduler.frontier(quantile, batch_size)
    top = 1.25 * frontier[-1][1]
    deadlines = np.linspace(top / 400, top, 400)
    accuracy = [np.nan if not (c := scheduler.select(float(d), quantile, batch_size)).fits else 100 * c.accuracy
                for d in deadlines]  # fmt: skip
    fig, (ax,) = panels(1, (7, 4.4))
    ax.step(deadlines, accuracy, where="post", color="#4C72B0", label=f"scheduler's choice (p{100 * quantile:g} fits)")
    profile = scheduler.profile
    on_front = {option.name for option, _ in frontier}
    for k, name in enumerate(profile.step_names):
        latency = profile.step_quantile(k, quantile, batch_size)
        ax.axvline(latency, color="grey", lw=0.8, ls=":")
        if name not in on_front:  # a frontier point carries its own label; name only the steps off it
            ax.annotate(name, (latency, ax.get_ylim()[0]), rotation=90, fontsize=7, xytext=(2, 4),
                        textcoords="offset points")  # fmt: skip
    for option, latency in frontier:
        colour = "#C44E52" if option.kind == "policy" else "black"
        yerr = xerr = None
        if samples:
            lo, hi = wilson(round(option.accuracy * samples), samples)
            yerr = [[100 * (option.accuracy - lo)], [100 * (hi - option.accuracy)]]
        if option.step is not None:
            low, high = bootstrap_quantile(profile.at(batch_size).steps[option.step], quantile)
            xerr = [[max(latency - low, 0.0)], [max(high - latency, 0.0)]]
        ax.errorbar(
            [latency], [100 * option.accuracy], xerr=xerr, yerr=yerr, fmt="o", color=colour, capsize=3, zorder=3
        )
        ax.annotate(
            option.name, (latency, 100 * option.accuracy), fontsize=7, xytext=(4, -10), textcoords="offset points"
        )
    ax.set(xlabel=f"deadline (ms){'; bars: 95% intervals' if samples else ''}", ylabel="validation accuracy (%)",
           title=f"{title}: accuracy vs deadline, batch {batch_size} on {profile.device.get('label')}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, stem)


def plot_latency_distributions(
    profile: DeviceProfile, stem: str | os.PathLike[str], title: str, *, batch_size: int = 1
) -> list[Path]:
    """Each step's latency distribution (and each stage's, for incremental models), with p50 and p99 marked and
    each one's bootstrap 95% interval as a bar (the profile's JSON holds the same intervals)."""
    from anytime.utils.stats import bootstrap_quantile

    at = profile.at(batch_size)
    shown = [("each step alone", at.steps)] + ([("each stage (one exit further)", at.stages)] if at.stages else [])
    fig, axes = panels(len(shown), (5, 4))
    for ax, (label, samples) in zip(axes, shown):
        ax.violinplot([np.asarray(s) for s in samples], showextrema=False)
        for k, s in enumerate(samples, start=1):
            for q, marker in ((0.5, "_"), (0.99, "v")):
                point = float(np.quantile(s, q, method="inverted_cdf"))
                low, high = bootstrap_quantile(np.asarray(s), q)
                ax.errorbar([k], [point], yerr=[[max(point - low, 0.0)], [max(high - point, 0.0)]], fmt=marker,
                            color="black", markersize=6, capsize=3, lw=0.8, zorder=3)  # fmt: skip
        ax.set_xticks(range(1, len(samples) + 1), list(profile.step_names), fontsize=8)
        ax.set(ylabel="latency (ms)", title=label)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{title}: latency at batch {batch_size} on {profile.device.get('label')} "
                 "(_ p50, v p99; bars: bootstrap 95% intervals)")  # fmt: skip
    return save_figure(fig, stem)


def plot_deadline_runs(
    rows: Sequence[Mapping[str, Any]], stem: str | os.PathLike[str], title: str, *, conditions: Sequence[str]
) -> list[Path]:
    """The runtime's miss rate and accuracy vs deadline for each condition, with the hindsight oracle's accuracy.

    ``rows`` carry ``condition``, ``deadline_ms``, ``miss_rate``, ``accuracy`` and ``oracle_accuracy``.
    """
    fig, (miss_ax, acc_ax) = panels(2, (5.5, 4.2))
    for condition in conditions:
        mine = sorted((r for r in rows if r["condition"] == condition), key=lambda r: r["deadline_ms"])
        d = [r["deadline_ms"] for r in mine]
        miss_ax.plot(d, [100 * r["miss_rate"] for r in mine], marker=".", label=condition)
        line = acc_ax.plot(d, [100 * r["accuracy"] for r in mine], marker=".", label=f"{condition}: runtime")
        oracle = [np.nan if r["oracle_accuracy"] is None else 100 * r["oracle_accuracy"] for r in mine]
        acc_ax.plot(d, oracle, ls="--", color=line[0].get_color(), alpha=0.6, label=f"{condition}: oracle")
    miss_ax.axhline(1.0, color="grey", ls=":", lw=0.8)
    miss_ax.set(xlabel="deadline (ms)", ylabel="deadline misses (%)", title="miss rate (target 1%)")
    acc_ax.set(xlabel="deadline (ms)", ylabel="test accuracy (%)", title="accuracy vs best single step in hindsight")
    for ax in (miss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, stem)


def plot_energy_accuracy(
    scheduler: DeadlineScheduler, stem: str | os.PathLike[str], title: str, *, quantile: float = 0.99, batch_size: int = 1,
) -> list[Path]:  # fmt: skip
    """Accuracy vs latency beside accuracy vs energy per inference, every option a point: the options on the
    two-dimensional frontier (none other as accurate is both faster and more frugal) filled and named, the rest hollow."""
    profile = scheduler.profile
    front = {o.name for o, _, _ in scheduler.frontier_points(quantile, batch_size, energy=True)}
    fig, axes = panels(2, (5.5, 4.4), sharey=True)
    for o in scheduler.options.values():
        latency, energy = scheduler.latency(o, quantile, batch_size), scheduler.energy_mj(o, batch_size)
        colour = "#C44E52" if o.kind == "policy" else "black"
        for ax, x in zip(axes, (latency, energy)):
            ax.plot([x], [100 * o.accuracy], "o", color=colour, mfc=colour if o.name in front else "none", zorder=3)
            if o.name in front:
                ax.annotate(o.name, (x, 100 * o.accuracy), fontsize=7, xytext=(4, -10), textcoords="offset points")
    axes[0].set(xlabel=f"latency at p{100 * quantile:g} (ms)", ylabel="validation accuracy (%)")
    axes[1].set(xlabel="mean energy per inference (mJ)")
    for ax in axes:
        ax.grid(alpha=0.3)
    meter = profile.require_energy()
    fig.suptitle(f"{title}: batch {batch_size} on {profile.device.get('label')}, energy by {meter.source.reader} "
                 "(filled: the latency-energy frontier; red: early-exit policies)", fontsize=9)  # fmt: skip
    return save_figure(fig, stem)
