"""``anytime train``: train a model or a model card, plain or with early exits, slices, a resolution ladder, SACT
or a lottery ticket, on one process or several; the run folder records time, memory and accuracy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anytime.commands.options import (
    add_batch_size,
    add_device,
    add_exit_head,
    add_exit_points,
    add_json,
    add_out,
    add_overwrite,
    add_reset_epoch,
    add_sparsity,
    finite_float,
    non_negative_int,
    positive_int,
)
from anytime.commands.output import print_error, print_json, print_train_summary
from anytime.errors import AnytimeError
from anytime.train.launch import launch_local, place_from_environment

if TYPE_CHECKING:
    from anytime.train.summary import RunSummary

_DATA = ("digits", "cifar10", "cifar100", "folder", "synthetic", "shards", "folder-stream", "sst2", "textfolder")
SUMMARY = "train a model (or a model card), plain or with early exits; record time, memory and accuracy"

# Options of `anytime train` that are TrainConfig fields of the same name.
_TRAIN_FIELDS = (
    "model", "data", "data_root", "image_size", "val_fraction", "limit_train", "epochs", "batch_size", "lr", "momentum",
    "weight_decay", "schedule", "seed", "device", "workers", "prefetch_factor", "pin_memory", "exits", "exit_mode",
    "exit_head", "distill", "distill_teacher", "gradient_equilibrium", "init", "slices", "resolutions", "sact",
    "sact_mode", "ponder_cost", "slice_kind", "stochastic_depth", "warmup", "nesterov", "label_smoothing", "ema",
    "norm_bias_lr_scale", "amp", "augment", "padding", "cutout", "channels_last", "tta", "prune_from", "sparsity",
    "reset_epoch", "prune_scope", "prune_unit", "optimizer", "vocab_size", "max_length", "tokenizer",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime train``: the recipe, the run's place and process, then three groups."""
    _add_data(parser)
    _add_optimiser(parser)
    _add_augmentation(parser)
    _add_runtime(parser)
    _add_exits(parser.add_argument_group("early exits"))
    _add_sliced(parser.add_argument_group("sliced networks and residual blocks"))
    _add_tickets(parser.add_argument_group("lottery tickets (see also `anytime ticket`)"))


def _add_switch(parser: argparse._ActionsContainer, option: str, help: str) -> None:
    """An option that is on (--X), off (--no-X) or, not given, the recipe's."""
    parser.add_argument(option, action=argparse.BooleanOptionalAction, default=None, help=help)


def _add_data(parser: argparse.ArgumentParser) -> None:
    """What the model learns from: a card, the model, the data and how it is read."""
    parser.add_argument(
        "--card",
        metavar="CARD",
        help="a model card: a file (models/NAME.toml) or a shipped card's name (cifar10-resnet20); "
        "other options override it",
    )
    parser.add_argument("--model", help="a zoo name or tv:NAME (see 'anytime models'); default: the card "
                        "image-lenet for images, text-ngram-exits for text")  # fmt: skip
    parser.add_argument(
        "--data",
        choices=list(_DATA),
        help="default digits; shards: a folder made by 'anytime prepare-data'; folder-stream: an image "
        "folder decoded batch by batch (needs --image-size); sst2 and textfolder: sentences in "
        "train/dev/test .tsv or .csv files with a label and a content (or sentence, text) column",
    )
    parser.add_argument(
        "--data-root",
        metavar="PATH",
        help="dataset folder (cifar10 default: $ANYTIME_CIFAR10, ./data/cifar10, ../shared/data/cifar10; "
        "cifar100 and sst2 likewise)",
    )
    parser.add_argument("--image-size", type=positive_int, metavar="PX", help="resize images (folder data)")
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        metavar="N",
        help="text: entries of the WordPiece tokenizer trained on the training split (default 8000)",
    )
    parser.add_argument(
        "--max-length",
        type=positive_int,
        metavar="T",
        help="text: tokens per sentence, [CLS] included; longer ones are cut and counted (default 64)",
    )
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="text: use this tokenizer.json (e.g. another run's) instead of training one"
    )
    parser.add_argument("--val-fraction", type=finite_float, metavar="F", help="share of training data held out")
    parser.add_argument("--limit-train", type=positive_int, metavar="N", help="train on N images only (quick runs)")


