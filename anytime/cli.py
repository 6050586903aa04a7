"""``anytime <command>``: the only module that parses arguments and prints."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError

COMMANDS: dict[str, str] = {
    "models": "list the model zoo and torchvision classifiers, with parameter counts",
    "train": "train a model (or a model card) and record time, memory and accuracy",
    "experiment": "run an edge-training study from experiments/ (batch-time, memory, time-accuracy)",
    "demo": "train on the embedded digits and show where the time goes (no files needed)",
}


def _experiments_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "experiments"


def _experiment_names() -> list[str]:
    folder = _experiments_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem.replace("_", "-") for p in folder.glob("*.py") if not p.name.startswith("_"))


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got '{text}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (exposed for tests and documentation)."""
    parser = argparse.ArgumentParser(
        prog="anytime",
        description="Anytime inference research in PyTorch: train, measure and schedule models on a device.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<11} {text}" for name, text in COMMANDS.items())
        + "\n\nrun 'anytime COMMAND --help' for a command's options",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands below")

    models = sub.add_parser("models", description=COMMANDS["models"])
    models.add_argument("--no-torchvision", action="store_true", help="list only the zoo")
    models.add_argument("--flops", action="store_true", help="also count forward FLOPs per 32x32 image (slower)")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")

    train = sub.add_parser("train", description=COMMANDS["train"])
    train.add_argument("--card", metavar="FILE", help="a model card (models/NAME.toml); other options override it")
    train.add_argument("--model", help="a zoo name or tv:NAME (see 'anytime models'); default lenet")
    train.add_argument("--data", choices=["digits", "cifar10", "folder", "synthetic"], help="default digits")
    train.add_argument("--data-root", metavar="PATH",
                       help="dataset folder (cifar10 default: $ANYTIME_CIFAR10, ./data/cifar10, ../shared/data/cifar10)")
    train.add_argument("--image-size", type=_positive_int, metavar="PX", help="resize images (folder data)")
    train.add_argument("--val-fraction", type=_finite_float, metavar="F", help="share of training data held out")
    train.add_argument("--limit-train", type=_positive_int, metavar="N", help="train on N images only (quick runs)")
    train.add_argument("--epochs", type=_positive_int, metavar="N")
    train.add_argument("--batch-size", type=_positive_int, metavar="B")
    train.add_argument("--lr", type=_finite_float, metavar="LR", help="SGD learning rate (default 0.01)")
    train.add_argument("--momentum", type=_finite_float, metavar="M", help="default 0.9")
    train.add_argument("--weight-decay", type=_finite_float, metavar="WD", help="default 5e-4")
    train.add_argument("--schedule", choices=["constant", "cosine", "step"], help="lr schedule (default cosine)")
    train.add_argument("--seed", type=_non_negative_int, metavar="S")
    train.add_argument("--device", help="auto | cpu | cuda (default auto)")
    train.add_argument("--workers", type=_non_negative_int, metavar="N", help="DataLoader worker processes")
    train.add_argument("--prefetch-factor", type=_positive_int, metavar="N", help="batches prefetched per worker")
    train.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=None,
                       help="pin host memory for faster copies to a CUDA GPU")
    train.add_argument("--out", metavar="RUN_DIR", help="run directory (default runs/MODEL-DATA or runs/CARD)")
    train.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    train.add_argument("--update-card", action="store_true", help="write the measured results into the card")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    experiment = sub.add_parser("experiment", description=COMMANDS["experiment"])
    experiment.add_argument("name", metavar="NAME", help="one of: " + ", ".join(_experiment_names()))
    experiment.add_argument("--quick", action="store_true", help="a few minutes on a laptop-class CPU")
    experiment.add_argument("--out", metavar="DIR", help="results folder (default results/NAME)")

    demo = sub.add_parser("demo", description=COMMANDS["demo"])
    demo.add_argument("--out", metavar="DIR", default="runs/demo", help="results folder (default runs/demo)")
    return parser


def _cmd_models(args: argparse.Namespace) -> int:
    from anytime.backbones import get_spec, list_models
    from anytime.backbones.registry import model_costs

    rows: list[dict[str, Any]] = []
    names = list_models(include_torchvision=not args.no_torchvision)
    for name, cost in zip(names, model_costs(names, count_flops=args.flops)):
        family = "torchvision" if name.startswith("tv:") else get_spec(name).family
        description = "" if name.startswith("tv:") else get_spec(name).description
        rows.append({"name": name, "family": family, "parameters": cost.parameters, "flops": cost.flops,
                     "description": description})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'model':<24} {'family':<13} {'params':>9}" + (f" {'MFLOPs':>9}" if args.flops else "")
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['name']:<24} {r['family']:<13} {r['parameters'] / 1e6:>8.2f}M"
        if args.flops:
            line += f" {r['flops'] / 1e6:>9.1f}" if r["flops"] is not None else f" {'n/a':>9}"
        print(line)
    print(f"\n{len(rows)} models; parameters for 10 classes, 3 input channels; "
          "FLOPs per 32x32 image, a multiply-add counted as 2" if args.flops else f"\n{len(rows)} models")  # fmt: skip
    return 0


# Options of `anytime train` that are TrainConfig fields of the same name.
_TRAIN_FIELDS = (
    "model", "data", "data_root", "image_size", "val_fraction", "limit_train", "epochs", "batch_size", "lr", "momentum",
    "weight_decay", "schedule", "seed", "device", "workers", "prefetch_factor", "pin_memory",
)  # fmt: skip


