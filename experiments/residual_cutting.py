"""Study: residual-link cutting and block skipping in trained ResNets, and three families of anytime steps
(early exits, width slices, block-drop ladders) compared on measured latency, on the real CIFAR-10 images.

Part 1 reproduces the residual-cutting characterisation (Veit et al. 2016; the user's notes report ResNet-18
at 95.5% -> 95.0% and ResNet-50 at 95.9% -> 35.5% on CIFAR-10 when the links of the higher layers are cut).
Two CIFAR-sized nets stand in for the two designs: ResNet-20 (basic blocks, as ResNet-18) and ResNet-29 of
bottlenecks (as ResNet-50). Each is trained plainly and with stochastic depth, then every block is cut alone
and cumulatively from the top, both kinds (shortcut cut; branch skipped), with and without recomputed
batch-norm statistics. The training budget is what 2 CPU cores allow (see the hyper-parameters; ResNet-20
reaches about 82%): below the 95% regime of the notes, so the absolute accuracies are not comparable with
theirs, only the shapes.

Part 2 puts the steps of three families built on ResNet-20 side by side, at the same training budget:
early exits (4 exits and the last), a width-sliced ResNet-20 (widths 0.25-1.0, sandwich rule, distillation
from the widest slice) and the block-drop ladder of the plain and the stochastic-depth ResNet-20 (no training of its
own). Every step of every family is timed at batch 1 on this machine in alternating turns (so a VM's drift in speed
moves them alike), in three fresh processes whose timings are pooled, and every step's test accuracy is plotted
against its mean latency.

Run: `anytime experiment residual-cutting [--quick] [--out DIR] [--overwrite]` (full: about 110 minutes of training
and 30 of measurement on 2 AMX Xeon cores with bf16 autocast, reusing finished runs in runs/study; --quick trains on
1,000 images for one epoch).
Writes: cut-<run>.csv, families.csv, results.json, config.json, cut.png/.svg, families.png/.svg.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from anytime.data import load_dataset
from anytime.errors import AnytimeError
from anytime.plotting.cut import plot_cut_study, plot_step_families
from anytime.tasks.compare import StepPoint, matched_table, measured_side_by_side
from anytime.tasks.cut import CutSettings, cut_study, make_ladder_run
from anytime.train import TrainConfig, Trainer
from anytime.utils.io import write_csv, write_json
from anytime.utils.machine import bf16_emulated, device_label, resolve_device
from anytime.utils.outputs import staged_dir
from anytime.utils.progress import StudyProgress
from anytime.utils.results import study_output, study_parser, write_study_config

# ---- hyper-parameters -------------------------------------------------------------------------------
LIMIT_TRAIN = None  # training images (None: all 45,000 left after 5,000 are held out for validation)
EPOCHS = 10  # per run, cosine schedule
AMP = "auto"  # bf16 autocast of training's forward where the CPU has bfloat16 instructions (AVX-512, AMX), else off
CHANNELS_LAST = True  # train in channels-last memory (training steps 1.1-1.5x faster on 2 Xeon cores, bf16 or not)
BATCH_SIZE = 128  # images per mini-batch
LR = 0.05  # SGD learning rate (momentum 0.9, weight decay 5e-4)
SEED = 0
STOCHASTIC_DEPTH = 0.5  # chance that the last block skips its branch in training (linear in depth)
CUT_MODELS = {"resnet20": "basic blocks (ResNet-18's design)", "resnet29_bottleneck": "bottlenecks (ResNet-50's)"}
EXITS = "0.15,0.35,0.55,0.75"  # exit points, fractions of ResNet-20's FLOPs
SLICES = "0.25,0.5,0.75,1.0"  # widths of the sliced ResNet-20
EVAL_IMAGES = 2_000  # test images scored per cut configuration (of 10,000, seeded random): +-1.7 points at 80%
RECALIBRATE_BN = True  # also score every cut after recomputing batch-norm statistics
RECALIBRATION_BATCHES = 10  # training batches of 128 for those statistics
CUT_LATENCY_REPEATS = 30  # batch-1 timings per cut configuration
PROFILE_REPEATS = 300  # batch-1 timings per step for the families, every step of every family in alternating turns
PROFILE_TURN = 10  # images each step answers in a row per turn (its caches warm, as in a process serving it alone)
PROFILE_PROCESSES = 3  # fresh processes, each timing every step PROFILE_REPEATS times; their timings pooled
BUDGETS_MS = 12  # latency budgets compared, spread over the families' range
RUNS = "runs/study"  # trained runs are kept here and reused (training is the expensive part)
QUICK = {"LIMIT_TRAIN": 1_000, "EPOCHS": 1, "EVAL_IMAGES": 300, "CUT_LATENCY_REPEATS": 5, "PROFILE_REPEATS": 20,
         "PROFILE_PROCESSES": 1, "RUNS": "runs/study-quick"}  # fmt: skip
# ------------------------------------------------------------------------------------------------------


def recipes(limit: int | None, epochs: int, amp: str) -> dict[str, TrainConfig]:
    """Every trained run of the study, by name."""
    base = TrainConfig(data="cifar10", limit_train=limit, epochs=epochs, batch_size=BATCH_SIZE, lr=LR, seed=SEED,
                       amp=amp, channels_last=CHANNELS_LAST)  # fmt: skip
    runs: dict[str, TrainConfig] = {}
    for model in CUT_MODELS:
        runs[model] = base.replace(model=model)
        runs[f"{model}-sd"] = base.replace(model=model, stochastic_depth=STOCHASTIC_DEPTH)
    runs["resnet20-exits"] = base.replace(model="resnet20", exits=EXITS)
    runs["resnet20-sliced"] = base.replace(model="resnet20", slices=SLICES, sandwich=True, distill=1.0)
    return runs


def training_amp() -> str:
    """``AMP`` for this machine: ``auto`` is bf16 where the CPU computes in bfloat16, off where it would emulate it."""
    if AMP != "auto":
        return AMP
    return "off" if bf16_emulated(resolve_device("cpu")) else "bf16"


def ensure_run(config: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """The run's summary: trained now, resumed if interrupted, or reused if finished with the same recipe."""
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        saved = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text())["train"]).to_dict()
        wanted = config.to_dict()
        differing = [k for k in wanted if k not in TrainConfig.RUNTIME_FIELDS and saved.get(k) != wanted[k]]
        if not differing:
            return json.loads(summary_path.read_text())
        raise AnytimeError(f"{run_dir} was trained with other settings ({', '.join(differing)}); move it away first")
    return Trainer(config, run_dir).fit(resume=(run_dir / "checkpoint.pt").is_file()).to_dict()


