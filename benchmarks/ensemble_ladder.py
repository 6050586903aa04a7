"""Benchmark: the int8 ensemble ladder against the best single fp32 member, at that member's p99 latency.

The members' int8 forms (``RUN-int8`` beside each of ``--members``) are built into an ensemble (cost order, MLP
fuser, cross-fitted on validation) and profiled at batch 1 beside the best fp32 member (chosen on validation), both
now, on this machine. The deadline scheduler then picks the ladder's most accurate step (validation accuracy) whose
p99 fits in the member's own p99; both are scored on the test split. The fuser's own batch-1 cost is timed beside the
whole ladder's, interleaved.

Targets (issue 12): the ladder's choice at least as accurate (test) at no more p99 latency; the fuser < 2% of the
ladder's batch-1 latency. Ratio: the chosen step's test accuracy over the best member's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import REPO, fuser_share, member_runs, parser, report, run

from anytime.ensemble import build_ensemble
from anytime.pipeline import profile_run, run_options
from anytime.scheduler import DeadlineScheduler

# Hyper-parameters
MEMBERS = ("cifar10-resnet20-5ep", "cifar10-resnet32-exits-12ep", "cifar10-resnet18-2ep", "cifar10-vgg11-10ep")  # in runs/
REPEATS = 300  # batch-1 timings per step (a p99 needs at least 100)
QUANTILE = 0.99
FUSER_SHARE = 0.02


def _test_accuracy(run_dir: Path) -> list[float]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return [float(e["test_acc"]) for e in summary["exits"]] if "exits" in summary else [float(summary["final"]["test_acc"])]


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--members", default=",".join(str(REPO / "runs" / m) for m in MEMBERS),
                   help="trained float runs, comma-separated; their int8 forms RUN-int8 must exist beside them")
    args = p.parse_args()
    members, quantized = member_runs(args.members)
    repeats = 100 if args.quick else REPEATS
    with tempfile.TemporaryDirectory() as scratch:
        ladder = Path(scratch) / "int8-ensemble"
        built = build_ensemble(quantized, ladder, progress=lambda line: print("  " + line, flush=True))
        best = max(members, key=lambda m: float(json.loads((m / "summary.json").read_text())["final"]["val_acc"]))
        print(f"best fp32 member (validation): {best.name}; profiling it and the int8 ladder at batch 1...", flush=True)
        member_profile, _ = profile_run(best, batch_sizes=[1], repeats=repeats, memory=False, out=Path(scratch) / "member.json")
        ladder_profile, _ = profile_run(ladder, batch_sizes=[1], repeats=repeats, memory=False)
        member_p99 = float(np.quantile(member_profile.at(1).steps[-1], QUANTILE))
        member_acc = _test_accuracy(best)[-1]
        scheduler = DeadlineScheduler(ladder_profile, run_options(ladder, ladder_profile.step_names), adapt=False)
        choice = scheduler.select(member_p99, QUANTILE)
        ladder_acc = _test_accuracy(ladder)
        chosen_acc = ladder_acc[choice.step] if choice.fits and choice.step is not None else float("nan")
        fuser_ms, ladder_ms = fuser_share(ladder, repeats)
        steps = [{"step": name, "p99 ms": float(np.quantile(s, QUANTILE)), "test acc": a}
                 for name, s, a in zip(ladder_profile.step_names, ladder_profile.at(1).steps, ladder_acc)]  # fmt: skip
    for row in steps:
        print(f"  int8 ladder {row['step']:<24} p99 {row['p99 ms']:7.3f} ms  test {100 * row['test acc']:.2f}%")
    print(f"best member {best.name}: p99 {member_p99:.3f} ms, test {100 * member_acc:.2f}%")
    print(f"at that deadline the ladder chooses {choice.option} ({'fits' if choice.fits else 'nothing fits'}, p99 "
          f"{choice.latency_ms:.3f} ms): test {100 * chosen_acc:.2f}%")  # fmt: skip
    print(f"fuser {fuser_ms:.4f} ms of the ladder's {ladder_ms:.3f} ms at batch 1 ({100 * fuser_ms / ladder_ms:.2f}%)")
    checks = {"as accurate": bool(choice.fits and chosen_acc >= member_acc),
              "fuser share": fuser_ms / ladder_ms < FUSER_SHARE}  # fmt: skip
    figures = {"members": [str(m) for m in quantized], "best member": str(best), "member p99 ms": member_p99,
               "member test acc": member_acc, "ladder steps": steps, "choice": choice.option, "fits": choice.fits,
               "choice p99 ms": choice.latency_ms, "choice test acc": chosen_acc, "fuser ms": fuser_ms,
               "ladder ms": ladder_ms, "order": [m.name for m in built.members], "checks": checks,
               "threads": torch.get_num_threads()}  # fmt: skip
    ratio = chosen_acc / member_acc if choice.fits else 0.0
    return report("ensemble_ladder", args, figures, ratio, ">= 1 at no more p99 latency; fuser < 2%", all(checks.values()))


if __name__ == "__main__":
    run(main)
