"""Benchmark: the MLP-fused heterogeneous ensemble against mean and vote fusion and its best member, fp32 and int8.

Members (``--members``) are trained CIFAR-10 runs of different architectures sharing one split; their int8 forms
(``anytime quantize``) are ``RUN-int8`` beside each. ``anytime ensemble`` builds both ensembles (cost order, every
fuser fit on validation, cross-fitted) and reports each fuser's test accuracy with all members in. The fuser's
own cost is timed at batch 1 beside the whole ensemble's answer, interleaved.

Targets (issue 12): the MLP-fused ensemble beats its best member (chosen on validation) by >= 2 test points and
beats mean fusion; the int8 ensemble loses <= 1 point against the fp32 ensemble; the fuser costs < 2% of the
ensemble's batch-1 latency. Ratio: the MLP's gain over the best member, in units of the 2-point target.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from common import REPO, fuser_share, member_runs, parser, report, run

from anytime.tasks.ensemble import EnsembleSettings, build_ensemble

# Hyper-parameters
# in runs/: trained on a lent H200 (docs/benchmarks-archive.md, 2026-11-27), four architectures of comparable accuracy
MEMBERS = ("cifar10-resnet20-30ep", "cifar10-resnet32-exits-16ep", "cifar10-vgg11-30ep", "cifar10-resnet18-12ep")
FOLDS = 5  # cross-fitting folds of the validation split
TIMED = 300  # batch-1 timings of the fuser and of the whole ensemble
GAIN_POINTS = 2.0
INT8_LOSS_POINTS = 1.0
FUSER_SHARE = 0.02


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--members",
        default=",".join(str(REPO / "runs" / m) for m in MEMBERS),
        help="trained float runs, comma-separated (default: the four CIFAR-10 runs of MEMBERS in runs/)",
    )
    args = p.parse_args()
    members, quantized = member_runs(args.members)
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, runs in (("fp32", members), ("int8", quantized)):
            print(f"building the {name} ensemble of {', '.join(r.name for r in runs)}...", flush=True)
            built = build_ensemble(
                runs,
                Path(scratch) / name,
                EnsembleSettings(folds=FOLDS),
                progress=lambda line: print("  " + line, flush=True),
            )
            rows[name] = built
            best = built.best_member
            print(f"  best member (validation) {best.name}: test {100 * best.test_acc:.2f}%")
            for kind, accs in built.test_acc.items():
                print(f"  {kind:<9} test " + "  ".join(f"k={k + 1} {100 * a:6.2f}%" for k, a in enumerate(accs)))
        fuser_ms, ensemble_ms = fuser_share(Path(scratch) / "fp32", 40 if args.quick else TIMED)
    share = {"fuser ms": fuser_ms, "ensemble ms": ensemble_ms, "share": fuser_ms / ensemble_ms}
    fp32, int8 = rows["fp32"], rows["int8"]
    mlp, mean = fp32.test_acc["mlp"][-1], fp32.test_acc["mean"][-1]
    gain = 100 * (mlp - fp32.best_member.test_acc)
    loss = 100 * (mlp - int8.test_acc["mlp"][-1])
    print(f"MLP ensemble {100 * mlp:.2f}% vs best member {100 * fp32.best_member.test_acc:.2f}% ({gain:+.2f} points), "
          f"vs mean fusion {100 * mean:.2f}%; int8 ensemble {100 * int8.test_acc['mlp'][-1]:.2f}% ({-loss:+.2f} points)")  # fmt: skip
    print(f"fuser {share['fuser ms']:.4f} ms of {share['ensemble ms']:.3f} ms at batch 1 ({100 * share['share']:.2f}%)")
    checks = {"gain": gain >= GAIN_POINTS, "beats mean": mlp > mean, "int8 loss": loss <= INT8_LOSS_POINTS,
              "fuser share": share["share"] < FUSER_SHARE}  # fmt: skip
    figures = {
        "members": [str(m) for m in members],
        "fp32": {"members": [vars(m) for m in fp32.members], "test_acc": fp32.test_acc, "val_acc": fp32.val_acc},
        "int8": {"members": [vars(m) for m in int8.members], "test_acc": int8.test_acc, "val_acc": int8.val_acc},
        "gain points": gain, "int8 loss points": loss, "fuser": share, "checks": checks,
        "best member": vars(fp32.best_member), "threads": torch.get_num_threads(),
        "member test acc spread": float(np.ptp([m.test_acc for m in fp32.members])),
    }  # fmt: skip
    return report(
        "ensemble_fusion",
        args,
        figures,
        gain / GAIN_POINTS,
        ">= 1 (MLP +2 points over the best member), beats mean, int8 <= 1 point, fuser < 2%",
        all(checks.values()),
    )


if __name__ == "__main__":
    run(main)