def family_points(runs: Path, repeats: int, processes: int) -> dict[str, list[StepPoint]]:
    """Every step of the exits, the sliced net and both block-drop ladders timed at batch 1, side by side."""
    sources = {"early exits": runs / "resnet20-exits", "width slices": runs / "resnet20-sliced"}
    for name, label in (("resnet20", "block drops"), ("resnet20-sd", "block drops, stochastic depth")):
        ladder = runs / f"{name}-ladder"
        if not (ladder / "summary.json").is_file():
            make_ladder_run(runs / name, ladder)
        sources[label] = ladder
    return measured_side_by_side(sources, repeats=repeats, warmup=10, turn=PROFILE_TURN, seed=SEED, processes=processes)


def budgets(points: dict[str, list[StepPoint]], count: int) -> list[float]:
    """``count`` latency budgets from the cheapest step of any family to the dearest."""
    low = min(p.mean_ms for ps in points.values() for p in ps)
    high = max(p.mean_ms for ps in points.values() for p in ps)
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    args = study_parser("residual-cutting", __doc__.splitlines()[0]).parse_args(argv)
    out_dir, create_parents = study_output(args, "residual-cutting")
    hyper = {k: QUICK.get(k, v) if args.quick else v for k, v in {
        "LIMIT_TRAIN": LIMIT_TRAIN, "EPOCHS": EPOCHS, "EVAL_IMAGES": EVAL_IMAGES,
        "CUT_LATENCY_REPEATS": CUT_LATENCY_REPEATS, "PROFILE_REPEATS": PROFILE_REPEATS,
        "PROFILE_PROCESSES": PROFILE_PROCESSES, "RUNS": RUNS}.items()}  # fmt: skip
    runs = Path(hyper["RUNS"])
    splits = load_dataset("cifar10", seed=SEED, limit_train=hyper["LIMIT_TRAIN"])  # a clear error without the images

    # 1. Train (or reuse) every run.
    summaries = {}
    amp = training_amp()
    to_train = recipes(hyper["LIMIT_TRAIN"], hyper["EPOCHS"], amp)
    progress = StudyProgress(len(to_train) + 2 * len(CUT_MODELS) + 1, "residual-cutting", unit="part")
    for name, config in to_train.items():
        summaries[name] = ensure_run(config, runs / name)
        progress.done(f"{name:<26} test {100 * summaries[name]['final']['test_acc']:.2f}%  "
                      f"({summaries[name]['train_time_s'] / 60:.1f} min of training)")  # fmt: skip

    with progress, staged_dir(out_dir, "residual-cutting study", overwrite=args.overwrite,
                              create_parents=create_parents) as out:  # fmt: skip
        # 2. The cutting study on the plain and the stochastic-depth nets.
        studies: dict[str, list[dict[str, Any]]] = {}
        (out / "cut").mkdir()
        settings = CutSettings(recalibrate_bn=RECALIBRATE_BN, images=hyper["EVAL_IMAGES"],
                               recalibration_batches=RECALIBRATION_BATCHES,
                               latency_repeats=hyper["CUT_LATENCY_REPEATS"])  # fmt: skip
        for model, design in CUT_MODELS.items():
            for name in (model, f"{model}-sd"):
                study = cut_study(runs / name, settings, out=out / "cut" / name,
                                  progress=lambda line, name=name: progress.say(f"  {name}: {line}"),
                                  bar=sys.stderr.isatty())  # fmt: skip
                studies[name] = study.rows
                write_csv(out / f"cut-{name}.csv", study.rows)
                whole = study.rows[0]["accuracy"]
                top = [r for r in study.rows if r["config"] == "shortcut:top2"]
                progress.done(f"{name:<26} ({design}) whole {100 * whole:.1f}%, links of the top 2 blocks cut "
                              f"{100 * top[0]['accuracy']:.1f}%")  # fmt: skip
        images = f"{hyper['LIMIT_TRAIN']:,}" if hyper["LIMIT_TRAIN"] else "all 45,000"
        title = f"CIFAR-10 test ({hyper['EVAL_IMAGES']:,} images), {hyper['EPOCHS']} epochs on {images} images"
        plot_cut_study(studies, out / "cut", title=title)

        # 3. The families of steps on measured latency.
        points = family_points(runs, hyper["PROFILE_REPEATS"], hyper["PROFILE_PROCESSES"])
        progress.done()
        table = matched_table(points, budgets(points, BUDGETS_MS))
        write_csv(out / "families.csv", [p.to_dict() for ps in points.values() for p in ps])
        write_csv(out / "matched.csv", table)
        device = device_label(resolve_device("cpu"))
        plot_step_families(points, out / "families", budgets=table,
                           title=f"ResNet-20 families on CIFAR-10, batch 1 on {device}")  # fmt: skip
        write_json(out / "results.json", {
            "runs": {name: {"test_acc": s["final"]["test_acc"], "val_acc": s["final"]["val_acc"],
                            "train_time_s": s["train_time_s"], "run_dir": str(runs / name)} for name, s in summaries.items()},
            "cut": studies, "families": {k: [p.to_dict() for p in ps] for k, ps in points.items()}, "matched": table,
        })  # fmt: skip
        write_study_config(out, study="residual-cutting", hyper={
            **hyper, "amp": amp, "channels_last": CHANNELS_LAST, "batch_size": BATCH_SIZE, "lr": LR, "seed": SEED,
            "stochastic_depth": STOCHASTIC_DEPTH, "exits": EXITS, "slices": SLICES, "recalibrate_bn": RECALIBRATE_BN,
            "recalibration_batches": RECALIBRATION_BATCHES, "profile_turn": PROFILE_TURN, "quick": args.quick},
            data_path=splits.info.source)  # fmt: skip
    print(f"results in {out_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