def _cmd_train(args: argparse.Namespace) -> int:
    from anytime.train import TrainConfig, Trainer, load_card, record_results
    from anytime.train.trainer import CHECKPOINT

    card = load_card(args.card) if args.card else None
    overrides = {field: getattr(args, field) for field in _TRAIN_FIELDS if getattr(args, field) is not None}
    if args.update_card and card is None:
        raise AnytimeError("--update-card needs --card FILE")
    changed = sorted(set(overrides) - set(TrainConfig.RUNTIME_FIELDS))
    if args.update_card and changed:
        raise AnytimeError(
            f"--update-card records the card's own recipe, but {', '.join('--' + c.replace('_', '-') for c in changed)} "
            "change it; drop those options or edit the card"
        )
    default_name = card.name if card else f"{overrides.get('model', 'lenet')}-{overrides.get('data', 'digits')}"
    run_dir = Path(args.out or Path("runs") / default_name.replace(":", "_"))
    if args.resume:
        from anytime.train import load_checkpoint

        saved = load_checkpoint(run_dir / CHECKPOINT)["config"]
        base = TrainConfig.from_dict(saved, where=str(run_dir / CHECKPOINT))
    else:
        base = card.config if card else TrainConfig()
    config = base.replace(**overrides) if overrides else base
    trainer = Trainer(
        config, run_dir, progress=not args.no_progress and sys.stderr.isatty(),
        on_start=lambda line: print(line, file=sys.stderr), extra_config={"card": str(card.path)} if card else {},
    )  # fmt: skip
    try:
        summary = trainer.fit(resume=args.resume)
    except KeyboardInterrupt:
        print(f"\ninterrupted; continue with: anytime train --out {run_dir} --resume", file=sys.stderr)
        return 130
    final = summary["final"]
    steady = summary["timing"]["steady"] or summary["timing"]["epoch0"]
    print(f"run        {run_dir}")
    print(f"accuracy   val {100 * final['val_acc']:.2f}%  test {100 * final['test_acc']:.2f}%  "
          f"(best val {100 * summary['best_val_acc']:.2f}%)")  # fmt: skip
    print(f"time       {summary['train_time_s']:.1f} s training, {summary['wall_time_s']:.1f} s with validation, "
          f"{summary['epochs']} epoch(s) on {summary['device']} ({summary['torch_threads']} threads)")  # fmt: skip
    it = steady["iteration_mean_s"]
    print(f"iteration  {1000 * it:.1f} ms: data {100 * steady['data_mean_s'] / it:.0f}%  "
          f"forward {100 * steady['forward_mean_s'] / it:.0f}%  backward {100 * steady['backward_mean_s'] / it:.0f}%  "
          f"step {100 * steady['step_mean_s'] / it:.0f}%  ({steady['images_per_s']:.0f} images/s"
          f"{', steady state' if summary['timing']['steady'] else ', epoch 0 only'})")  # fmt: skip
    print(f"memory     peak RSS {summary['peak_rss_mb']:.0f} MiB"
          + (f", CUDA peak {summary['cuda_peak_mb']:.0f} MiB" if summary["cuda_peak_mb"] is not None else ""))
    if args.update_card and card is not None:
        from datetime import date

        from anytime.utils.machine import cpu_model

        record_results(card, {
            "val_acc": round(final["val_acc"], 4), "test_acc": round(final["test_acc"], 4),
            "best_val_acc": round(summary["best_val_acc"], 4), "train_time_s": round(summary["train_time_s"], 1),
            "epochs": summary["epochs"], "device": summary["device"], "cpu": cpu_model(),
            "threads": summary["torch_threads"], "date": date.today().isoformat(),
        })  # fmt: skip
        print(f"card       results recorded in {card.path}")
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    names = _experiment_names()
    if args.name not in names:
        where = _experiments_dir()
        hint = f"one of: {', '.join(names)}" if names else f"no experiments found in {where} (run from a source checkout)"
        raise AnytimeError(f"unknown experiment '{args.name}'; {hint}")
    path = _experiments_dir() / f"{args.name.replace('-', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"anytime_experiment_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv: list[str] = []
    if args.quick:
        argv.append("--quick")
    if args.out:
        argv += ["--out", args.out]
    entry: Callable[[list[str]], int] = module.main
    return int(entry(argv) or 0)


def _cmd_demo(args: argparse.Namespace) -> int:
    from anytime.demo import DEMO_CONFIG, run_demo

    print(f"demo: training {DEMO_CONFIG.model} on the embedded digits for {DEMO_CONFIG.epochs} epochs...",
          file=sys.stderr)  # fmt: skip
    result = run_demo(args.out, progress=sys.stderr.isatty())
    final = result.summary["final"]
    print(f"test accuracy {100 * final['test_acc']:.2f}% (validation {100 * final['val_acc']:.2f}%) "
          f"in {result.summary['train_time_s']:.1f} s of training")  # fmt: skip
    print("time per training mini-batch (median):")
    for row in result.batch_time:
        print(f"  batch {int(row['batch_size']):>4}: {1000 * row['total_p50_s']:7.1f} ms "
              f"(forward {1000 * row['forward_p50_s']:.1f}, backward {1000 * row['backward_p50_s']:.1f}, "
              f"step {1000 * row['step_p50_s']:.1f}) = {row['images_per_s']:.0f} images/s")  # fmt: skip
    print(f"results and plots in {result.out_dir}/:")
    for path in result.files:
        print(f"  {path}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": _cmd_models, "train": _cmd_train, "experiment": _cmd_experiment, "demo": _cmd_demo,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anytime`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except AnytimeError as exc:
        print(f"anytime {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"anytime {args.command}: error: {exc.strerror or exc}{where}; check the path and its permissions",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