def _add_optimiser(parser: argparse.ArgumentParser) -> None:
    """How the model is optimised: epochs, batches, the learning rate and its schedule, regularisation."""
    parser.add_argument("--epochs", type=positive_int, metavar="N")
    add_batch_size(parser)
    parser.add_argument("--lr", type=finite_float, metavar="LR", help="learning rate (default 0.01)")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], help="default sgd; adamw for transformers")
    parser.add_argument("--momentum", type=finite_float, metavar="M", help="default 0.9 (AdamW: its first beta)")
    parser.add_argument("--weight-decay", type=finite_float, metavar="WD", help="default 5e-4")
    parser.add_argument(
        "--schedule",
        choices=["constant", "cosine", "step", "onecycle"],
        help="lr schedule (default cosine; onecycle: linear rise over --warmup, then linear fall to 0)",
    )
    parser.add_argument(
        "--warmup",
        type=finite_float,
        metavar="F",
        help="share of the run over which the lr rises linearly from 0 (default 0)",
    )
    _add_switch(parser, "--nesterov", "Nesterov momentum (default off)")
    parser.add_argument(
        "--label-smoothing", type=finite_float, metavar="E", help="cross-entropy label smoothing (default 0)"
    )
    parser.add_argument(
        "--ema",
        type=finite_float,
        metavar="DECAY",
        help="validate and keep an exponential moving average of the weights, this decay per step "
        "(e.g. 0.99; default 0: off)",
    )
    parser.add_argument(
        "--norm-bias-lr-scale",
        type=finite_float,
        metavar="X",
        help="multiply the lr of normalisation layers' biases by X and divide their weight decay by X "
        "(airbench uses 64; default 1)",
    )


def _add_augmentation(parser: argparse.ArgumentParser) -> None:
    """What the training images go through, the memory layout, and test-time mirroring."""
    parser.add_argument(
        "--amp",
        choices=["off", "bf16"],
        help="bf16: forward pass in bfloat16 (several times faster on AMX/AVX-512 CPUs and recent GPUs, "
        "emulated and many times slower on AVX2-only CPUs; weights stay float32; default off)",
    )
    parser.add_argument(
        "--augment",
        choices=["none", "crop", "flip", "crop+flip"],
        help="training augmentation (default: crop+flip for the natural photos of CIFAR-10/100; crop only for "
        "digits, text-free image folders and shards, where a mirrored image may be another class)",
    )
    parser.add_argument(
        "--padding", type=non_negative_int, metavar="PX", help="zero padding of random crops (default 4)"
    )
    parser.add_argument(
        "--cutout",
        type=non_negative_int,
        metavar="PX",
        help="hide a PX x PX square of every training image, at a random place, in the mean colour "
        "(cutout; default 0: none)",
    )
    _add_switch(
        parser,
        "--channels-last",
        "channels-last memory layout (faster convolutions on CPUs with oneDNN; the same results up to float rounding)",
    )
    _add_switch(parser, "--tta", "also report test accuracy averaged over each image and its mirror, apart")


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    """Where and how the run happens: seed, device, loading, processes, the run folder, output."""
    parser.add_argument("--seed", type=non_negative_int, metavar="S")
    add_device(parser, default=None)
    parser.add_argument("--workers", type=non_negative_int, metavar="N", help="DataLoader worker processes")
    parser.add_argument("--prefetch-factor", type=positive_int, metavar="N", help="batches prefetched per worker")
    _add_switch(parser, "--pin-memory", "pin host memory for faster copies to a CUDA GPU")
    add_out(parser, "run directory (default runs/MODEL-DATA or runs/CARD)", metavar="RUN_DIR")
    parser.add_argument(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="train with N data-parallel processes on this machine (as `torchrun --nproc-per-node N -m "
        "anytime train ...` does): the global batch is --batch-size, the cores are shared out",
    )
    parser.add_argument(
        "--sync-bn",
        action="store_true",
        help="with several processes, batch norm over the global batch, so they train the model one "
        "process would (two all-reduces per batch-norm layer and step); default: each process's "
        "own rows, as torch's DDP",
    )
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the interrupted run in --out, exactly")
    again.add_argument(
        "--extend",
        action="store_true",
        help="train the run in --out longer: to --epochs N (more than it has), the learning-rate "
        "schedule recomputed for the new length",
    )
    add_overwrite(again, "replace the earlier run in --out (only if the folder holds nothing but that run)")
    parser.add_argument("--update-card", action="store_true", help="write the measured results into the card")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(parser, "print the run's summary as JSON")


