"""Benchmark: the int8 ensemble ladder against the best single fp32 member, at that member's p99 latency.

The members' int8 forms (``RUN-int8`` beside each of ``--members``) are built into an ensemble (cost order, MLP
fuser, cross-fitted on validation) and profiled at batch 1 beside the best fp32 member (chosen on validation), both
now, on this machine. The deadline scheduler then picks the ladder's most accurate step (validation accuracy) whose
p99 fits in the member's own p99; both are scored on the test split. The fuser's own batch-1 cost is timed beside the
whole ladder's, interleaved.

Targets (issue 12): the ladder's choice at least as accurate (test) at no more p99 latency; the fuser < 2% of the
ladder's batch-1 latency. Ratio: the chosen step's test accuracy over the best member's. Reported beside it (no
target): the same comparison for a mixed ladder, each member at whichever precision is faster at batch 1 here.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import REPO, fuser_share, member_runs, parser, report, run

from anytime.families import member_log_probs
from anytime.profile.latency import per_sample_latency
from anytime.scheduler import DeadlineScheduler
from anytime.scheduler.query import run_options
from anytime.tasks.ensemble import build_ensemble
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.train.runs import load_run

# Hyper-parameters
# in runs/: trained on a lent H200 (docs/benchmarks-archive.md, 2026-11-27), four architectures of comparable accuracy
MEMBERS = ("cifar10-resnet20-30ep", "cifar10-resnet32-exits-16ep", "cifar10-vgg11-30ep", "cifar10-resnet18-12ep")
REPEATS = 300  # batch-1 timings per step (a p99 needs at least 100)
QUANTILE = 0.99
FUSER_SHARE = 0.02
PRECISION_PROBE = 200  # batch-1 timings per member and precision that decide the mixed ladder's forms


def _test_accuracy(run_dir: Path) -> list[float]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return (
        [float(e["test_acc"]) for e in summary["exits"]]
        if "exits" in summary
        else [float(summary["final"]["test_acc"])]
    )


def _faster_forms(members: list[Path], quantized: list[Path], samples: int) -> list[Path]:
    """Each member's float or int8 run, whichever answers faster at batch 1 (p50, interleaved, random inputs)."""
    chosen = []
    for pair in zip(members, quantized):
        runs = [load_run(r) for r in pair]
        size = runs[0].dataset.get("image_size") or [32, 32]
        inputs = torch.randn(
            samples, int(runs[0].dataset["in_channels"]), *size, generator=torch.Generator().manual_seed(0)
        )
        calls = {str(i): (lambda x, r=r: member_log_probs(r.model, r.num_steps - 1 if r.num_steps > 1 else None, x))
                 for i, r in enumerate(runs)}  # fmt: skip
        with torch.inference_mode():
            times = per_sample_latency(calls, inputs, warmup=20)
        chosen.append(pair[int(np.median(times["1"]) < np.median(times["0"]))])
    return chosen


def _ladder(runs: list[Path], out: Path, repeats: int, deadline_ms: float) -> dict[str, object]:
    """Build, profile and schedule one ensemble ladder at ``deadline_ms``; its steps and its choice."""
    build_ensemble(runs, out, progress=lambda line: print("  " + line, flush=True))
    profile, _ = profile_run(out, ProfileSettings(batch_sizes=(1,), repeats=repeats, memory=False))
    choice = DeadlineScheduler(profile, run_options(out, profile.step_names), adapt=False).select(deadline_ms, QUANTILE)
    accuracy = _test_accuracy(out)
    steps = [{"step": name, "p99 ms": float(np.quantile(s, QUANTILE)), "test acc": a}
             for name, s, a in zip(profile.step_names, profile.at(1).steps, accuracy)]  # fmt: skip
    chosen = accuracy[choice.step] if choice.fits and choice.step is not None else float("nan")
    return {"runs": [str(r) for r in runs], "steps": steps, "choice": choice.option, "fits": choice.fits,
            "choice p99 ms": choice.latency_ms, "choice test acc": chosen}  # fmt: skip


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--members",
        default=",".join(str(REPO / "runs" / m) for m in MEMBERS),
        help="trained float runs, comma-separated; their int8 forms RUN-int8 must exist beside them",
    )
    args = p.parse_args()
    members, quantized = member_runs(args.members)
    repeats = 100 if args.quick else REPEATS
    best = max(members, key=lambda m: float(json.loads((m / "summary.json").read_text())["final"]["val_acc"]))
    member_acc = _test_accuracy(best)[-1]
    ladders: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        print(f"best fp32 member (validation): {best.name}; profiling it at batch 1...", flush=True)
        member_profile, _ = profile_run(
            best, ProfileSettings(batch_sizes=(1,), repeats=repeats, memory=False), out=Path(scratch) / "member.json"
        )
        member_p99 = float(np.quantile(member_profile.at(1).steps[-1], QUANTILE))
        mixed = _faster_forms(members, quantized, 40 if args.quick else PRECISION_PROBE)
        for name, runs in (("int8", quantized), ("mixed", mixed)):
            print(f"{name} ladder of {', '.join(r.name for r in runs)}...", flush=True)
            ladders[name] = _ladder(runs, Path(scratch) / name, repeats, member_p99)
        fuser_ms, ladder_ms = fuser_share(Path(scratch) / "int8", repeats)
    print(f"best member {best.name}: p99 {member_p99:.3f} ms, test {100 * member_acc:.2f}%")
    for name, ladder in ladders.items():
        for row in ladder["steps"]:  # type: ignore[attr-defined]
            print(f"  {name} ladder {row['step']:<26} p99 {row['p99 ms']:7.3f} ms  test {100 * row['test acc']:.2f}%")
        print(f"  at {member_p99:.3f} ms the {name} ladder chooses {ladder['choice']} "
              f"({'fits' if ladder['fits'] else 'nothing fits'}): test {100 * float(ladder['choice test acc']):.2f}%")  # type: ignore[arg-type]  # fmt: skip
    print(
        f"fuser {fuser_ms:.4f} ms of the int8 ladder's {ladder_ms:.3f} ms at batch 1 ({100 * fuser_ms / ladder_ms:.2f}%)"
    )
    int8 = ladders["int8"]
    chosen_acc = float(int8["choice test acc"])  # type: ignore[arg-type]
    checks = {
        "as accurate": bool(int8["fits"] and chosen_acc >= member_acc),
        "fuser share": fuser_ms / ladder_ms < FUSER_SHARE,
    }
    figures = {"best member": str(best), "member p99 ms": member_p99, "member test acc": member_acc,
               "ladders": ladders, "fuser ms": fuser_ms, "ladder ms": ladder_ms, "checks": checks,
               "threads": torch.get_num_threads()}  # fmt: skip
    ratio = chosen_acc / member_acc if int8["fits"] else 0.0
    return report(
        "ensemble_ladder", args, figures, ratio, ">= 1 at no more p99 latency; fuser < 2%", all(checks.values())
    )


if __name__ == "__main__":
    run(main)
