"""Benchmark: structured lottery tickets are smaller networks that run faster; masked ones are not.

The lottery study's dense ResNet-20 (CIFAR-10, 5,000 training images, 6 epochs, its checkpoint after epoch 2 kept;
`anytime experiment lottery` trains it, and so does this benchmark if it is missing) is pruned three ways, one shot
each, the survivors rewound to epoch 2 and trained to the end (`anytime ticket --unit channels`): whole channels at
30%, 50% and 70% of the prunable channels (every residual block's inner channels; ranked over all blocks at once),
50% in every block alike (`--scope layer`), and single weights masked at the share of parameters the 50% channel
ticket removes. Their latency is measured side by side on the same inputs, the networks interleaved (A B C, then
C B A): at batch 1 with every core as torch threads (as `anytime profile` does), at batch 1 on one thread, and at
batch 32. Ratio: dense p50 / the 50% channel ticket's p50, batch 1, every core. Target: >= 1.25 (the ticket is a
step with real savings).
Quick: a ResNet-20 on the embedded digits, 3 epochs, the 50% channel ticket and its masked match only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from common import REPO, parser, report, run

from anytime.profile.latency import per_sample_latency
from anytime.train import TrainConfig, Trainer
from anytime.train.runs import load_run

# Hyper-parameters
TARGET = 1.25  # dense p50 / 50% channel ticket p50, batch 1
DENSE = REPO / "runs" / "lottery" / "dense"  # the lottery study's dense run (reused; trained here if missing)
DENSE_RECIPE = TrainConfig(model="resnet20", data="cifar10", limit_train=5_000, epochs=6, batch_size=128, lr=0.05,
                           amp="bf16", seed=0, keep_checkpoints=(0, 2))  # fmt: skip
CHANNEL_SPARSITIES = (0.3, 0.5, 0.7)  # share of the prunable channels removed
RESET_EPOCH = 2  # survivors rewound to the dense run's weights after this many epochs
SAMPLES = 1000  # inputs timed per network (batch 1: one call each)
BATCH = 32  # the batched timing's batch size
QUICK_RECIPE = TrainConfig(model="resnet20", data="digits", epochs=3, batch_size=64, lr=0.05, keep_checkpoints=(0, 1))


def _trained(config: TrainConfig, run_dir: Path) -> dict:
    """Train ``run_dir`` unless it has finished already (an interrupted one resumes)."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        import json

        return json.loads(summary.read_text())
    return Trainer(config, run_dir).fit(resume=(run_dir / "checkpoint.pt").is_file()).to_dict()


def _flops(model: torch.nn.Module, shape: tuple[int, ...]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.zeros(1, *shape))
    return int(counter.get_total_flops())


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, help="the folder of the dense run and the tickets (default runs/lottery; "
                                             "quick: runs/structured-quick)")  # fmt: skip
    args = p.parse_args()
    recipe = QUICK_RECIPE if args.quick else DENSE_RECIPE
    folder = args.runs or (REPO / "runs" / "structured-quick" if args.quick else DENSE.parent)
    dense_dir = folder / DENSE.name
    sparsities = (0.5,) if args.quick else CHANNEL_SPARSITIES
    reset = 1 if args.quick else RESET_EPOCH
    samples = 100 if args.quick else SAMPLES
    dense_summary = _trained(recipe, dense_dir)
    base = recipe.replace(keep_checkpoints=(), prune_from=str(dense_dir), reset_epoch=reset)
    runs: dict[str, Path] = {"dense": dense_dir}
    summaries = {"dense": dense_summary}
    for s in sparsities:
        name = f"channels-{s:g}"
        runs[name] = dense_dir.with_name(f"{dense_dir.name}-channels-s{s:g}-k{reset}")
        summaries[name] = _trained(base.replace(sparsity=s, prune_unit="channels"), runs[name])
    runs["channels-0.5-layer"] = dense_dir.with_name(f"{dense_dir.name}-channels-layer-s0.5-k{reset}")
    summaries["channels-0.5-layer"] = _trained(base.replace(sparsity=0.5, prune_unit="channels", prune_scope="layer"),
                                               runs["channels-0.5-layer"])  # fmt: skip
    half = summaries["channels-0.5"]["ticket"]
    matched = round(1.0 - half["parameters"] / half["dense_parameters"], 4)
    runs["masked"] = dense_dir.with_name(f"{dense_dir.name}-masked-s{matched:g}-k{reset}")
    summaries["masked"] = _trained(base.replace(sparsity=matched), runs["masked"])

    loaded = {name: load_run(path, "cpu") for name, path in runs.items()}
    models = {name: run_.model for name, run_ in loaded.items()}
    dataset = loaded["dense"].dataset
    shape = (int(dataset["in_channels"]), *(int(v) for v in (dataset.get("image_size") or (32, 32))))
    inputs = torch.randn(samples, *shape, generator=torch.Generator().manual_seed(0))
    cores = torch.get_num_threads()
    timed: dict[str, dict[str, np.ndarray]] = {}
    for label, threads, batch in ((f"batch 1, {cores} threads", cores, 1), ("batch 1, 1 thread", 1, 1),
                                  (f"batch {BATCH}, {cores} threads", cores, BATCH)):  # fmt: skip
        torch.set_num_threads(threads)
        timed[label] = per_sample_latency(models, inputs, warmup=20, batch_size=batch)
    torch.set_num_threads(cores)
    figures: dict[str, dict[str, float]] = {}
    for name, model in models.items():
        figures[name] = {
            "test_acc": float(summaries[name]["final"]["test_acc"]),
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "nonzero_parameters": int(sum(int(p.count_nonzero()) for p in model.parameters())),
            "gflops": _flops(model, shape) / 1e9,
        }  # fmt: skip
        for label, times in timed.items():
            ms = times[name] * 1000
            figures[name][f"{label}: p50_ms"] = float(np.median(ms))
            figures[name][f"{label}: p99_ms"] = float(np.quantile(ms, 0.99))
            figures[name][f"{label}: speedup_p50"] = float(np.median(times["dense"]) / np.median(times[name]))
    print(f"{'network':<18} {'test':>7} {'params':>9} {'nonzero':>9} {'GFLOPs':>7}")
    for name, f in figures.items():
        print(
            f"{name:<18} {100 * f['test_acc']:6.2f}% {f['parameters']:9d} {f['nonzero_parameters']:9d} {f['gflops']:7.4f}"
        )
    for label in timed:
        print(f"{label} (per call): " + ", ".join(
            f"{name} p50 {f[f'{label}: p50_ms']:.3f} ms ({f[f'{label}: speedup_p50']:.2f}x)" for name, f in figures.items()))  # fmt: skip
    ratio = figures["channels-0.5"][f"batch 1, {cores} threads: speedup_p50"]
    return report("structured_tickets", args, {"networks": figures, "masked_sparsity": matched, "reset_epoch": reset,
                                               "samples": samples, "threads": torch.get_num_threads()},
                  ratio, f">= {TARGET}", ratio >= TARGET)  # fmt: skip


if __name__ == "__main__":
    run(main)
