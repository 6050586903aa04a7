"""Benchmark: what attaching exits costs a sample that goes all the way to the last exit.

The model is the multi-exit benchmark's (ResNet-32 with four pooled exit heads at about 15, 35, 55
and 75% of its FLOPs; random weights, since the cost does not depend on them). The policy evaluates
every exit head and its entropy and lets nobody leave early (a threshold of 0 nats: only an entropy of
exactly 0 would leave, which these random weights never give), the worst case for
early exit. It runs interleaved with the plain backbone on the same inputs, at batch 1 and 32.
Ratio: mean latency with exits / without. Target: at most 1.05 at both batch sizes.
"""

from __future__ import annotations

import torch
from common import parser, report, run

from anytime.backbones import create_model
from anytime.calibrate import ExitPolicy
from anytime.profile import latency_summary, per_sample_latency
from anytime.wrappers import attach_exits

TARGET = 1.05
POINTS = "0.15,0.35,0.55,0.75"


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    model = attach_exits(create_model("resnet32"), POINTS).eval()
    policy = ExitPolicy("entropy", (0.0,) * (model.num_steps - 1))
    figures: dict[str, dict[str, float]] = {}
    worst = 0.0
    for batch_size, batches in ((1, 60 if args.quick else 600), (32, 8 if args.quick else 80)):
        inputs = torch.randn(batch_size * batches, 3, 32, 32)
        times = per_sample_latency(
            {"backbone": lambda x: model.backbone(x), "exits": lambda x: policy.run(model, x)},
            inputs, warmup=10, batch_size=batch_size,
        )  # fmt: skip
        plain, exits = latency_summary(times["backbone"]), latency_summary(times["exits"])
        ratio = exits["mean_ms"] / plain["mean_ms"]
        worst = max(worst, ratio)
        figures[f"batch{batch_size}"] = {"backbone_mean_ms": plain["mean_ms"], "exits_mean_ms": exits["mean_ms"],
                                         "backbone_p50_ms": plain["p50_ms"], "exits_p50_ms": exits["p50_ms"],
                                         "ratio_mean": ratio, "ratio_p50": exits["p50_ms"] / plain["p50_ms"]}  # fmt: skip
        print(f"batch {batch_size:>2}: backbone {plain['mean_ms']:.3f} ms, with exits {exits['mean_ms']:.3f} ms "
              f"(mean; p50 {plain['p50_ms']:.3f} vs {exits['p50_ms']:.3f}) -> {ratio:.3f}x")  # fmt: skip
    return report("exit_overhead", args, figures, worst, f"<= {TARGET}", worst <= TARGET)


if __name__ == "__main__":
    run(main)
