"""``anytime <command>``: the only module that parses arguments and prints."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from anytime.commands.options import (
    DEVICE_HELP,
    FIGURE_SIZE_HELP,
    THREADS_HELP,
    add_float_layers,
    add_split_plan,
    finite_float,
    int_at_least,
    non_negative_int,
    positive_int,
    threads,
)
from anytime.commands.output import print_json, print_policy_figures, progress_printer
from anytime.errors import AnytimeError, PeerStopped
from anytime.utils.figure_sizes import FIGURE_SIZES

COMMANDS: dict[str, str] = {
    "models": "list the model zoo and torchvision classifiers, with parameter counts",
    "train": "train a model (or a model card), plain or with early exits; record time, memory and accuracy",
    "exits": "show the exits attach_exits puts on a model, with cumulative FLOPs and parameters",
    "collect": "run a trained multi-exit model once over a split and cache every exit's logits",
    "sweep": "sweep exit thresholds over the cached outputs: accuracy, FLOPs, exit shares, Pareto front",
    "calibrate": "fit exit thresholds on validation for an accuracy drop or a FLOPs budget (RUN/calibration.json)",
    "evaluate": "real early exit on a split: accuracy, exit shares, latency per sample vs the plain backbone",
    "plot": "plot a multi-exit run: accuracy vs cost, vs threshold, exit histogram, per-exit accuracy, deadlines",
    "cam": "class activation maps of every step (CAM for global-pooled heads, Grad-CAM otherwise) for the same images: "
    "a figure side by side and the arrays",
    "ponder": "maps of the residual units a SACT run spends at every position of an image, at each halting threshold",
    "profile": "measure every step's latency (p50/p90/p99), FLOPs and memory on this device, or compare two profiles",
    "schedule": "the most accurate step or early-exit policy that meets a deadline on a profiled device (JSON)",
    "cut": "cut residual links or skip blocks of a trained ResNet: accuracy and latency (CSV, plots), or a ladder run",
    "quantize": "a run's steps at another precision (int8, int8-dynamic, bf16, fp16), as a run the pipeline takes",
    "export": "deployable artifacts of a run's steps (torch.export .pt2 or ONNX), a manifest and the parity table",
    "ensemble": "an ensemble of trained runs (any architecture, any precision) fused after each member, as a run",
    "ensemble-baseline": "torchensemble's fusion, voting, bagging, gradient boosting or snapshot ensemble, as a run",
    "ticket": "lottery tickets by iterative magnitude pruning of a dense run, rewound to its epoch K (late "
    "resetting): one ordinary run per round",
    "seeds": "several seeds of one recipe: every step's validation and test accuracy as mean, spread and range",
    "jobs": "a sweep of training runs (a grid or a list in TOML) on local joblib workers or SLURM job arrays "
    "(submitit): resumable, one run folder per job, results table and plot",
    "report": "one self-contained HTML page of a run (RUN/report.html): recipe, curves, steps, calibration, latency",
    "serve": "serve a run over HTTP: POST /predict answers within each request's deadline (queue time counted); "
    "--role server finishes split-computing requests over TCP",
    "split": "split computing: the partition point, codec and exit thresholds that answer most accurately within a "
    "deadline over a link, from the device's and the server's profiles (JSON)",
    "split-run": "the device's half of split computing: answer images, sending activations to a --role server over "
    "a shaped link, and measure end-to-end time, misses and accuracy",
    "experiment": "run a study from experiments/ (batch-time, memory, time-accuracy, residual-cutting, precision, "
    "ensemble-baselines, ensembles, lottery)",
    "demo": "the whole multi-exit pipeline on the embedded digits, and where training time goes (no files needed)",
    "prepare-data": "pack an image folder into shards of resized uint8 images (resumable, parallel) that training "
    "reads batch by batch (--data shards)",
}


def _experiments_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "experiments"


def _experiment_names() -> list[str]:
    folder = _experiments_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem.replace("_", "-") for p in folder.glob("*.py") if not p.name.startswith("_"))


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, like every other error, pointing at the command's help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help: appended where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default {action.default})"


def _module(verb: str) -> Any:
    return importlib.import_module("anytime.commands." + verb.replace("-", "_"))


def _add_command(sub: Any, verb: str) -> None:
    module = _module(verb)
    module.add_arguments(sub.add_parser(verb, description=module.SUMMARY))


def _moved(verb: str) -> Callable[[argparse.Namespace], int]:
    return lambda args: _module(verb).run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (exposed for tests and documentation)."""
    parser = _Parser(
        prog="anytime",
        description="Anytime inference research in PyTorch: train, measure and schedule models on a device.",
        formatter_class=_Formatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<18} {text}" for name, text in COMMANDS.items())
        + "\n\nrun 'anytime COMMAND --help' for a command's options",
    )
    from anytime import __version__

    parser.add_argument("--version", action="version", version=f"anytime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands below")

    _add_command(sub, "models")

    _add_command(sub, "train")

    _add_command(sub, "exits")

    _add_command(sub, "collect")

    _add_command(sub, "sweep")

    _add_command(sub, "calibrate")

    _add_command(sub, "evaluate")

    _add_command(sub, "plot")

    _add_command(sub, "cam")

    _add_command(sub, "ponder")

    _add_command(sub, "profile")

    _add_command(sub, "schedule")

    cut = sub.add_parser("cut", description=COMMANDS["cut"])
    cut.add_argument("run", metavar="RUN", help="a finished run of a plain ResNet (resnet20, resnet18, tv:resnet50...)")
    cut.add_argument(
        "--kind",
        choices=["shortcut", "branch", "both"],
        help="shortcut: cut the link (the block keeps its branch); branch: skip the branch (the block "
        "keeps its shortcut); default both",
    )
    cut.add_argument(
        "--recalibrate-bn",
        action="store_true",
        help="also measure each cut after recomputing the batch-norm statistics on training images",
    )
    cut.add_argument(
        "--finetune-epochs",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also measure each cut after N epochs of fine-tuning it (slow: one fine-tune per cut)",
    )
    cut.add_argument("--split", choices=["val", "test"], help="where the study scores each cut (default test)")
    cut.add_argument(
        "--images", type=positive_int, metavar="N", help="evaluate on N images of the split, drawn at random (seeded)"
    )
    cut.add_argument("--repeats", type=positive_int, metavar="N", help="batch-1 timings per configuration (default 30)")
    cut.add_argument("--device", default="auto", help=DEVICE_HELP)
    cut.add_argument(
        "--ladder",
        action="store_true",
        help="instead of the study, write --out: a run whose steps are the cumulative block-drop ladder",
    )
    cut.add_argument(
        "--out", metavar="DIR", help="the ladder run (with --ladder), or the study's folder (default RUN/cut)"
    )
    cut.add_argument("--overwrite", action="store_true", help="replace an earlier study (or ladder run) in --out")
    cut.add_argument(
        "--json", action="store_true", help="print the study's files (or the ladder run's summary) as JSON"
    )

    quantize = sub.add_parser("quantize", description=COMMANDS["quantize"])
    quantize.add_argument("run", metavar="RUN", help="a finished float run (exits, slices, a ladder or a plain model)")
    quantize.add_argument(
        "--precision",
        required=True,
        choices=["int8", "int8-dynamic", "bf16", "fp16"],
        help="int8: PT2E static, X86InductorQuantizer, each stage and exit head a graph of its own; "
        "int8-dynamic: Linear layers (torchao); bf16/fp16: casts (fp16 on CUDA)",
    )
    quantize.add_argument(
        "--calibration-images",
        type=positive_int,
        default=512,
        metavar="N",
        help="int8: training images that calibrate the activations (default 512; never validation or test)",
    )
    quantize.add_argument(
        "--qat-epochs",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="int8: then N epochs of quantization-aware training (PT2E QAT) on the training split; "
        "the summary shows every step after PTQ and after QAT",
    )
    quantize.add_argument(
        "--qat-lr",
        type=finite_float,
        default=1e-3,
        metavar="LR",
        help="QAT's initial learning rate (SGD, cosine; default 0.001)",
    )
    add_float_layers(quantize, "int8", "artifact (.pt2, as `anytime export` writes it)")
    quantize.add_argument(
        "--no-compile",
        action="store_true",
        help="keep the converted graphs eager (reference arithmetic: same values, not int8 speed)",
    )
    quantize.add_argument("--device", default="auto", help=DEVICE_HELP)
    quantize.add_argument("--out", metavar="DIR", help="the new run (default RUN-PRECISION beside RUN)")
    quantize.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    quantize.add_argument("--json", action="store_true", help="print the new run's summary as JSON")

    export = sub.add_parser("export", description=COMMANDS["export"])
    export.add_argument("run", metavar="RUN", help="a finished run: float, or converted by 'anytime quantize'")
    export.add_argument(
        "--format",
        required=True,
        choices=["pt2", "onnx"],
        help="pt2: torch.export programs (fp32, int8 PT2E, bf16, fp16); onnx: ONNX graphs for ONNX Runtime or "
        "TensorRT (fp32, int8 QDQ by ONNX Runtime's quantize_static; needs anytime[deploy])",
    )
    export.add_argument(
        "--precision", choices=["fp32", "int8", "bf16", "fp16"], help="default: the run's own (fp32 for a float run)"
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the export folder (new or empty)")
    export.add_argument(
        "--calibration-images",
        type=positive_int,
        default=512,
        metavar="N",
        help="int8 from a float run: training images that calibrate it (default 512)",
    )
    add_float_layers(export, "int8 from a float run (a quantized run keeps its own)", "artifact")
    export.add_argument(
        "--parity-images",
        type=int_at_least(0),
        default=1000,
        metavar="N",
        help="test images the parity table compares on (default 1000; 0: no table)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    export.add_argument("--json", action="store_true", help="print the manifest and the parity table as JSON")

    ensemble = sub.add_parser("ensemble", description=COMMANDS["ensemble"])
    ensemble.add_argument(
        "--members",
        required=True,
        metavar="RUN,RUN,...",
        help="finished runs trained on the same data and split (a multi-exit run answers with its "
        "last exit; a quantized run at its precision)",
    )
    ensemble.add_argument(
        "--order",
        choices=["cost", "greedy", "given"],
        default="cost",
        help="cost: cheapest first (batch-1 latency, from the members' profiles or measured); greedy: "
        "most validation accuracy per millisecond first; given: as listed (default cost)",
    )
    ensemble.add_argument(
        "--fuser",
        choices=["mlp", "mean", "vote", "weighted"],
        default="mlp",
        help="the fuser the run deploys (all four are fit and reported; default mlp)",
    )
    ensemble.add_argument(
        "--folds",
        type=int_at_least(2),
        default=5,
        metavar="K",
        help="cross-fitting folds of the validation split (default 5)",
    )
    ensemble.add_argument(
        "--fit-split",
        default="val",
        metavar="SPLIT",
        help="where fusers are fit: the validation split, held out of every member (the only choice)",
    )
    ensemble.add_argument(
        "--hidden", type=positive_int, default=32, metavar="N", help="the MLP fuser's hidden units (default 32)"
    )
    ensemble.add_argument("--device", default="auto", help=DEVICE_HELP)
    ensemble.add_argument("--out", required=True, metavar="DIR", help="the ensemble run (a new or empty folder)")
    ensemble.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    ensemble.add_argument("--json", action="store_true", help="print the ensemble's report as JSON")

    baseline = sub.add_parser("ensemble-baseline", description=COMMANDS["ensemble-baseline"])
    baseline.add_argument(
        "--method", required=True, choices=["fusion", "voting", "bagging", "gradient-boosting", "snapshot"]
    )
    baseline.add_argument("--model", required=True, help="the members' zoo model (each member a fresh copy)")
    baseline.add_argument("--estimators", required=True, type=positive_int, metavar="N", help="members")
    baseline.add_argument(
        "--epochs",
        required=True,
        type=positive_int,
        metavar="E",
        help="training epochs (snapshot: a multiple of --estimators)",
    )
    baseline.add_argument("--data", choices=["digits", "cifar10", "cifar100", "folder", "synthetic"], default="digits")
    baseline.add_argument("--data-root", metavar="PATH", help="dataset folder (as for train)")
    baseline.add_argument("--limit-train", type=positive_int, metavar="N", help="train on N images only")
    baseline.add_argument("--batch-size", type=positive_int, default=128, metavar="B")
    baseline.add_argument(
        "--lr", type=finite_float, default=0.05, metavar="LR", help="SGD learning rate (default 0.05)"
    )
    baseline.add_argument("--seed", type=non_negative_int, default=0, metavar="S")
    baseline.add_argument(
        "--shrinkage",
        type=finite_float,
        default=1.0,
        metavar="R",
        help="gradient boosting's shrinkage rate (default 1)",
    )
    baseline.add_argument("--device", default="auto", help=DEVICE_HELP + " (never torchensemble's own cuda=True)")
    baseline.add_argument("--out", required=True, metavar="DIR", help="the run (a new or empty folder)")
    baseline.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    baseline.add_argument("--json", action="store_true", help="print the baseline's report as JSON")

    jobs = sub.add_parser("jobs", description=COMMANDS["jobs"])
    jobs.add_argument(
        "sweep", metavar="SWEEP.toml", help="[base] recipe (or card = NAME), then [grid] lists or [[job]] tables"
    )
    jobs.add_argument(
        "--backend",
        choices=["local", "slurm", "submitit-local"],
        default="local",
        help="local: joblib processes on this machine (default); slurm: a job array through submitit "
        "([slurm] table: partition, time_min, gpus_per_job, cpus_per_job, mem_gb, max_parallel); "
        "submitit-local: the slurm path run on this machine",
    )
    jobs.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="jobs at once (local: default 1, the cores shared out as threads; slurm: array tasks at "
        "once, default [slurm] max_parallel, else all)",
    )
    jobs.add_argument(
        "--out", metavar="DIR", help="the sweep's folder, one run folder per job (default runs/sweeps/NAME)"
    )
    jobs.add_argument("--no-plot", action="store_true", help="write the results table only")
    jobs.add_argument("--json", action="store_true", help="print the results table as JSON")

    ticket = sub.add_parser("ticket", description=COMMANDS["ticket"])
    ticket.add_argument("dense", metavar="DENSE_RUN", help="a finished run trained with --keep-checkpoints K")
    ticket.add_argument(
        "--sparsity",
        type=finite_float,
        required=True,
        metavar="S",
        help="share of convolution and linear weights (with --unit channels: of the prunable channels) "
        "pruned at the end, e.g. 0.9",
    )
    ticket.add_argument(
        "--reset-epoch",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="rewind the surviving weights to the dense run's after K epochs (default 0: init)",
    )
    ticket.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="R",
        help="prune in R rounds, each the same share of what is left (default 1: one shot)",
    )
    ticket.add_argument(
        "--scope",
        choices=["global", "layer"],
        default="global",
        help="rank weights over all layers at once (default) or prune each layer alike",
    )
    ticket.add_argument(
        "--unit",
        choices=["weights", "channels"],
        default="weights",
        help="prune single weights (masked, default) or whole channels: a smaller, faster network "
        "(Torch-Pruning's dependency graph; residual streams and classifiers are kept whole)",
    )
    ticket.add_argument("--out", metavar="DIR", help="one run folder per round, DIR/round-R (default DENSE_RUN-ticket)")
    ticket.add_argument("--json", action="store_true", help="print the rounds' results as JSON")

    seeds = sub.add_parser("seeds", description=COMMANDS["seeds"])
    seeds.add_argument("runs", nargs="+", metavar="RUN", help="runs of one recipe trained with different --seed")
    seeds.add_argument("--json", action="store_true", help="print the summary as JSON")

    report = sub.add_parser("report", description=COMMANDS["report"])
    report.add_argument("run", metavar="RUN")
    report.add_argument("--out", metavar="FILE", help="default RUN/report.html (replaced)")
    report.add_argument("--json", action="store_true", help="print the page's path and missing sections as JSON")

    serve = sub.add_parser("serve", description=COMMANDS["serve"])
    serve.add_argument("run", metavar="RUN", help="a finished, profiled run (anytime profile RUN)")
    serve.add_argument(
        "--profile",
        metavar="FILE",
        help="default: the run's only profile-*.json (a text run: every length bucket it has)",
    )
    serve.add_argument(
        "--calibration", metavar="FILE", help="early-exit thresholds (default RUN/calibration.json when there is one)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int_at_least(0), default=8000, help="default 8000")
    serve.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="B",
        help="requests answered together when several are queued (default: the largest profiled batch size, up to 8)",
    )
    serve.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="server processes, each with its own model and queue (default 1)",
    )
    serve.add_argument(
        "--threads",
        type=threads,
        metavar="N|auto",
        help="torch CPU threads per process (default: the profile's; with --workers, cores / workers; "
        + THREADS_HELP
        + ")",
    )
    serve.add_argument("--device", default="auto", help=DEVICE_HELP)
    serve.add_argument(
        "--quantile",
        type=finite_float,
        default=0.99,
        metavar="Q",
        help="the latency quantile a step must fit at before it starts (default 0.99)",
    )
    serve.add_argument(
        "--max-body-kb",
        type=positive_int,
        default=1024,
        metavar="KB",
        help="larger request bodies are refused with 413 (default 1024)",
    )
    serve.add_argument(
        "--role",
        choices=["http", "server"],
        default="http",
        help="http: POST /predict (default); server: split computing's server, finishing the "
        "activations an `anytime split-run` device sends over TCP",
    )

    split = sub.add_parser("split", description=COMMANDS["split"])
    split.add_argument("run", metavar="RUN", help="a run with exits (or an ensemble), validation outputs collected")
    add_split_plan(split)
    split.add_argument("--frontier", action="store_true", help="print every frontier option too")

    split_run = sub.add_parser("split-run", description=COMMANDS["split-run"])
    split_run.add_argument("run", metavar="RUN")
    split_run.add_argument("--server", required=True, metavar="HOST:PORT", help="an `anytime serve RUN --role server`")
    add_split_plan(split_run)
    split_run.add_argument(
        "--split",
        dest="data_split",
        choices=["val", "test"],
        default="test",
        help="images answered, in the split's order (default test)",
    )
    split_run.add_argument(
        "--requests", type=positive_int, default=200, metavar="N", help="images answered (default 200)"
    )
    split_run.add_argument(
        "--shape-bandwidth",
        metavar="MBPS[:N],...",
        help="pace the link at these Mbit/s, each for N requests (e.g. 100:100,1:100); default: "
        "--bandwidth-mbps for every request",
    )
    split_run.add_argument(
        "--shape-delay-ms", type=finite_float, metavar="MS", help="round trip added on the link (default: --rtt-ms)"
    )
    split_run.add_argument(
        "--emulate-slowdown",
        type=finite_float,
        default=1.0,
        metavar="F",
        help="the device is a board F times slower than this machine; its profile must be measured "
        "with the same factor (anytime profile --emulate-slowdown F)",
    )
    split_run.add_argument(
        "--fixed", action="store_true", help="keep the first plan: do not follow the bandwidth the device measures"
    )
    split_run.add_argument(
        "--timeout-ms",
        type=finite_float,
        default=2000.0,
        metavar="MS",
        help="a server that has not answered by then is given up on: the device answers itself (default 2000)",
    )
    split_run.add_argument(
        "--threads", type=threads, default=1, metavar="N|auto", help="torch CPU threads of the device (default 1)"
    )
    split_run.add_argument(
        "--link-samples",
        type=non_negative_int,
        default=100,
        metavar="N",
        help="exchanges with the server that measure the link (bandwidth, and the overhead per "
        "exchange at the quantile) before the first plan (default 100; 0: plan with "
        "--bandwidth-mbps, --rtt-ms and --overhead-ms as given)",
    )
    split_run.add_argument("--out", metavar="FILE", help="also write every answer and the summary as JSON here")

    experiment = sub.add_parser("experiment", description=COMMANDS["experiment"])
    experiment.add_argument("name", metavar="NAME", help="one of: " + ", ".join(_experiment_names()))
    experiment.add_argument("--quick", action="store_true", help="a few minutes on a laptop-class CPU")
    experiment.add_argument("--out", metavar="DIR", help="results folder (default results/NAME)")
    experiment.add_argument("--overwrite", action="store_true", help="replace the study's earlier results in --out")
    experiment.add_argument(
        "--drop-caches",
        action="store_true",
        help="studies that read from disk (batch-time, memory, time-accuracy): drop the OS page "
        "cache first (root; it affects the whole machine)",
    )
    experiment.add_argument("--device", help="studies that time a device (precision): cpu (default) or cuda[:N]")
    experiment.add_argument("--figure-size", default="screen", choices=list(FIGURE_SIZES),
                            help=FIGURE_SIZE_HELP + " (default screen)")  # fmt: skip
    experiment.add_argument(
        "--json", action="store_true", help="print the study's results.json (its progress goes to stderr)"
    )

    demo = sub.add_parser("demo", description=COMMANDS["demo"])
    demo.add_argument("--out", metavar="DIR", help="results folder (default runs/demo)")
    demo.add_argument("--overwrite", action="store_true", help="replace an earlier demo's results in --out")
    demo.add_argument("--json", action="store_true", help="print the demo's demo.json (what the summary shows)")

    prepare = sub.add_parser("prepare-data", description=COMMANDS["prepare-data"])
    prepare.add_argument("src", metavar="SRC", help="an image folder holding train/<class>/* and test/<class>/*")
    prepare.add_argument(
        "--image-size",
        type=positive_int,
        required=True,
        metavar="S",
        help="every image is resized to SxS (PIL bilinear)",
    )
    prepare.add_argument(
        "--out",
        required=True,
        metavar="SHARDS",
        help="the shard folder (new, empty, or an unfinished one of the same arguments to resume)",
    )
    prepare.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="processes decoding shards in parallel (default: the cores, at most 8)",
    )
    prepare.add_argument(
        "--shard-size", type=positive_int, metavar="N", help="images per shard (default: as many as fill 64 MiB)"
    )
    prepare.add_argument(
        "--verify", action="store_true", help="also check the finished shards' checksums and rewrite those that differ"
    )
    prepare.add_argument("--json", action="store_true", help="print the manifest as JSON")
    for command in sub.choices.values():
        command.formatter_class = _Formatter
        for action in command._actions:  # argparse offers no public list; an option without help shows no default
            if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                action.help = f"default {action.default}"
    return parser


