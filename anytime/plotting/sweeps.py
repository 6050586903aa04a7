"""The figure of a sweep of runs (`anytime jobs`): test accuracy against the parameter that varies over numbers,
one line per combination of the others, or one bar per job when no parameter is a number."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import panels
from anytime.train.jobs import JobOutcome, numeric_axis


def plot_sweep(outcomes: Sequence[JobOutcome], stem: str | os.PathLike[str], title: str) -> list[Path]:
    """Test accuracy of every finished job (failed jobs are left out and named in the title)."""
    ok = [o for o in outcomes if o.test_acc is not None]
    failed = len(outcomes) - len(ok)
    fig, (ax,) = panels(1, (7, 4.5))
    axis = numeric_axis(ok) if len(ok) > 1 else None
    if axis is not None:
        groups: dict[str, list[JobOutcome]] = {}
        for o in ok:
            rest = {k: v for k, v in o.params.items() if k != axis}
            groups.setdefault(json.dumps(rest, sort_keys=True), []).append(o)
        for key, members in groups.items():
            members.sort(key=lambda o: o.params[axis])
            rest = json.loads(key)
            label = ", ".join(f"{k}={v}" for k, v in rest.items()) or "test accuracy"
            ax.plot([o.params[axis] for o in members], [100 * (o.test_acc or 0.0) for o in members], "o-", label=label)
        ax.set_xlabel(axis)
        if len(groups) > 1 or any(json.loads(k) for k in groups):
            ax.legend(fontsize=8)
    else:
        ax.bar(range(len(ok)), [100 * (o.test_acc or 0.0) for o in ok])
        ax.set_xticks(range(len(ok)), [o.job for o in ok], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.set_title(title + (f" ({failed} failed job(s) left out)" if failed else ""))
    return save_figure(fig, stem, formats=("png", "svg"))


def plot_lottery(
    tickets: Sequence[JobOutcome],
    dense_acc: float,
    seconds: Mapping[int, float],
    stem: str | os.PathLike[str],
    title: str,
) -> list[Path]:
    """Test accuracy against sparsity, one curve per reset epoch (tickets whose ``params`` hold ``sparsity`` and
    ``reset_epoch``), the dense run as a line; beside it, the sweep's wall-clock time by number of workers (left
    empty without timings)."""
    fig, (left, right) = panels(2, (5.5, 4.5), width_ratios=[2, 1])
    by_epoch: dict[int, list[JobOutcome]] = {}
    for ticket in tickets:
        by_epoch.setdefault(int(ticket.params["reset_epoch"]), []).append(ticket)
    for k, members in sorted(by_epoch.items()):
        members.sort(key=lambda t: float(t.params["sparsity"]))
        left.plot([100 * float(t.params["sparsity"]) for t in members], [100 * (t.test_acc or 0.0) for t in members],
                  "o-", label=f"reset to epoch {k}" + (" (initialisation)" if k == 0 else ""))  # fmt: skip
    left.axhline(100 * dense_acc, color="black", ls="--", lw=1, label="dense")
    left.set_xlabel("weights pruned (%)")
    left.set_ylabel("test accuracy (%)")
    left.set_title(title)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    workers = sorted(seconds)
    if workers:
        right.bar([str(w) for w in workers], [seconds[w] for w in workers], color="#4C72B0")
        ideal = seconds[workers[0]] * workers[0]
        right.plot([str(w) for w in workers], [ideal / w for w in workers], "k--", lw=1, label="Amdahl, efficiency 1")
        right.set_title(f"speed-up {seconds[workers[0]] / seconds[workers[-1]]:.2f}")
        right.legend(fontsize=8)
    else:
        right.set_title("not timed (tickets found finished)")
    right.set_xlabel("workers")
    right.set_ylabel("sweep wall-clock (s)")
    return save_figure(fig, stem, formats=("png", "svg"))
