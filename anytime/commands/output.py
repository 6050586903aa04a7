"""What the commands print in common: JSON results, progress lines, one-line errors and a policy's figures."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anytime.utils.io import json_default
from anytime.utils.progress import write_line

if TYPE_CHECKING:
    from anytime.tasks.calibration import SplitFigures
    from anytime.train.linear_baseline import Baseline
    from anytime.train.summary import RunSummary


def print_json(value: Any) -> int:
    """A command's result as JSON on stdout (dataclasses as dicts, paths as strings); returns 0, the command's
    exit status."""
    print(json.dumps(value, indent=2, default=json_default))
    return 0


def print_error(command: str, message: str, where: str = "") -> None:
    """A command's error in one line on stderr: ``anytime COMMAND: error WHERE: MESSAGE``."""
    print(f"anytime {command}: error{where}: {message}", file=sys.stderr)


def progress_printer(args: argparse.Namespace) -> Callable[[str], None]:
    """Where a long command's progress lines go: stdout, or stderr when stdout carries --json (above any
    live progress bar)."""
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    return lambda line: write_line(line, file=stream)


def print_policy_figures(label: str, figures: SplitFigures | None) -> None:
    """One line of an early-exit policy's figures on a split: accuracy, FLOPs and the share of each exit."""
    if figures is None:
        print(f"{label:<11} (not collected: run 'anytime collect RUN --split test' to report it)")
        return
    result = figures.result
    shares = " ".join(f"{100 * s:.1f}" for s in result.exit_share)
    print(
        f"{label:<11} accuracy {100 * result.accuracy:.2f}% (last exit {100 * figures.last_exit_accuracy:.2f}%)"
        f"  FLOPs {result.flops_ratio:.3f}x ({1 / result.flops_ratio:.2f}x fewer)  exits % [{shares}]"
    )


def baseline_line(baseline: Baseline, last_exit: float) -> str:
    """The baseline's test accuracy beside the network's, saying so plainly when the network loses."""
    gap = 100 * (last_exit - baseline.test_acc)
    verdict = (f"the network is {gap:.2f} points above it" if gap >= 0 else
               f"the network LOSES to it by {-gap:.2f} points (train longer, or choose another recipe)")  # fmt: skip
    return f"baseline   {baseline.description}: test {100 * baseline.test_acc:.2f}%; {verdict}"


def print_train_summary(summary: RunSummary, run_dir: Path) -> None:
    """A finished training's summary, one aspect a line."""
    record, final = summary.record, summary.record["final"]
    steady = record["timing"]["steady"] or record["timing"]["epoch0"]
    print(f"run        {run_dir}")
    print(f"accuracy   val {100 * summary.val_acc:.2f}%  test {100 * summary.test_acc:.2f}%  "
          f"(best val {100 * record['best_val_acc']:.2f}%)"
          + (f"  test with mirror {100 * final['test_acc_tta']:.2f}%" if "test_acc_tta" in final else ""))  # fmt: skip
    print(f"augment    {record['augment']}")
    print(f"time       {summary.train_time_s:.1f} s training, {record['wall_time_s']:.1f} s with validation, "
          f"{summary.epochs} epoch(s) on {record['device']} ({record['torch_threads']} threads"
          + (f" in each of {record['processes']} processes)" if record["processes"] > 1 else ")"))  # fmt: skip
    it = steady["iteration_mean_s"]
    print(f"iteration  {1000 * it:.1f} ms: data {100 * steady['data_mean_s'] / it:.0f}%  "
          f"forward {100 * steady['forward_mean_s'] / it:.0f}%  backward {100 * steady['backward_mean_s'] / it:.0f}%  "
          f"step {100 * steady['step_mean_s'] / it:.0f}%  ({steady['images_per_s']:.0f} images/s"
          f"{', steady state' if record['timing']['steady'] else ', epoch 0 only'})")  # fmt: skip
    print(
        f"memory     peak RSS {record['peak_rss_mb']:.0f} MiB"
        + (f", CUDA peak {record['cuda_peak_mb']:.0f} MiB" if record["cuda_peak_mb"] is not None else "")
    )
    for e in summary.steps:
        print(f"exit {e.index:<5} {e.name:<14} {100 * e.flops / (summary.backbone_flops or 1):5.1f}% FLOPs  "
              f"val {100 * e.val_acc:.2f}%  test {100 * e.test_acc:.2f}%")  # fmt: skip
    if summary.baseline is not None:
        print(baseline_line(summary.baseline, summary.test_acc))
