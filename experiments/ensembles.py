"""Study: heterogeneous ensembles as anytime ladders, fp32 and int8, beside their members and an early-exit ladder.

For trained CIFAR-10 runs of different architectures (and their int8 forms, `anytime quantize`), it builds the
fp32 and the int8 ensemble (`anytime ensemble`: cost order, every fuser fit on validation, cross-fitted), profiles
both ladders, every member alone and the multi-exit member's own exits at batch 1 on this machine, and reports each
option's test accuracy against its p99 latency: every member alone, every fuser at every prefix, the int8 ensemble
vs the fp32 ensemble, scikit-learn's cross-check (a LogisticRegression stacking the members' log-probabilities),
and the early-exit ladder of the same machine at matched latency. Without the CIFAR-10 runs
(or with --quick) it trains small digits members first (a smoke test, not figures).

Run: `anytime experiment ensembles [--quick] [--out DIR] [--overwrite]` (full: about 15 minutes on 2 CPU cores with
the members trained). Writes: results.csv, results.json, config.json, ensembles.png/.svg, and the two ensemble runs
(runs/fp32, runs/int8) with their profiles.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from anytime.errors import AnytimeError
from anytime.families import FUSERS
from anytime.plotting.ensembles import plot_ensemble_study
from anytime.precision.tuning import Int8Settings
from anytime.tasks.ensemble import EnsembleSettings, build_ensemble
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.tasks.quantize import quantize_run
from anytime.train import TrainConfig, Trainer
from anytime.utils.io import write_csv, write_json
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
# float runs, trained on a lent H200 (docs/benchmarks-archive.md, 2026-11-27)
MEMBERS = ("runs/cifar10-resnet20-30ep", "runs/cifar10-resnet32-exits-16ep", "runs/cifar10-vgg11-30ep",
           "runs/cifar10-resnet18-12ep")  # fmt: skip
EXIT_RUN = "runs/cifar10-resnet32-exits-16ep"  # the early-exit ladder compared at matched latency
QUICK_MEMBERS = {"lenet": None, "resnet20": "auto"}  # digits members trained in quick mode: model -> exits
QUICK_EPOCHS = 3
FOLDS = 5  # cross-fitting folds of the validation split
REPEATS = 200  # batch-1 timings per step (p99 needs at least 100)
QUANTILE = 0.99
# ------------------------------------------------------------------------------------------------------


def _test_acc(run_dir: Path) -> list[float]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return (
        [float(e["test_acc"]) for e in summary["exits"]]
        if "exits" in summary
        else [float(summary["final"]["test_acc"])]
    )


def _p99(profile) -> list[float]:  # type: ignore[no-untyped-def]
    return [float(np.quantile(s, QUANTILE)) for s in profile.at(1).steps]


def _quick_members(folder: Path) -> tuple[list[Path], Path]:
    runs = []
    for model, exits in QUICK_MEMBERS.items():
        run_dir = folder / model
        Trainer(TrainConfig(model=model, data="digits", epochs=QUICK_EPOCHS, batch_size=64, lr=0.05, exits=exits,
                            device="cpu"), run_dir).fit()  # fmt: skip
        runs.append(run_dir)
    return runs, runs[1]


def main(argv: list[str] | None = None) -> int:
    args = study_parser("ensembles", __doc__.splitlines()[0]).parse_args(argv)
    out_dir, create_parents = study_output(args, "ensembles")
    members, exit_run = [Path(m) for m in MEMBERS], Path(EXIT_RUN)
    quick = args.quick or not all(m.is_dir() for m in members)
    if quick and not args.quick:
        print(
            f"member runs not found ({', '.join(str(m) for m in members if not m.is_dir())}): the quick study on digits"
        )
    repeats = 100 if quick else REPEATS
    rows: list[dict[str, object]] = []
    with (staged_dir(out_dir, "ensembles study", overwrite=args.overwrite, create_parents=create_parents) as out,
          StudyProgress(3, "ensembles", unit="part") as progress):  # fmt: skip
        (out / "runs").mkdir()
        (out / "profiles").mkdir()
        if quick:
            members, exit_run = _quick_members(out / "members")
        for member in members:
            quantized = member.with_name(f"{member.name}-int8")
            if not quantized.is_dir():  # quantized beside the float run in quick mode, or refused below
                if not quick:
                    raise AnytimeError(
                        f"{quantized} is missing; make it with `anytime quantize {member} --precision int8`"
                    )
                quantize_run(member, "int8", int8=Int8Settings(calibration_images=128))
        for precision in ("fp32", "int8"):
            runs = members if precision == "fp32" else [m.with_name(f"{m.name}-int8") for m in members]
            ensemble = out / "runs" / precision
            progress.say(f"{precision} ensemble of {', '.join(r.name for r in runs)}...")
            report = build_ensemble(runs, ensemble, EnsembleSettings(folds=FOLDS))
            profile, _ = profile_run(ensemble, ProfileSettings(batch_sizes=(1,), repeats=repeats, memory=False))
            latency = _p99(profile)
            for kind in FUSERS:
                for k, acc in enumerate(report.test_acc[kind]):
                    rows.append({"kind": f"ensemble {kind}", "precision": precision, "step": profile.step_names[k],
                                 "p99_ms": latency[k], "test_acc": acc, "val_acc": report.val_acc[kind][k]})  # fmt: skip
            if report.stacking is not None:  # scikit-learn's fuser, all members: about the cost of the last step
                rows.append({"kind": "sklearn stacking", "precision": precision, "step": profile.step_names[-1],
                             "p99_ms": latency[-1], "test_acc": report.stacking[1], "val_acc": report.stacking[0]})  # fmt: skip
            for member in report.members:
                alone, _ = profile_run(
                    member.run,
                    ProfileSettings(batch_sizes=(1,), repeats=repeats, memory=False),
                    out=out / "profiles" / f"{Path(member.run).name}.json",
                )
                rows.append({"kind": "member alone", "precision": precision, "step": member.name,
                             "p99_ms": _p99(alone)[-1], "test_acc": member.test_acc, "val_acc": member.val_acc})  # fmt: skip
            progress.done()
        exits, _ = profile_run(
            exit_run,
            ProfileSettings(batch_sizes=(1,), repeats=repeats, memory=False),
            out=out / "profiles" / "exits.json",
        )
        for name, latency_ms, acc in zip(exits.step_names, _p99(exits), _test_acc(exit_run)):
            rows.append({"kind": "early exits", "precision": "fp32", "step": f"{exit_run.name} {name}",
                         "p99_ms": latency_ms, "test_acc": acc, "val_acc": None})  # fmt: skip
        progress.done()
        for row in rows:
            progress.say(f"{row['kind']:<18} {row['precision']:<5} {row['step']:<34} p99 {row['p99_ms']:8.3f} ms  "
                         f"test {100 * float(row['test_acc']):6.2f}%")  # type: ignore[arg-type]  # fmt: skip
        write_csv(out / "results.csv", rows)
        write_json(out / "results.json", rows)
        plot_ensemble_study(
            rows, out / "ensembles", title=f"ensembles vs members and exits (batch 1, p{int(100 * QUANTILE)})"
        )
        write_study_config(
            out, study="ensembles",
            hyper={"members": [str(m) for m in members], "exit_run": str(exit_run), "folds": FOLDS, "repeats": repeats,
                   "quantile": QUANTILE, "quick": quick},
            notes=["accuracy: test split; fusers fit on validation (cross-fitted); latency: batch 1, this machine",
                   "members alone are profiled from their own runs into profiles/ (their folders are not written)"],
        )  # fmt: skip
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