def _add_exits(group: argparse._ArgumentGroup) -> None:
    """Early exits: where they go, their heads, their losses."""
    add_exit_points(
        group,
        "attach exits: auto (after each stage), sdn (15-90%% of FLOPs), N (exits in all), "
        "fractions of FLOPs (0.25,0.5) or point names (stages.0,stages.1.2; see 'anytime exits')",
    )
    group.add_argument(
        "--exit-mode",
        choices=["joint", "heads-only"],
        help="joint: train everything (default); heads-only: only the exits, backbone frozen (needs --init)",
    )
    add_exit_head(
        group,
        "exit head design: pool (default), scaled, linear, conv, conv2 or msdnet; one per early exit "
        "(conv2,pool,pool); or graded (conv2, conv, pool by thirds of the FLOPs)",
    )
    group.add_argument(
        "--exit-weights",
        metavar="W,W,...",
        help="loss weight per exit (default: each exit's share of the backbone's FLOPs, as SDN)",
    )
    group.add_argument(
        "--distill",
        type=finite_float,
        metavar="WEIGHT",
        nargs="?",
        const=1.0,
        help="distil the last exit (or the widest slice) into the others: their cross-entropy plus this "
        "weight times the KL divergence to its softened output (1 if given alone; default 0)",
    )
    group.add_argument(
        "--distill-teacher",
        choices=["last", "later"],
        help="what each exit distils from: last (the last exit, default) or later (the mean of the "
        "softened outputs of every exit after it)",
    )
    _add_switch(
        group,
        "--gradient-equilibrium",
        "rescale gradients where exits branch off, so shared layers get the mean of the exits' "
        "gradients, not their sum (Li et al. 2019; default off)",
    )
    group.add_argument(
        "--init",
        metavar="CHECKPOINT",
        help="start the backbone from trained weights: a run folder, checkpoint.pt, .safetensors or state dict",
    )


def _add_sliced(group: argparse._ArgumentGroup) -> None:
    """Sliced networks, resolution ladders, SACT and stochastic depth."""
    group.add_argument(
        "--slices", metavar="R,R,...", help="train a sliced network, one step per fraction (e.g. 0.25,0.5,0.75,1.0)"
    )
    group.add_argument(
        "--slice-kind",
        choices=["width", "cardinality"],
        help="width: channels of every layer (ResNets, MobileNetV2, VGG); cardinality: groups of "
        "every ResNeXt block (default width)",
    )
    group.add_argument(
        "--sandwich",
        action="store_true",
        default=None,
        help="train the narrowest, the widest and one random slice per mini-batch, not all",
    )
    group.add_argument(
        "--resolutions",
        metavar="S,S,...",
        help="train a resolution ladder: one step per input size in pixels, cN a central N x N crop "
        "(e.g. 16,24,c24,32), batch-norm statistics per step",
    )
    group.add_argument(
        "--sact",
        metavar="T,T,...",
        help="train a SACT ResNet (spatially adaptive computation time): residual stages halt per "
        "position once its halting scores reach the threshold; one step per threshold, rising, "
        "the last one trained (e.g. 0.5,0.75,0.9,0.99)",
    )
    group.add_argument(
        "--sact-mode", choices=["spatial", "image"], help="halt per position (SACT, the default) or per image (ACT)"
    )
    group.add_argument(
        "--ponder-cost",
        type=finite_float,
        metavar="TAU",
        help="weight of the ponder cost in the loss: units run plus the remainder, averaged over "
        "positions and summed over stages (default 0.01)",
    )
    group.add_argument(
        "--stochastic-depth",
        type=finite_float,
        metavar="P",
        help="residual branches skipped at random in training, up to P for the last block",
    )


