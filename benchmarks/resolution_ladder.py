"""Benchmark: the resolution ladder beside early exits and slices, accuracy against p99 latency at batch 1.

Three ResNet-20s, each one anytime family, trained with one budget on the CIFAR-10 images in ../shared (8,000
training images, 6 epochs, batch 128, lr 0.05 cosine, bf16 autocast; one seed): exits after every stage
(`--exits auto`), width slices 0.5/0.75/1.0 (`--slices`), and input resolutions 16/24/crop 24/32 px
(`--resolutions`, batch-norm statistics per resolution). Every step's test accuracy comes from its run's summary;
its p99 latency at batch 1 from `anytime profile` (200 repetitions, every core), the three profiled one after the
other on the otherwise quiet machine. Ratio: p99 of the ladder's cheapest step / p99 of its full-resolution step
(no target: the figure is the frontier; the plot is written beside the --json report).
Quick: the embedded digits, 2 epochs.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import REPO, parser, report, run

from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.train import TrainConfig, Trainer

# Hyper-parameters
BASE = TrainConfig(
    model="resnet20", data="cifar10", limit_train=8_000, epochs=6, batch_size=128, lr=0.05, amp="bf16", seed=0
)
FAMILIES = {
    "exits": {"exits": "auto"},
    "slices": {"slices": "0.5,0.75,1.0"},
    "resolutions": {"resolutions": "16,24,c24,32"},
}
REPEATS = 200  # batch-1 timings per step
QUICK = {"data": "digits", "limit_train": None, "epochs": 2, "batch_size": 64, "amp": "off"}


def _trained(config: TrainConfig, run_dir: Path) -> dict:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    return Trainer(config, run_dir).fit(resume=(run_dir / "checkpoint.pt").is_file()).to_dict()


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, help="where the three runs are kept and reused (default runs/resolution-bench)")
    args = p.parse_args()
    base = BASE.replace(**QUICK) if args.quick else BASE
    folder = args.runs or REPO / "runs" / ("resolution-bench-quick" if args.quick else "resolution-bench")
    figures: dict[str, list[dict[str, float | str]]] = {}
    for family, fields in FAMILIES.items():
        run_dir = folder / family
        summary = _trained(base.replace(**fields), run_dir)
        for stale in run_dir.glob("profile-*.json"):  # this benchmark's own runs: profiled anew each time
            stale.unlink()
        profile, _ = profile_run(
            run_dir, ProfileSettings(batch_sizes=(1,), repeats=20 if args.quick else REPEATS, warmup=10, memory=False)
        )
        q = profile.highest_quantile()
        figures[family] = [{"step": name, "test_acc": float(entry["test_acc"]), "gflops": profile.step_flops[k] / 1e9,
                            "p50_ms": profile.step_quantile(k, 0.5), "p99_ms": profile.step_quantile(k, q)}
                           for k, (name, entry) in enumerate(zip(profile.step_names, summary["exits"]))]  # fmt: skip
    print(f"{'family':<12} {'step':<8} {'test':>7} {'GFLOPs':>7} {'p50 ms':>7} {'p99 ms':>7}")
    for family, steps in figures.items():
        for s in steps:
            print(f"{family:<12} {s['step']:<8} {100 * float(s['test_acc']):6.2f}% {float(s['gflops']):7.4f} "
                  f"{float(s['p50_ms']):7.3f} {float(s['p99_ms']):7.3f}")  # fmt: skip
    ladder = figures["resolutions"]
    ratio = float(ladder[0]["p99_ms"]) / float(ladder[-1]["p99_ms"])
    if args.json:
        _plot(figures, Path(args.json).with_suffix(""))
    return report("resolution_ladder", args, {"families": figures, "budget": base.to_dict()}, ratio,
                  "none (a frontier)", None)  # fmt: skip


def _plot(figures: dict[str, list[dict[str, float | str]]], stem: Path) -> None:
    from matplotlib.figure import Figure

    from anytime.plotting import save_figure

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for family, steps in figures.items():
        xs, ys = [float(s["p99_ms"]) for s in steps], [100 * float(s["test_acc"]) for s in steps]
        ax.plot(xs, ys, "o-", label=family)
        for s, x, y in zip(steps, xs, ys):
            ax.annotate(str(s["step"]), (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set(xlabel="p99 latency at batch 1 (ms)", ylabel="test accuracy (%)",
           title="ResNet-20 on CIFAR-10: three anytime families, one budget")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, stem, formats=("png", "svg"))


if __name__ == "__main__":
    run(main)
