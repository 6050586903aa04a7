"""Benchmark: a threshold sweep from the outputs cache against a per-setting loop in plain PyTorch.

1,000 settings x 10,000 samples x 5 exits (10 classes; synthetic logits whose later exits are more often
right, seeded). Both sides start from the same cache and compute accuracy, mean FLOPs and the share of
samples leaving at every exit for every setting. The loop is what one writes by hand: the entropy of
every exit computed once, then for each setting a pass over the exits with boolean masks. Ours: the
sweep of thresholds shared by all exits (sorted running minima and a binary search), and the general
evaluation of arbitrary per-exit settings (all settings at once, in chunks). Results are checked equal.
Ratio: loop time / our shared sweep time. Target: the shared sweep in milliseconds (< 50 ms).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from common import median, parser, report, run

from anytime.calibrate import get_criterion, sweep
from anytime.calibrate.sweeps import evaluate_settings, scores_of, shared_grid
from anytime.outputs import OutputCache

SETTINGS, SAMPLES, EXITS, CLASSES = 1000, 10_000, 5, 10
TARGET_MS = 50.0


def synthetic_cache() -> OutputCache:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, SAMPLES)
    logits = rng.normal(size=(EXITS, SAMPLES, CLASSES)).astype(np.float32)
    for k in range(EXITS):
        logits[k, np.arange(SAMPLES), labels] += 0.8 * (k + 1)
    cost = np.array([15, 35, 55, 75, 100], dtype=np.int64)
    return OutputCache(logits, labels, tuple(f"exit{k}" for k in range(EXITS)), cost, cost, 100, "val", "synthetic")


def loop_sweep(cache: OutputCache, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hand-written loop: one setting at a time."""
    logits = torch.from_numpy(cache.logits)
    labels = torch.from_numpy(cache.labels)
    entropy = get_criterion("entropy").score(logits[:-1])
    correct = logits.argmax(dim=2) == labels
    cost = torch.from_numpy(cache.cost_flops).double()
    accs, costs, shares = [], [], []
    for setting in thresholds:
        remaining = torch.ones(SAMPLES, dtype=torch.bool)
        hits, share = 0, torch.zeros(EXITS, dtype=torch.float64)
        for k in range(EXITS):
            leave = remaining if k == EXITS - 1 else remaining & (entropy[k] <= setting[k])
            share[k] = leave.sum()
            hits += int((leave & correct[k]).sum())
            remaining = remaining & ~leave
        accs.append(hits / SAMPLES)
        shares.append(share / SAMPLES)
        costs.append(float((share / SAMPLES) @ cost))
    return torch.tensor(accs, dtype=torch.float64), torch.tensor(costs, dtype=torch.float64), torch.stack(shares)


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    cache = synthetic_cache()
    scores = scores_of(cache, "entropy")
    grid = shared_grid(scores, SETTINGS)  # signed thresholds; entropy's are its own values
    rounds = 2 if args.quick else 5
    t_shared, t_general, t_loop = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        result = sweep(cache, "entropy", settings=SETTINGS)
        t_shared.append(time.perf_counter() - start)
        start = time.perf_counter()
        general = evaluate_settings(scores_of(cache, "entropy"), grid)
        t_general.append(time.perf_counter() - start)
        start = time.perf_counter()
        loop = loop_sweep(cache, grid)
        t_loop.append(time.perf_counter() - start)
    assert np.array_equal(result.accuracy, loop[0].numpy()) and np.array_equal(general[0].numpy(), loop[0].numpy())
    assert np.allclose(result.mean_flops, loop[1].numpy()) and np.array_equal(result.exit_share, loop[2].numpy())
    shared_ms, general_ms, loop_ms = (1000 * median(t) for t in (t_shared, t_general, t_loop))
    print(
        f"{SETTINGS} settings x {SAMPLES} samples x {EXITS} exits ({torch.get_num_threads()} threads), medians of {rounds}:"
    )
    print(f"  our shared-threshold sweep     {shared_ms:9.1f} ms")
    print(f"  our general per-exit sweep     {general_ms:9.1f} ms  ({loop_ms / general_ms:.1f}x faster than the loop)")
    print(
        f"  per-setting loop in PyTorch    {loop_ms:9.1f} ms  ({loop_ms / shared_ms:.1f}x slower than the shared sweep)"
    )
    figures = {"shared_ms": shared_ms, "general_ms": general_ms, "loop_ms": loop_ms,
               "loop_over_general": loop_ms / general_ms, "threads": torch.get_num_threads()}  # fmt: skip
    return report("sweep_speed", args, figures, loop_ms / shared_ms, f"shared sweep < {TARGET_MS:.0f} ms",
                  shared_ms < TARGET_MS)  # fmt: skip


if __name__ == "__main__":
    run(main)
