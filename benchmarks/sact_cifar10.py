"""Benchmark: a SACT ResNet against the same ResNet with early exits, at matched FLOPs and matched measured latency.

Four ResNet-32s trained with one budget on the CIFAR-10 images in ../shared (16,000 training images, 10 epochs,
batch 128, lr 0.05 cosine, bf16 autocast; one seed): SACT (`--sact`, halting per position, ponder cost 0.01 as the
paper's CIFAR runs, trained at threshold 0.99; steps at thresholds 0.3/0.5/0.7/0.9/0.99), exits at SDN's FLOP
fractions (`exits`: `--exits sdn`, six exits and the output), exits after the first two stages (`exits-auto`:
`--exits auto`), and the plain network (the reference all are measured against). Every step's test accuracy comes
from its run's summary; its FLOPs from the run (SACT: mean per image as executed, counted by the trainer on 1,024
validation images); its p50 latency at batch 1 and batch 64 from `anytime profile` on validation images (SACT's cost
depends on them), every run profiled in five interleaved rounds and each p50 the lowest of the five (batch-1 p50s on
this VM jump by 2x for tens of seconds at a time, whatever runs). SACT is timed twice: sparse (gathers of the active positions)
and dense (every unit everywhere, the active positions kept). For each SACT step each exit model's accuracy is
interpolated at the same FLOPs and at the same batch-1 p50 (SACT's faster execution) along its exits. Ratio: sparse /
dense p50 of SACT's cheapest step at batch 1 (below 1: the skipped positions save time). Quick: the embedded digits,
ResNet-20, 2 epochs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
from common import REPO, parser, report, run

from anytime.train import TrainConfig, Trainer

# Hyper-parameters
BASE = TrainConfig(model="resnet32", data="cifar10", limit_train=16_000, epochs=10, batch_size=128, lr=0.05, amp="bf16",
                   seed=0)  # fmt: skip
FAMILIES = {"sact": {"sact": "0.3,0.5,0.7,0.9,0.99", "ponder_cost": 0.01}, "exits": {"exits": "sdn"},
            "exits-auto": {"exits": "auto"}, "plain": {}}  # fmt: skip
EXIT_FAMILIES = ("exits", "exits-auto")
BATCHES = (1, 64)  # images per timed forward
REPEATS = {1: 50, 64: 10}  # timed forwards per step and batch size, per round
ROUNDS = 5  # every run profiled this many times, interleaved; a step's p50 is its lowest over the rounds
QUICK = {"model": "resnet20", "data": "digits", "limit_train": None, "epochs": 2, "batch_size": 64, "amp": "off"}


@dataclass(frozen=True)
class Step:
    """One step of a family: test accuracy (fraction), FLOPs per image and p50 milliseconds per batch size."""

    name: str
    test_acc: float
    flops: int
    p50_ms: dict[int, float]


def train(folder: Path, base: TrainConfig) -> dict[str, dict]:
    """Train (or resume, or reuse) the two runs under ``folder``; their summaries."""
    summaries = {}
    for family, fields in FAMILIES.items():
        run_dir = folder / family
        summary = run_dir / "summary.json"
        if summary.is_file():
            summaries[family] = json.loads(summary.read_text())
        else:
            summaries[family] = (
                Trainer(base.replace(**fields), run_dir).fit(resume=(run_dir / "checkpoint.pt").is_file()).to_dict()
            )
    return summaries


def _steps(run_dir: Path, summary: dict, quick: bool, execution: str | None = None) -> list[Step]:
    """Every step of a run, its p50 latency from one profile per batch size (this benchmark's own file, replaced)."""
    from anytime.tasks.profiling import ProfileSettings, profile_run

    out = run_dir / f"profile-bench{'-' + execution if execution else ''}.json"
    if out.exists():
        out.unlink()
    times: dict[int, list[float]] = {}
    names: tuple[str, ...] = ()
    for batch in BATCHES:
        profile, _ = profile_run(
            run_dir,
            ProfileSettings(
                batch_sizes=(batch,),
                repeats=5 if quick else REPEATS[batch],
                warmup=3,
                memory=False,
                execution=execution,
            ),
            out=out,
        )
        out.unlink()
        times[batch] = [profile.step_quantile(k, 0.5, batch) for k in range(profile.num_steps)]
        names, flops = profile.step_names, profile.step_flops
    entries = summary.get("exits") or [summary["final"]]  # a plain network has one step, its output
    return [Step(n, float(e["test_acc"]), int(f), {b: times[b][k] for b in BATCHES})
            for k, (n, e, f) in enumerate(zip(names, entries, flops))]  # fmt: skip


def _rounds(measure: dict[str, Callable[[], list[Step]]], rounds: int) -> dict[str, list[Step]]:
    """Each measurement ``rounds`` times, interleaved (A B C, A B C, ...); every p50 the lowest over the rounds,
    the one a slow spell of the machine (another tenant) disturbed least."""
    taken: dict[str, list[list[Step]]] = {name: [] for name in measure}
    for _ in range(rounds):
        for name, run_it in measure.items():
            taken[name].append(run_it())
    return {name: [Step(s.name, s.test_acc, s.flops, {b: min(r[k].p50_ms[b] for r in runs) for b in BATCHES})
                   for k, s in enumerate(runs[0])]
            for name, runs in taken.items()}  # fmt: skip


def _matched(xs: list[float], ys: list[float], x: float) -> float | None:
    """``ys`` interpolated at ``x`` along a frontier sorted by ``xs``; None outside it."""
    order = np.argsort(xs)
    xs_sorted, ys_sorted = np.asarray(xs)[order], np.asarray(ys)[order]
    if not xs_sorted[0] <= x <= xs_sorted[-1]:
        return None
    return float(np.interp(x, xs_sorted, ys_sorted))


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, help="where the runs are kept and reused (default runs/sact-bench)")
    args = p.parse_args()
    base = BASE.replace(**QUICK) if args.quick else BASE
    folder = args.runs or REPO / "runs" / ("sact-bench-quick" if args.quick else "sact-bench")
    summaries = train(folder, base)
    measure: dict[str, Callable[[], list[Step]]] = {
        "sparse": lambda: _steps(folder / "sact", summaries["sact"], args.quick, "sparse"),
        "dense": lambda: _steps(folder / "sact", summaries["sact"], args.quick, "dense"),
        **{name: partial(_steps, folder / name, summaries[name], args.quick) for name in (*EXIT_FAMILIES, "plain")},
    }
    measured = _rounds(measure, 1 if args.quick else ROUNDS)
    sparse, dense, plain = measured["sparse"], measured["dense"], measured["plain"][0]
    exits = {name: measured[name] for name in EXIT_FAMILIES}
    rows = []
    matched = "".join(f" {name + '@FLOPs':>16} {name + '@ms':>13}" for name in EXIT_FAMILIES)
    print(f"{'SACT step':<10} {'test':>7} {'MFLOPs':>8} {'b1 sparse':>9} {'b1 dense':>9} {'b64 sparse':>10} "
          f"{'b64 dense':>9}{matched}")  # fmt: skip
    for s, d in zip(sparse, dense):
        fastest = min(s.p50_ms[1], d.p50_ms[1])
        row = {
            "step": s.name,
            "test_acc": s.test_acc,
            "flops": s.flops,
            "p50_ms_sparse": s.p50_ms,
            "p50_ms_dense": d.p50_ms,
        }
        for name, steps in exits.items():
            accs = [e.test_acc for e in steps]
            row[f"{name}_acc_at_flops"] = _matched([e.flops for e in steps], accs, s.flops)
            row[f"{name}_acc_at_b1_latency"] = _matched([e.p50_ms[1] for e in steps], accs, fastest)
        rows.append(row)
        cells = "".join(
            f" {_pct(row[f'{n}_acc_at_flops']):>16} {_pct(row[f'{n}_acc_at_b1_latency']):>13}" for n in exits
        )
        print(f"{s.name:<10} {100 * s.test_acc:6.2f}% {s.flops / 1e6:8.2f} {s.p50_ms[1]:9.3f} {d.p50_ms[1]:9.3f} "
              f"{s.p50_ms[64]:10.3f} {d.p50_ms[64]:9.3f}{cells}")  # fmt: skip
    print(f"{'run':<11} {'step':<8} {'test':>7} {'MFLOPs':>8} {'b1 ms':>9} {'b64 ms':>10}")
    for name, steps in [*exits.items(), ("plain", [plain])]:
        for e in steps:
            print(
                f"{name:<11} {e.name:<8} {100 * e.test_acc:6.2f}% {e.flops / 1e6:8.2f} {e.p50_ms[1]:9.3f} {e.p50_ms[64]:10.3f}"
            )
    ratio = sparse[0].p50_ms[1] / dense[0].p50_ms[1]
    figures = {"sact": rows, "dense_sact": [asdict(d) for d in dense], "plain": asdict(plain),
               **{name: [asdict(e) for e in steps] for name, steps in exits.items()},
               "budget": base.to_dict(), "families": FAMILIES}  # fmt: skip
    if args.json:
        _plot(rows, exits, plain, Path(args.json).with_suffix(""))
    return report("sact_cifar10", args, figures, ratio, "none (< 1: sparse execution saves time)", None)


