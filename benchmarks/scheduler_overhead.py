"""Benchmark: the cost of one deadline query, and of the anytime runtime's bookkeeping.

A profile shaped like the multi-exit CIFAR ResNet's (5 exits, 1000 samples each, batch sizes 1, 8, 16
and 32, log-normal latencies) and its early-exit policy make the options. Each ``select`` call, with a
random deadline across the whole range, is timed on its own (perf_counter_ns), static and with online
adaptation (an ``observe`` between queries, outside the timing). Side by side: a direct scan that
computes every option's quantile from the samples per query, as one would without a frontier. The
runtime's overhead is its time per request on a 5-stage model whose stages do no work, against
iterating the same stages bare. Ratio: 20 us / the p99 of one adaptive ``select``. Target: >= 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch
from common import parser, report, run
from torch import Tensor, nn

from anytime.calibrate import ExitPolicy
from anytime.profile import BatchLatency, DeviceProfile
from anytime.scheduler import AnytimeRunner, DeadlineScheduler, Option

# Hyper-parameters
TARGET_US = 20.0  # p99 of one select call, microseconds
STEP_MS = (0.55, 1.35, 2.05, 2.8, 3.8)  # median latency of each exit alone at batch 1 (ms), as measured on ResNet-32
SAMPLES = 1000  # profile samples per step
QUERIES = 200_000
RUNTIME_REQUESTS = 20_000


def _profile(rng: np.random.Generator) -> DeviceProfile:
    latency = {}
    stage_ms = np.diff(np.concatenate([[0.0], STEP_MS]))

    def noise() -> np.ndarray:
        return rng.lognormal(0.0, 0.15, SAMPLES)

    for b in (1, 8, 16, 32):
        latency[b] = BatchLatency(b, tuple(b**0.7 * m * noise() for m in STEP_MS),
                                  tuple(b**0.7 * m * noise() for m in stage_ms))  # fmt: skip
    k = len(STEP_MS)
    return DeviceProfile(
        model_fingerprint="synthetic", model="resnet32-exits", input_shape=(3, 32, 32), incremental=True,
        step_names=tuple(f"exit{i}" for i in range(k)), step_flops=tuple(range(k)), step_params=(0,) * k,
        model_bytes=0, latency=latency, device={"type": "cpu", "label": "synthetic"}, settings={}, created="",
    )  # fmt: skip


def _time_queries(scheduler: DeadlineScheduler, deadlines: np.ndarray, observe: bool) -> np.ndarray:
    select, clock = scheduler.select, time.perf_counter_ns
    out = np.empty(len(deadlines))
    for i, d in enumerate(deadlines.tolist()):
        start = clock()
        choice = select(d)
        out[i] = clock() - start
        if observe:
            # A policy's answer is observed with the exit it reached; here, as if every one reached the last.
            scheduler.observe(choice, d / 1000 * 0.8, step=None if choice.kind == "step" else len(STEP_MS) - 1)
    return out / 1000  # microseconds


def _scan(scheduler: DeadlineScheduler, deadlines: np.ndarray) -> np.ndarray:
    """Every option's p99 computed from the samples at each query (the policy's from its mixture), the most
    accurate that fits kept: what a query costs without a frontier."""
    out = np.empty(len(deadlines))
    options = list(scheduler.options.values())
    for i, d in enumerate(deadlines.tolist()):
        start = time.perf_counter_ns()
        best = None
        for o in options:
            if scheduler.latency(o, 0.99) <= d and (best is None or o.accuracy > best.accuracy):
                best = o
        out[i] = time.perf_counter_ns() - start
    return out / 1000


class _Idle(nn.Module):
    """Five stages that do no work: what remains is the runtime's own cost."""

    num_steps = 5
    incremental = True

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(1, 10))

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        for _ in range(self.num_steps):
            yield self.logits.detach()

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        return self.logits.detach()

    def forward_all(self, x: Tensor) -> Tensor:
        return torch.stack(list(self.steps(x)))


def _runtime_overhead(profile: DeviceProfile, requests: int) -> dict[str, float]:
    model = _Idle().eval()
    runner = AnytimeRunner(model, profile, ExitPolicy("confidence", (0.999,) * 4), quantile=0.99, adapt=True)
    x = torch.zeros(1, 3, 32, 32)
    bare, managed = np.empty(requests), np.empty(requests)
    with torch.inference_mode():
        for i in range(requests):
            start = time.perf_counter_ns()
            for logits in model.steps(x):
                logits.softmax(dim=1).max()
            bare[i] = time.perf_counter_ns() - start
            start = time.perf_counter_ns()
            runner.predict(x, 1e6)
            managed[i] = time.perf_counter_ns() - start
    return {"bare_us_p50": float(np.median(bare) / 1000), "runtime_us_p50": float(np.median(managed) / 1000),
            "runtime_us_p99": float(np.quantile(managed, 0.99) / 1000),
            "overhead_us_per_stage": float((np.median(managed) - np.median(bare)) / 1000 / 5)}  # fmt: skip


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    queries = 5_000 if args.quick else QUERIES
    rng = np.random.default_rng(0)
    profile = _profile(rng)
    accuracy = [0.62, 0.71, 0.81, 0.84, 0.855]
    policy = Option("early-exit", 0.848, policy=ExitPolicy("confidence", (0.99, 0.97, 0.95, 0.9)),
                    exit_share=(0.35, 0.2, 0.2, 0.1, 0.15))  # fmt: skip
    deadlines = rng.uniform(0.3, 6.0, queries)
    figures: dict[str, dict[str, float]] = {}
    for name, adapt in (("static", False), ("adaptive", True)):
        scheduler = DeadlineScheduler.from_accuracies(profile, accuracy, [policy], adapt=adapt)
        scheduler.select(1.0)  # builds the frontier once
        us = _time_queries(scheduler, deadlines, observe=adapt)
        figures[name] = {"p50_us": float(np.median(us)), "p99_us": float(np.quantile(us, 0.99)),
                         "max_us": float(us.max()), "queries": queries}  # fmt: skip
    scan = _scan(scheduler, deadlines[: max(200, queries // 100)])
    figures["direct_scan"] = {"p50_us": float(np.median(scan)), "p99_us": float(np.quantile(scan, 0.99))}
    figures["runtime"] = _runtime_overhead(profile, 1000 if args.quick else RUNTIME_REQUESTS)
    for name in ("static", "adaptive", "direct_scan"):
        f = figures[name]
        print(f"select, {name:<11}: p50 {f['p50_us']:7.2f} us, p99 {f['p99_us']:7.2f} us")
    ratio_scan = figures["direct_scan"]["p99_us"] / figures["adaptive"]["p99_us"]
    print(f"the frontier answers {ratio_scan:.0f}x faster than the direct scan (p99)")
    r = figures["runtime"]
    print(f"runtime on 5 idle stages: {r['runtime_us_p50']:.1f} us per request (p99 {r['runtime_us_p99']:.1f}) vs "
          f"{r['bare_us_p50']:.1f} us bare: {r['overhead_us_per_stage']:.1f} us per stage")  # fmt: skip
    p99 = figures["adaptive"]["p99_us"]
    return report(
        "scheduler_overhead", args, figures, TARGET_US / p99, f">= 1 (p99 <= {TARGET_US:g} us)", p99 <= TARGET_US
    )


if __name__ == "__main__":
    run(main)
