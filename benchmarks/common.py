"""What every benchmark shares: arguments, the machine record and the --json report."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from anytime.errors import AnytimeError
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, git_sha


def parser(description: str) -> argparse.ArgumentParser:
    """The benchmark contract: ``python benchmarks/NAME.py [--quick] [--json PATH]``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repeats: a smoke run, not figures to record")
    p.add_argument("--json", metavar="PATH", help="write the ratios with their target and verdict")
    return p


def median(values: list[float]) -> float:
    """The median of a list of measurements."""
    return float(statistics.median(values))


def report(
    name: str, args: argparse.Namespace, figures: dict[str, Any], ratio: float, target: str, passed: bool
) -> int:
    """Print the verdict and, with --json, write the whole report; exit status 0 either way (a figure, not a test)."""
    verdict = "pass" if passed else "fail"
    print(f"{name}: ratio {ratio:.3f} (target {target}): {verdict}")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": name, "ratio": ratio, "target": target, "verdict": verdict, "figures": figures,
                "quick": args.quick, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "git_sha": git_sha(), "machine": describe_machine(),
            },
        )  # fmt: skip
        print(f"report written to {args.json}")
    return 0


def run(main: Callable[[], int]) -> None:
    """Run a benchmark's main, turning a user error into one line and exit status 2."""
    try:
        code = main()
    except AnytimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    raise SystemExit(code)
