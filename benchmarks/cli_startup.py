"""Benchmark: what one `anytime schedule` costs end to end, as a process (start-up, query, answer).

Side by side, interleaved, REPEATS times each: the command as shipped (its query path imports numpy, not
torch), and the same command in a process that imports torch first, which is what every answer cost before
the query path was separated from the network code (5-6 s and 650 MB were reported on a loaded machine).
Wall time is the child's whole life; peak memory is its maximum resident set (``os.wait4``). Ratio: 1 s / the
median wall time of the shipped command. Target: >= 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import REPO, median, parser, report, run

from anytime.errors import AnytimeError

# Hyper-parameters
RUN = REPO / "runs" / "cifar10-resnet32-exits-12ep"  # a profiled run; --run to change
DEADLINE_MS = 5.0
REPEATS = 10  # per variant (--quick: 3)
TARGET_S = 1.0


# Timed from a small process of its own: a child forked from this one (torch already loaded) would report
# this process's memory as its own peak.
_TIMER = (
    "import json, os, subprocess, sys, time; t = time.perf_counter(); "
    "c = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); "
    "_, s, u = os.wait4(c.pid, 0); w = time.perf_counter() - t; "
    "print(json.dumps([w, u.ru_maxrss, s, c.stderr.read().decode()[-300:]]))"
)


def _measure(code: str, args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of ``python -c CODE ARGS``."""
    done = subprocess.run([sys.executable, "-c", _TIMER, sys.executable, "-c", code, *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    wall, rss_kib, status, err = json.loads(done.stdout)
    if status != 0:
        raise AnytimeError(f"anytime schedule failed: {err.strip()}")
    return float(wall), rss_kib / 1024


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=RUN, help="a profiled run (default the CIFAR-10 multi-exit ResNet-32)")
    args = p.parse_args()
    if not any(args.run.glob("profile-*.json")):
        raise AnytimeError(f"{args.run} has no profile; give a profiled run with --run")
    command = ["schedule", str(args.run), "--deadline-ms", str(DEADLINE_MS)]
    shipped = "import sys; from anytime.cli import main; sys.exit(main(sys.argv[1:]))"
    with_torch = "import sys, torch; from anytime.cli import main; sys.exit(main(sys.argv[1:]))"
    repeats = 3 if args.quick else REPEATS
    times: dict[str, list[float]] = {"shipped": [], "with_torch": []}
    memory: dict[str, list[float]] = {"shipped": [], "with_torch": []}
    for _ in range(repeats):
        for name, code in (("shipped", shipped), ("with_torch", with_torch)):
            wall, rss = _measure(code, command)
            times[name].append(wall)
            memory[name].append(rss)
    figures = {name: {"wall_median_s": median(times[name]), "wall_max_s": max(times[name]),
                      "peak_rss_median_mib": median(memory[name])} for name in times}  # fmt: skip
    figures["run"] = str(args.run)
    figures["repeats"] = repeats
    for name in ("shipped", "with_torch"):
        f = figures[name]
        print(f"{name:<11} wall median {f['wall_median_s']:.3f} s (max {f['wall_max_s']:.3f}), "
              f"peak RSS {f['peak_rss_median_mib']:.0f} MiB")  # fmt: skip
    ratio = TARGET_S / figures["shipped"]["wall_median_s"]
    return report("cli_startup", args, figures, ratio, ">= 1 (anytime schedule under 1 s end to end)", ratio >= 1)


if __name__ == "__main__":
    run(main)