def _pct(value: float | None) -> str:
    return "outside" if value is None else f"{100 * value:.2f}%"


def _plot(rows: list[dict], exits: dict[str, list[Step]], plain: Step, stem: Path) -> None:
    from matplotlib.figure import Figure

    from anytime.plotting import save_figure

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    by_flops, by_time = fig.subplots(1, 2)
    for ax, per_flops in ((by_flops, True), (by_time, False)):

        def x(step: Step) -> float:
            return step.flops / 1e6 if per_flops else step.p50_ms[1]

        sact_x = [r["flops"] / 1e6 if per_flops else min(r["p50_ms_sparse"][1], r["p50_ms_dense"][1]) for r in rows]
        ax.plot(sact_x, [100 * r["test_acc"] for r in rows], "o-", label="SACT (thresholds)")
        for name, steps in exits.items():
            ax.plot([x(e) for e in steps], [100 * e.test_acc for e in steps], "s-", label=f"early exits ({name})")
        ax.plot([x(plain)], [100 * plain.test_acc], "k*", markersize=10, label="plain ResNet")
        ax.set_xlabel("FLOPs per image (millions)" if per_flops else "p50 latency at batch 1 (ms)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SACT ResNet vs the same ResNet with exits, one budget", fontsize=10)
    save_figure(fig, stem, formats=("png", "svg"))


if __name__ == "__main__":
    run(main)
