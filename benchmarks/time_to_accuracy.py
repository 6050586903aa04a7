"""Benchmark: accuracy against wall-clock training time, the fast CIFAR-10 recipe against the ResNet-32 card.

Both runs are read from their run folders (``metrics.csv``: validation accuracy and elapsed seconds after every
epoch, validation included; ``summary.json``: the test accuracy at the end). A training run takes from minutes to
over an hour on 2 cores, so the runs are trained once (``anytime train --card models/cifar10-fastcnn.toml`` and
``--card models/cifar10-resnet32-exits.toml``) and this benchmark refuses runs from different machines, whose
times would not compare. Ratio: the seconds the ResNet-32 run took to reach its best validation accuracy, over
the seconds the fast run took to reach that same accuracy. Target of the fast recipe: at least 93% test
accuracy within 60 minutes of training on this machine. Writes ``time_to_accuracy.png`` beside ``--json``
(or in results/bench).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import REPO, parser, report, run

from anytime.errors import AnytimeError
from anytime.utils.io import read_csv

TARGET_ACC = 0.93
TARGET_S = 3600.0
THRESHOLDS = (0.80, 0.85, 0.90, 0.93)  # validation accuracies whose time to reach is reported


def _curve(run_dir: Path) -> tuple[list[float], list[float], dict[str, Any], dict[str, Any]]:
    """(elapsed seconds, validation accuracy) after each epoch, the summary and the config of a finished run."""
    try:
        rows = read_csv(run_dir / "metrics.csv")
        summary = json.loads((run_dir / "summary.json").read_text())
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AnytimeError(f"{run_dir} is not a finished run ({exc}); train it with its card first") from None
    return [float(r["elapsed_s"]) for r in rows], [float(r["val_acc"]) for r in rows], summary, config


def _time_to(elapsed: list[float], accuracy: list[float], target: float) -> float | None:
    """Seconds until the validation accuracy first reached ``target`` (None if it never did)."""
    return next((t for t, a in zip(elapsed, accuracy) if a >= target), None)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--fast", type=Path, default=REPO / "runs" / "cifar10-fastcnn-24ep", help="the fast recipe's run")
    p.add_argument("--baseline", type=Path, default=REPO / "runs" / "cifar10-resnet32-exits-12ep",
                   help="the ResNet-32 card's run")  # fmt: skip
    args = p.parse_args()
    fast_t, fast_a, fast_s, fast_c = _curve(args.fast)
    base_t, base_a, base_s, base_c = _curve(args.baseline)
    machines = {json.dumps(c.get("machine", {}).get("cpu"), sort_keys=True) for c in (fast_c, base_c)}
    if len(machines) > 1:
        raise AnytimeError(f"{args.fast} and {args.baseline} were trained on different machines; train both here")
    reference = max(base_a)
    base_time = _time_to(base_t, base_a, reference)
    fast_time = _time_to(fast_t, fast_a, reference)
    assert base_time is not None
    for name, (t, a, s) in {"fast": (fast_t, fast_a, fast_s), "baseline": (base_t, base_a, base_s)}.items():
        reached = ", ".join(f"{100 * x:.0f}%: {_fmt(_time_to(t, a, x))}" for x in THRESHOLDS)
        print(f"{name:<9} {s['model']:<10} {len(t)} epochs, {t[-1]:.0f} s, best val {100 * max(a):.2f}%, test "
              f"{100 * s['final']['test_acc']:.2f}%; time to val {reached}")  # fmt: skip
    ratio = base_time / fast_time if fast_time else 0.0
    print(f"to reach the baseline's best validation accuracy ({100 * reference:.2f}%): baseline {base_time:.0f} s, "
          f"fast {_fmt(fast_time)}")  # fmt: skip
    test_acc, total_s = float(fast_s["final"]["test_acc"]), fast_t[-1]
    passed = test_acc >= TARGET_ACC and total_s <= TARGET_S
    out_dir = Path(args.json).parent if args.json else REPO / "results" / "bench"
    figure = _plot(out_dir, {fast_s["model"]: (fast_t, fast_a), base_s["model"]: (base_t, base_a)})
    print(f"fast recipe: test {100 * test_acc:.2f}% after {total_s / 60:.1f} min (target >= {100 * TARGET_ACC:.0f}% "
          f"within {TARGET_S / 60:.0f} min); figure {figure}")  # fmt: skip
    figures = {
        "fast": {"run": str(args.fast), "elapsed_s": fast_t, "val_acc": fast_a, "test_acc": test_acc,
                 "test_acc_tta": fast_s["final"].get("test_acc_tta"), "total_s": total_s},
        "baseline": {"run": str(args.baseline), "elapsed_s": base_t, "val_acc": base_a,
                     "test_acc": base_s["final"]["test_acc"], "total_s": base_t[-1]},
        "reference_val_acc": reference, "baseline_time_s": base_time, "fast_time_s": fast_time,
        "time_to": {name: {str(x): _time_to(t, a, x) for x in THRESHOLDS}
                    for name, (t, a) in {"fast": (fast_t, fast_a), "baseline": (base_t, base_a)}.items()},
    }  # fmt: skip
    return report("time_to_accuracy", args, figures, ratio,
                  f"fast run >= {100 * TARGET_ACC:.0f}% test within {TARGET_S:.0f} s", passed)  # fmt: skip


def _fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.0f} s"


def _plot(out_dir: Path, curves: dict[str, tuple[list[float], list[float]]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from anytime.utils.io import atomic_path

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (elapsed, accuracy) in curves.items():
        ax.plot([t / 60 for t in elapsed], [100 * a for a in accuracy], marker="o", markersize=3, label=name)
    ax.axhline(100 * TARGET_ACC, color="grey", linestyle=":", linewidth=1)
    ax.axvline(TARGET_S / 60, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="training time on this machine (min, validation included)", ylabel="validation accuracy (%)",
           title="CIFAR-10: accuracy against training time")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "time_to_accuracy.png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    run(main)