def _add_tickets(group: argparse._ArgumentGroup) -> None:
    """Lottery tickets: checkpoints kept for rewinding, and pruning a dense run."""
    group.add_argument(
        "--keep-checkpoints",
        metavar="K,K,...",
        help="keep the full checkpoint after these epochs (0: before the first), for tickets to rewind to",
    )
    group.add_argument(
        "--prune-from",
        metavar="RUN",
        help="train a lottery ticket: prune RUN's final weights (the dense run, or the ticket before)",
    )
    add_sparsity(group, "share of convolution and linear weights pruned, in all (e.g. 0.8)")
    add_reset_epoch(group, "rewind the surviving weights to the dense run's after K epochs (late resetting; 0: init)")
    group.add_argument(
        "--prune-unit",
        choices=["weights", "channels"],
        help="prune single weights (masked; the default) or whole channels (a smaller network)",
    )
    group.add_argument(
        "--prune-scope",
        choices=["global", "layer"],
        help="rank weights over all layers at once (default) or prune each layer alike",
    )


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` or ``option=VALUE``."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token == option:
            skip = True
        elif not token.startswith(option + "="):
            out.append(token)
    return out


def launch_train(args: argparse.Namespace) -> int:
    """Start ``--nproc`` training processes on this machine running the same command, and wait for them."""
    result = launch_local(without_option(args.argv, "--nproc"), args.nproc)
    if result.failed_rank is not None and (result.signalled or result.returncode not in (2, 130)):  # else it said why
        how = "was killed by a signal" if result.signalled else f"failed (exit status {result.returncode})"
        print_error("train", f"process {result.failed_rank} of {args.nproc} {how}, so the others were stopped; the "
                    "run keeps its last complete epoch: add --resume to the same command to continue")  # fmt: skip
    return result.returncode


def run(args: argparse.Namespace) -> int:
    """Train (or resume, or extend) the run in ``--out``, print its summary, and record it in the card if asked."""
    if args.nproc is not None and args.nproc > 1 and place_from_environment() is None:
        return launch_train(args)  # before torch is imported: the launcher only waits for the processes it starts
    from anytime.train import Trainer, load_card
    from anytime.train.defaults import DEFAULT_IMAGE_CARD, at_least_steps, default_card
    from anytime.train.distributed import from_environment
    from anytime.train.records import CHECKPOINT

    ctx = from_environment(sync_bn=args.sync_bn)
    main = ctx is None or ctx.main
    card = load_card(args.card) if args.card else None
    overrides = _overrides(args, card)
    notes: list[str] = []  # printed when training starts, after every check (an error stays one line)
    default_name = card.name if card else f"{overrides.get('model', 'lenet')}-{overrides.get('data', 'digits')}"
    if card is None and "model" not in overrides and not (args.resume or args.extend):
        card, note = default_card(overrides.get("data"))
        notes.append(note)
        default_name = f"{card.config.model}-{overrides.get('data', 'digits')}"  # runs/lenet-cifar10, as before
    run_dir = Path(args.out or Path("runs") / default_name.replace(":", "_"))
    config = _config(args, card, overrides, run_dir)
    splits = None
    if card is not None and card.name == DEFAULT_IMAGE_CARD and "epochs" not in overrides and not (
        args.resume or args.extend
    ):  # fmt: skip
        floor = at_least_steps(config)
        config, splits = floor.config, floor.splits
        notes += [floor.note] if floor.note else []
    if main and config.amp == "bf16":
        from anytime.utils.machine import bf16_emulated, resolve_device

        if bf16_emulated(resolve_device(config.device)):
            print("note: this CPU has no bfloat16 instructions (no AVX-512 or AMX), so --amp bf16 is emulated and "
                  "runs many times slower than float32 here; add --amp off", file=sys.stderr)  # fmt: skip
    trainer = Trainer(
        config, run_dir, progress=main and not args.no_progress and sys.stderr.isatty(),
        on_start=(lambda line: print("\n".join([*notes, line]), file=sys.stderr)) if main else None,
        extra_config={"card": str(card.path)} if card else {}, create_parents=args.out is None, distributed=ctx,
    )  # fmt: skip
    try:
        summary = trainer.fit(resume=args.resume, extend=args.extend, overwrite=args.overwrite, splits=splits)
        if not main:
            return 0
    except KeyboardInterrupt:
        if not main:
            return 130
        again = f"--extend --epochs {config.epochs}" if args.extend else "--resume"
        if (run_dir / CHECKPOINT).is_file():
            print(f"\ninterrupted; continue with: anytime train --out {run_dir} {again}", file=sys.stderr)
        else:
            print("\ninterrupted before the first epoch ended; nothing was kept", file=sys.stderr)
        return 130
    if args.json and not args.update_card:
        return print_json(summary.to_dict())
    print_train_summary(summary, run_dir)
    if args.update_card and card is not None:
        _record_in_card(card, summary)
    return 0


def _float_list(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise AnytimeError(f"{what} must be numbers separated by commas, e.g. 0.5,1,1 (got '{text}')") from None


def _overrides(args: argparse.Namespace, card: Any) -> dict[str, Any]:
    """The recipe's fields the options set, checked against --update-card and --extend."""
    from anytime.train import TrainConfig
    from anytime.train.cards import check_recordable

    overrides = {field: getattr(args, field) for field in _TRAIN_FIELDS if getattr(args, field) is not None}
    if args.sandwich:
        overrides["sandwich"] = True
    if args.exit_weights is not None:
        overrides["exit_weights"] = _float_list(args.exit_weights, "--exit-weights")
    if args.keep_checkpoints is not None:
        epochs = _float_list(args.keep_checkpoints, "--keep-checkpoints")
        if not all(e.is_integer() for e in epochs):
            raise AnytimeError(f"--keep-checkpoints are whole epochs, e.g. 0,2 (got {args.keep_checkpoints})")
        overrides["keep_checkpoints"] = tuple(sorted({int(e) for e in epochs}))
    if args.update_card and card is None:
        raise AnytimeError("--update-card needs --card FILE")
    if args.update_card and card is not None:
        check_recordable(card)
    if args.extend and "epochs" not in overrides:
        raise AnytimeError("--extend trains a run longer: give its new number of epochs with --epochs N")
    free = set(TrainConfig.RUNTIME_FIELDS) | ({"epochs"} if args.extend else set())
    changed = sorted(set(overrides) - free)
    if args.update_card and changed:
        named = ", ".join("--" + c.replace("_", "-") for c in changed)
        raise AnytimeError(f"--update-card records the card's own recipe, but {named} change it; drop those options "
                           "or edit the card")  # fmt: skip
    return overrides


def _config(args: argparse.Namespace, card: Any, overrides: dict[str, Any], run_dir: Path) -> Any:
    """The run's recipe: the interrupted run's (--resume, --extend), the card's or the defaults, then the options."""
    from anytime.train import TrainConfig, load_checkpoint
    from anytime.train.records import CHECKPOINT
    from anytime.train.trainer import require_checkpoint

    if args.resume or args.extend:
        saved = load_checkpoint(require_checkpoint(run_dir, "extend" if args.extend else "resume"))["config"]
        base = TrainConfig.from_dict(saved, where=str(run_dir / CHECKPOINT))
    else:
        base = card.config if card else TrainConfig()
    return base.replace(**overrides) if overrides else base


def _record_in_card(card: Any, summary: RunSummary) -> None:
    from anytime.train import record_results
    from anytime.utils.machine import cpu_model

    record, final = summary.record, summary.record["final"]
    record_results(card, {
        "val_acc": round(summary.val_acc, 4), "test_acc": round(summary.test_acc, 4),
        "best_val_acc": round(record["best_val_acc"], 4), "train_time_s": round(summary.train_time_s or 0.0, 1),
        "epochs": summary.epochs, "device": record["device"], "cpu": cpu_model(),
        "threads": record["torch_threads"], "date": date.today().isoformat(), "augment": record["augment"],
        **({"test_acc_tta": round(final["test_acc_tta"], 4)} if "test_acc_tta" in final else {}),
        **({"extended_from": record["extended"][0]["from_epochs"]} if record.get("extended") else {}),
        **({"baseline_test_acc": round(summary.baseline.test_acc, 4)} if summary.baseline is not None else {}),
    })  # fmt: skip
    print(f"card       results recorded in {card.path}")
