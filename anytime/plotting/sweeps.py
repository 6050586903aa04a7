"""The figure of a sweep of runs (`anytime jobs`): test accuracy against the parameter that varies over numbers,
one line per combination of the others, or one bar per job when no parameter is a number."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from anytime.jobs import JobOutcome, numeric_axis
from anytime.plotting.figures import save_figure


def plot_sweep(outcomes: Sequence[JobOutcome], stem: str | os.PathLike[str], title: str) -> list[Path]:
    """Test accuracy of every finished job (failed jobs are left out and named in the title)."""
    ok = [o for o in outcomes if o.test_acc is not None]
    failed = len(outcomes) - len(ok)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
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