def _cmd_jobs(args: argparse.Namespace) -> int:
    from anytime.train.jobs import JobOutcome, load_sweep, run_sweep

    out = Path(args.out or Path("runs") / "sweeps" / Path(args.sweep).stem)
    sweep = load_sweep(args.sweep, out)
    say = progress_printer(args)
    workers = args.workers or ("1" if args.backend == "local" else "all")
    say(f"{len(sweep.jobs)} job(s) from {args.sweep} on {args.backend} with {workers} worker(s) -> {out}")

    def report(outcome: JobOutcome) -> None:
        if outcome.status == "failed":
            say(f"  {outcome.job}: failed: {outcome.error} (log: {outcome.log})")
        else:
            say(f"  {outcome.job}: {outcome.status}, test {100 * (outcome.test_acc or 0):.2f}%  "
                f"({outcome.train_time_s or 0:.1f} s training)")  # fmt: skip

    result = run_sweep(sweep, out, backend=args.backend, workers=args.workers, on_outcome=report)
    written = [result.table_csv, result.table_json]
    if not args.no_plot and any(o.test_acc is not None for o in result.outcomes):
        from anytime.plotting.sweeps import plot_sweep

        written += plot_sweep(result.outcomes, out / "results", f"{sweep.path.name}: {len(sweep.jobs)} jobs")
    if args.json:
        print_json([o.row() for o in result.outcomes])
    else:
        print(f"results    {', '.join(str(p) for p in written)}")
    if result.failed:
        print(
            f"anytime jobs: error: {len(result.failed)} of {len(result.outcomes)} job(s) failed (their logs are "
            f"named above); fix the cause and run the same command again: finished jobs are kept",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_ticket(args: argparse.Namespace) -> int:
    from anytime.train.jobs import Sweep, run_sweep, ticket_jobs

    dense = Path(args.dense)
    named = dense.resolve()
    unit = "-channels" if args.unit == "channels" else ""
    out = Path(args.out or named.with_name(f"{named.name}-ticket{unit}-s{args.sparsity:g}-k{args.reset_epoch}"))
    jobs = ticket_jobs(dense, out, sparsity=args.sparsity, reset_epoch=args.reset_epoch, rounds=args.rounds,
                       scope=args.scope, unit=args.unit)  # fmt: skip
    say = progress_printer(args)
    say(f"{len(jobs)} round(s) of pruning {dense} to sparsity {args.sparsity:g}, rewound to epoch {args.reset_epoch} "
        f"-> {out}")  # fmt: skip
    result = run_sweep(Sweep(path=dense, jobs=tuple(jobs)), out, on_outcome=lambda o: say(
        f"  {o.job}: sparsity {o.params['sparsity']:.4f}: " + (f"failed: {o.error} (log: {o.log})" if o.status == "failed"
                                                               else f"{o.status}, test {100 * (o.test_acc or 0):.2f}%")))  # fmt: skip
    if args.json:
        print_json([o.row() for o in result.outcomes])
    else:
        print(f"results    {result.table_csv}")
    if result.failed:
        print(f"anytime ticket: error: round {result.failed[0].job} failed; fix the cause and run the same command "
              "again: finished rounds are kept", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    names = _experiment_names()
    if args.name not in names:
        where = _experiments_dir()
        hint = (
            f"one of: {', '.join(names)}" if names else f"no experiments found in {where} (run from a source checkout)"
        )
        raise AnytimeError(f"unknown experiment '{args.name}'; {hint}")
    path = _experiments_dir() / f"{args.name.replace('-', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"anytime_experiment_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [flag for flag, on in (("--quick", args.quick), ("--overwrite", args.overwrite),
                                  ("--drop-caches", args.drop_caches)) if on]  # fmt: skip
    if args.out:
        argv += ["--out", args.out]
    if args.device is not None:
        if not getattr(module, "TAKES_DEVICE", False):
            raise AnytimeError(f"the {args.name} study runs on the CPU only; drop --device")
        argv += ["--device", args.device]
    entry: Callable[[list[str]], int] = module.main
    with contextlib.ExitStack() as scope:
        if args.figure_size != "screen":
            from anytime.plotting import figure_size

            scope.enter_context(figure_size(args.figure_size))
        if not args.json:
            return int(entry(argv) or 0)
        with contextlib.redirect_stdout(sys.stderr):  # the study's progress lines: stdout carries the JSON
            code = int(entry(argv) or 0)
    results = Path(args.out) if args.out else Path("results") / args.name
    if code == 0:
        print((results / "results.json").read_text())
    return code


def _cmd_demo(args: argparse.Namespace) -> int:
    from anytime.tasks.demo import DEMO_CONFIG, DEMO_REQUESTS, run_demo
    from anytime.tasks.promises import promise_lines
    from anytime.utils.outputs import check_replaceable

    out = Path(args.out) if args.out else Path("runs") / "demo"
    check_replaceable(out, "demo", overwrite=args.overwrite, create_parents=args.out is None)
    print(f"demo: training {DEMO_CONFIG.model} on the embedded digits for {DEMO_CONFIG.epochs} epochs...",
          file=sys.stderr)  # fmt: skip
    result = run_demo(out, progress=sys.stderr.isatty(), overwrite=args.overwrite, create_parents=args.out is None)
    if args.json:
        print((result.out_dir / "demo.json").read_text())
        return 0
    final = result.summary["final"]
    print(f"test accuracy {100 * final['test_acc']:.2f}% (validation {100 * final['val_acc']:.2f}%) "
          f"in {result.summary['train_time_s']:.1f} s of training")  # fmt: skip
    for e in result.summary["exits"]:
        print(f"  exit {e['index']} after {e['name']:<11} {100 * e['flops'] / result.summary['backbone_flops']:5.1f}% "
              f"of the FLOPs: test {100 * e['test_acc']:.2f}%")  # fmt: skip
    cal, ev = result.calibration, result.evaluation
    print(f"calibrated on validation for at most {cal['target']['max_drop_points']:g} point below the last exit "
          f"({cal['policy']['criterion']} thresholds {[None if t is None else round(t, 3) for t in cal['policy']['thresholds']]}):")  # fmt: skip
    print_policy_figures("  validation", cal["validation"])
    print_policy_figures("  test", cal["test"])
    lat = ev["latency"]
    print(f"real early exit on the test split: {100 * ev['accuracy']:.2f}%, {lat['speedup']:.2f}x faster per sample "
          f"at batch 1 than the plain backbone ({lat['early_exit']['mean_ms']:.2f} vs {lat['backbone']['mean_ms']:.2f} ms)")  # fmt: skip
    print(f"deadlines at batch 1: the runtime's promise and what it delivered to {DEMO_REQUESTS} test images one at a "
          "time (Poisson arrivals):")  # fmt: skip
    for line in promise_lines(result.deadlines):
        print(f"  {line}")
    print("time per training mini-batch (median):")
    for row in result.batch_time:
        print(f"  batch {int(row['batch_size']):>4}: {1000 * row['total_p50_s']:7.1f} ms "
              f"(forward {1000 * row['forward_p50_s']:.1f}, backward {1000 * row['backward_p50_s']:.1f}, "
              f"step {1000 * row['step_p50_s']:.1f}) = {row['images_per_s']:.0f} images/s")  # fmt: skip
    print(f"results and plots in {result.out_dir}/:")
    for path in result.files:
        print(f"  {path}")
    return 0


def _cmd_seeds(args: argparse.Namespace) -> int:
    from anytime.tasks.seeds import summarise_seeds

    summary = summarise_seeds(args.runs)
    if args.json:
        return print_json(summary)
    print(f"{summary.model} on {summary.data}: {len(summary.runs)} seeds ({', '.join(map(str, summary.seeds))})")
    print(f"{'step':<8} {'validation: mean ± std [min, max]':<36} {'test: mean ± std [min, max]':<36}")
    for s in summary.steps:
        cells = [
            f"{100 * f.mean:.2f} ± {100 * f.std:.2f} [{100 * f.low:.2f}, {100 * f.high:.2f}]"
            for f in (s.val_acc, s.test_acc)
        ]
        print(f"{s.name:<8} {cells[0]:<36} {cells[1]:<36}")
    t = summary.train_time_s
    print(f"training time {t.mean:.1f} ± {t.std:.1f} s")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from anytime.tasks.report import write_report

    result = write_report(args.run, args.out)
    if args.json:
        print(json.dumps({"report": str(result.path), "missing": list(result.missing)}, indent=2))
        return 0
    print(f"report {result.path}")
    for line in result.missing:
        print(f"missing {line}")
    return 0


def _cmd_split(args: argparse.Namespace) -> int:
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link
    from anytime.split.runs import plan_run

    link = Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms)
    plan = plan_run(args.run, args.device_profile, args.server_profile, link, args.deadline_ms, quantile=args.quantile,
                    codecs=parse_codecs(args.codecs), criterion=args.criterion, partitions=args.partitions)  # fmt: skip
    doc = plan.to_dict()
    if not args.frontier and not args.json:
        doc.pop("frontier")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    o = plan.option
    verdict = "fits" if plan.fits else "does NOT fit"
    print(f"{o.name(plan.num_steps)}: accuracy {100 * o.accuracy:.2f}% (validation), p{100 * plan.quantile:g} "
          f"{o.latency_ms:.3f} ms {verdict} {plan.deadline_ms:g} ms; {100 * o.device_share:.1f}% answered on the "
          f"device, {o.bytes_per_request:.0f} bytes per request; thresholds {list(o.thresholds)}")  # fmt: skip
    if plan.note:
        print(plan.note)
    if args.frontier:
        for f in plan.frontier:
            print(f"  {f.latency_ms:9.3f} ms  {100 * f.accuracy:6.2f}%  {f.name(plan.num_steps)}")
    return 0


def _cmd_split_run(args: argparse.Namespace) -> int:
    from anytime.split.codec import parse_codecs
    from anytime.split.plan import Link
    from anytime.split.session import parse_bandwidth_schedule, run_split_session

    schedule = parse_bandwidth_schedule(args.shape_bandwidth, args.bandwidth_mbps, args.requests)
    host, _, port = args.server.rpartition(":")
    if not host or not port.isdigit():
        raise AnytimeError(f"--server {args.server!r} is not HOST:PORT (e.g. 127.0.0.1:9000)")
    result = run_split_session(
        args.run, host=host, port=int(port), device_profile=args.device_profile, server_profile=args.server_profile,
        link=Link(args.bandwidth_mbps, args.rtt_ms, args.overhead_ms), deadline_ms=args.deadline_ms,
        quantile=args.quantile, codecs=parse_codecs(args.codecs), criterion=args.criterion, partitions=args.partitions,
        split=args.data_split, requests=args.requests, schedule=schedule, delay_ms=args.rtt_ms if args.shape_delay_ms is None else args.shape_delay_ms,
        slowdown=args.emulate_slowdown, adapt=not args.fixed, timeout_ms=args.timeout_ms, threads=args.threads,
        link_samples=args.link_samples, out=args.out,
    )  # fmt: skip
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for line in result.notes():
        print(line)
    print(f"{summary['requests']} requests: accuracy {100 * summary['accuracy']:.2f}%, p50 {summary['p50_ms']:.3f} ms, "
          f"p99 {summary['p99_ms']:.3f} ms (planned p{100 * args.quantile:g} {summary['planned_ms']:.3f} ms), "
          f"misses {100 * summary['miss_rate']:.2f}% of {args.deadline_ms:g} ms; answered on the device "
          f"{100 * summary['device_share']:.1f}%, by the server {100 * summary['server_share']:.1f}%, "
          f"fallback {100 * summary['fallback_share']:.1f}%")  # fmt: skip
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from anytime.serve.http import ServeOptions, serve

    if args.role == "server":
        from anytime.split.session import serve_split

        http_only = [flag for flag, value in (("--profile", args.profile), ("--calibration", args.calibration),
                                              ("--max-batch", args.max_batch), ("--workers", args.workers != 1))
                     if value]  # fmt: skip
        if http_only:
            raise AnytimeError(f"{', '.join(http_only)} apply to the HTTP server; --role server takes the device's "
                               "plan with each request (drop them)")  # fmt: skip

        serve_split(args.run, host=args.host, port=args.port, threads=args.threads, device=args.device,
                    max_payload_kb=args.max_body_kb,
                    on_ready=lambda address: print(f"split server for {args.run} on {address} (Ctrl-C stops)",
                                                   file=sys.stderr, flush=True))  # fmt: skip
        return 0

    options = ServeOptions(run=args.run, profile=args.profile, calibration=args.calibration, max_batch=args.max_batch,
                           max_body_kb=args.max_body_kb, quantile=args.quantile, threads=args.threads,
                           device=args.device)  # fmt: skip
    try:
        serve(options, host=args.host, port=args.port, workers=args.workers,
              on_ready=lambda url: print(f"serving {args.run} on {url} (POST /predict, GET /schedule, /healthz, "
                                         "/metrics; Ctrl-C stops)", file=sys.stderr, flush=True))  # fmt: skip
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_cut(args: argparse.Namespace) -> int:
    from anytime.tasks.cut import cut_study, make_ladder_run

    if args.ladder:
        if args.out is None:
            raise AnytimeError("--ladder writes a new run: give it a folder with --out LADDER_RUN")
        if args.recalibrate_bn or args.finetune_epochs:
            raise AnytimeError(
                "the ladder shares one set of weights and statistics across its steps; "
                "--recalibrate-bn and --finetune-epochs apply to the study (train with --stochastic-depth instead)"
            )
        study_only = [flag for flag, value in (("--kind", args.kind), ("--split", args.split), ("--images", args.images),
                                               ("--repeats", args.repeats)) if value is not None]  # fmt: skip
        if study_only:
            raise AnytimeError(
                f"{', '.join(study_only)} set the study; the ladder run skips branches from the top and "
                "is scored on validation and test in full (collect and profile it next)"
            )
        summary = make_ladder_run(args.run, args.out, device=args.device, overwrite=args.overwrite)
        if args.json:
            return print_json(summary)
        print(f"ladder run {args.out}: {len(summary['exits'])} steps from {args.run}")
        for e in summary["exits"]:
            print(f"step {e['index']:<3} {e['name']:<14} {100 * e['flops'] / summary['backbone_flops']:5.1f}% FLOPs  "
                  f"val {100 * e['val_acc']:.2f}%  test {100 * e['test_acc']:.2f}%")  # fmt: skip
        print(f"next: anytime collect {args.out} --split val; anytime profile {args.out}")
        return 0
    kinds = ["shortcut", "branch"] if args.kind in (None, "both") else [args.kind]
    study = cut_study(
        args.run, kinds=kinds, recalibrate_bn=args.recalibrate_bn, finetune_epochs=args.finetune_epochs,
        split=args.split or "test", images=args.images, latency_repeats=args.repeats or 30, device=args.device, out=args.out,
        overwrite=args.overwrite, progress=progress_printer(args), bar=sys.stderr.isatty(),
    )  # fmt: skip
    if args.json:
        return print_json(study)
    print(f"table  {study.csv}")
    print(f"report {study.json}")
    for path in study.plots:
        print(f"plot   {path}")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from anytime.tasks.quantize import quantize_run

    summary = quantize_run(args.run, args.precision, calibration_images=args.calibration_images, out=args.out,
                           compile=not args.no_compile, overwrite=args.overwrite, device=args.device,
                           qat_epochs=args.qat_epochs, qat_lr=args.qat_lr, progress=progress_printer(args),
                           float_layers=args.float_layers, min_agreement=args.min_agreement,
                           max_float_layers=args.max_float_layers, agreement_images=args.agreement_images,
                           min_size_ratio=args.min_size_ratio)  # fmt: skip
    if args.json:
        return print_json(summary)
    record = summary["precision"]
    print(f"run        {summary['run_dir']}: {args.run} at {record['precision']} ({record['backend']}, "
          f"{'compiled' if record['compile'] else 'eager'})")  # fmt: skip
    if record["calibration_images"]:
        print(f"calibrated on {record['calibration_images']} training images")
    tuning = record.get("agreement_tuning")
    if tuning:
        lowest = 100 * min(tuning["agreement"])
        print(f"agreement with the float run on {tuning['images']} validation images: lowest step {lowest:.2f}% "
              f"(target {100 * tuning['target']:.2f}%{'' if tuning['met'] else ': not met'})")  # fmt: skip
        if tuning.get("max_float_weights") is not None:
            print(f"weights kept in float: {tuning['float_weights']:,} of the {tuning['max_float_weights']:,} "
                  "--min-size-ratio allows")  # fmt: skip
    if record.get("float_layers"):
        print(f"kept in float: {', '.join(record['float_layers'])}")
    qat = bool(record.get("qat_epochs"))
    if qat:
        print(f"fine-tuned by {record['qat_epochs']} epochs of quantization-aware training (lr {record['qat_lr']})")
    print(
        f"{'step':<16} {'GFLOPs':>8} {'val':>7} {'(float)':>8} {'test':>7} {'(float)':>8}"
        + (f" {'PTQ val':>8} {'PTQ test':>9}" if qat else "")
    )
    rows = summary.get("exits") or [{"name": "model", **summary["final"]}]
    for row, flops in zip(rows, summary["step_flops"]):
        ptq = f" {100 * row['ptq_val_acc']:7.2f}% {100 * row['ptq_test_acc']:8.2f}%" if qat else ""
        print(f"{row['name']:<16} {flops / 1e9:8.4f} {100 * row['val_acc']:6.2f}% {100 * row['parent_val_acc']:7.2f}% "
              f"{100 * row['test_acc']:6.2f}% {100 * row['parent_test_acc']:7.2f}%{ptq}")  # fmt: skip
    print(f"next: anytime collect {summary['run_dir']} --split val; anytime profile {summary['run_dir']}")
    return 0


def _cmd_ensemble(args: argparse.Namespace) -> int:
    from anytime.families import FUSERS, FitSettings
    from anytime.tasks.ensemble import build_ensemble

    members = [m for m in args.members.split(",") if m.strip()]
    report = build_ensemble(members, args.out, order=args.order, fuser=args.fuser, folds=args.folds,
                            fit_split=args.fit_split, settings=FitSettings(hidden=args.hidden), device=args.device,
                            overwrite=args.overwrite, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    print(
        f"run    {report.out}: {len(report.members)} members in {report.order} order, deploys the {report.fuser} fuser"
    )
    print(f"{'#':<3} {'member':<20} {'precision':<9} {'val':>7} {'test':>7} {'ms (b1)':>8}  run")
    for k, m in enumerate(report.members):
        cost = f"{m.cost_ms:8.3f}" if m.cost_ms is not None else f"{'-':>8}"
        print(f"{k:<3} {m.name:<20} {m.precision:<9} {100 * m.val_acc:6.2f}% {100 * m.test_acc:6.2f}% {cost}  {m.run}")
    if report.cost_source != "not measured":
        print(f"costs: {report.cost_source}")
    print("fused accuracy of the first k members, test (validation cross-fitted):")
    print(f"{'fuser':<9} " + " ".join(f"{f'k={k + 1}':>16}" for k in range(len(report.members))))
    for kind in FUSERS:
        cells = [f"{100 * t:6.2f}% ({100 * v:5.2f}%)" for t, v in zip(report.test_acc[kind], report.val_acc[kind])]
        print(f"{kind + (' *' if kind == report.fuser else ''):<9} " + " ".join(f"{c:>16}" for c in cells))
    if report.stacking is not None:
        val, test = report.stacking
        print(f"scikit-learn cross-check, LogisticRegression on all members: test {100 * test:.2f}% ({100 * val:.2f}%)")
    best = report.best_member
    print(f"best single member (by validation): {best.name}, test {100 * best.test_acc:.2f}%")
    print(
        f"next: anytime profile {report.out}; anytime calibrate {report.out} ...; anytime schedule {report.out} --deadline-ms D"
    )
    return 0


def _cmd_ensemble_baseline(args: argparse.Namespace) -> int:
    from anytime.tasks.baseline import train_baseline
    from anytime.train import TrainConfig

    config = TrainConfig(model=args.model, data=args.data, data_root=args.data_root, limit_train=args.limit_train,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device)  # fmt: skip
    report = train_baseline(args.method, config, estimators=args.estimators, out=args.out, shrinkage=args.shrinkage,
                            overwrite=args.overwrite, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    print(f"run    {report.out}: {args.method}, {report.estimators} x {report.model}, {report.epochs} epochs")
    print("method | test accuracy | training time | evaluation time")
    print(f"{args.method} | {100 * report.test_acc:.2f}% | {report.train_time_s:.2f} s | {report.eval_time_s:.2f} s")
    for k, (val, test) in enumerate(zip(report.step_val_acc, report.step_test_acc)):
        print(f"step {k} (first {k + 1} members)  val {100 * val:.2f}%  test {100 * test:.2f}%")
    print(f"next: anytime collect {report.out} --split val; anytime profile {report.out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from anytime.tasks.export import export_run

    report = export_run(args.run, args.format, out=args.out, precision=args.precision, overwrite=args.overwrite,
                        calibration_images=args.calibration_images, parity_images=args.parity_images,
                        float_layers=args.float_layers, min_agreement=args.min_agreement,
                        max_float_layers=args.max_float_layers, agreement_images=args.agreement_images,
                        min_size_ratio=args.min_size_ratio, progress=progress_printer(args))  # fmt: skip
    if args.json:
        return print_json(report)
    manifest = report.manifest
    print(
        f"export {report.out}: {args.run} as {manifest.format} at {manifest.precision}, {len(manifest.parts)} "
        f"artifacts, {manifest.bytes / 1e6:.2f} MB" + (f" ({manifest.quantizer})" if manifest.quantizer else "")
    )
    if report.tuning is not None:
        tuning = report.tuning
        print(
            f"agreement with the float run on {tuning.images} validation images: lowest step "
            f"{100 * min(tuning.agreement):.2f}% (target {100 * tuning.target:.2f}%{'' if tuning.met else ': not met'})"
        )
        if tuning.max_float_weights is not None:
            print(
                f"weights kept in float: {tuning.float_weights:,} of the {tuning.max_float_weights:,} --min-size-ratio allows"
            )
    if manifest.float_layers:
        print(f"kept in float: {', '.join(manifest.float_layers)}")
    for part in manifest.parts:
        print(
            f"  {part.file:<16} {part.role:<8} step {part.step}  in {'x'.join(map(str, part.input_shape)):<10} "
            f"out {'x'.join(map(str, part.output_shape)):<10} {part.bytes / 1e6:8.3f} MB"
        )
    if report.parity:
        print(
            f"{'step':<5} {'dtype':<6} {'input':<10} {'max err':>9} {'top-1 agree':>12} {'eager ms':>9} {'artifact ms':>12} "
            f"{'eager img/s':>12} {'artifact img/s':>15}"
        )
        for r in report.parity:
            print(
                f"{r.step:<5} {r.dtype:<6} {r.input_shape:<10} {r.max_abs_err:9.2e} {100 * r.top1_agreement:11.2f}% "
                f"{r.eager_p50_ms:9.3f} {r.artifact_p50_ms:12.3f} {r.eager_images_per_s:12.0f} {r.artifact_images_per_s:15.0f}"
            )
        print(
            f"parity on {report.parity[0].images} test images; batch-1 p50 and batch-32 throughput, eager fp32 vs the artifact"
        )
        print(f"table {report.out / 'parity.csv'}")
    print(f"next: anytime profile {report.out}")
    return 0


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from anytime.data.shards import prepare_shards
    from anytime.utils.resources import format_bytes

    result = prepare_shards(args.src, args.out, image_size=args.image_size, workers=args.workers,
                            shard_size=args.shard_size, verify=args.verify, on_progress=progress_printer(args))  # fmt: skip
    m = result.manifest
    if args.json:
        return print_json({**m.to_dict(), "root": str(m.root), "written": result.written, "reused": result.reused})
    shards = len(m.train.shards) + len(m.test.shards)
    size = sum(s.bytes for s in m.train.shards + m.test.shards)
    print(f"shards {m.root}: {m.train.count:,} train + {m.test.count:,} test images at {m.image_size}x{m.image_size}, "
          f"{len(m.classes)} classes, {shards} shards ({format_bytes(size)}); {result.written} written, "
          f"{result.reused} already done, {result.seconds:.1f} s")  # fmt: skip
    print(f"next: anytime train --data shards --data-root {m.root}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": _moved("models"), "train": _moved("train"), "exits": _moved("exits"), "collect": _moved("collect"), "sweep": _moved("sweep"),
    "calibrate": _moved("calibrate"), "evaluate": _moved("evaluate"), "plot": _moved("plot"), "cam": _moved("cam"), "ponder": _moved("ponder"), "profile": _moved("profile"),
    "schedule": _moved("schedule"), "cut": _cmd_cut, "quantize": _cmd_quantize, "export": _cmd_export,
    "ensemble": _cmd_ensemble, "ensemble-baseline": _cmd_ensemble_baseline,
    "seeds": _cmd_seeds,
    "jobs": _cmd_jobs,
    "ticket": _cmd_ticket,
    "report": _cmd_report,
    "serve": _cmd_serve,
    "split": _cmd_split,
    "split-run": _cmd_split_run,
    "experiment": _cmd_experiment,
    "demo": _cmd_demo,
    "prepare-data": _cmd_prepare_data,
}  # fmt: skip


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds the stack, so temporary files and staged folders are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(owner: int, signum: int, _frame: Any) -> None:
    if os.getpid() != owner:  # a forked worker (a decoding pool, a DataLoader) inherited this: end as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise _Terminated(signum)


def _catch_termination() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    handler = functools.partial(_terminate, os.getpid())
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _quiet_broken_pipe() -> int:
    """The reader of our output went away (``anytime ... | head``): stop without a word, as ``cat`` does."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _other_process() -> bool:
    """Whether this is one of several data-parallel processes but not process 0."""
    return "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anytime`` command; returns the exit status (a data-parallel training process ends
    itself with it instead, see :func:`anytime.train.distributed.end_process`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    status = _run_command(args)
    distributed = sys.modules.get("anytime.train.distributed")
    if distributed is not None and distributed.joined_a_group():
        distributed.end_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status, having said why on stderr where it failed."""
    previous = _catch_termination()
    try:
        status = HANDLERS[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except AnytimeError as exc:
        if not isinstance(exc, PeerStopped):  # process 0 has said why
            where = f" (process {os.environ.get('RANK')})" if _other_process() else ""
            print(f"anytime {args.command}: error{where}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        from anytime.utils.tempnames import user_path

        where = f" ({user_path(exc.filename)})" if exc.filename else ""
        print(f"anytime {args.command}: error: {exc.strerror or exc}{where}; check the path and its permissions",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except _Terminated as exc:
        if not _other_process():
            print(f"\nstopped by signal {exc.signum}; nothing partial was kept", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
