"""``anytime exits``: the exits ``attach_exits`` puts on a model (or every point it can exit after), with the
cumulative FLOPs and parameters of each."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_exit_head, add_exit_points, add_json, int_at_least, positive_int
from anytime.commands.output import print_json
from anytime.utils.resources import check_input_memory

SUMMARY = "show the exits attach_exits puts on a model, with cumulative FLOPs and parameters"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime exits``."""
    parser.add_argument("model", metavar="MODEL", help="a zoo name or tv:NAME")
    add_exit_points(parser, "exit points (default auto)", default="auto")
    add_exit_head(parser, "pool, scaled, linear, conv, conv2 or msdnet; one per early exit; or graded", default="pool")
    parser.add_argument("--in-channels", type=positive_int, default=3, metavar="C")
    parser.add_argument("--num-classes", type=int_at_least(2), default=10, metavar="N")
    parser.add_argument("--image-size", type=positive_int, default=32, metavar="PX")
    parser.add_argument("--points", action="store_true", help="list every point the model can exit after")
    add_json(parser)


def run(args: argparse.Namespace) -> int:
    """Build the model on an input of the asked size and print its exits (or its exit points)."""
    from anytime.backbones import create_model, example_input, model_modality
    from anytime.backbones.footprint import check_forward_memory
    from anytime.families import attach_exits
    from anytime.families.tracing import split_points

    shape: tuple[int, ...] = (args.in_channels, args.image_size, args.image_size)
    size = f"a {args.image_size}x{args.image_size} input"
    if model_modality(args.model) == "text":  # a sentence of the encoder's maximum length
        backbone = create_model(args.model, num_classes=args.num_classes)
        shape, size = (int(backbone.max_length),), f"{backbone.max_length} tokens"
    else:
        check_input_memory(shape, 1, what=size, hint="choose a smaller --image-size")
        backbone = create_model(args.model, num_classes=args.num_classes, in_channels=args.in_channels)
    check_forward_memory(backbone, shape, 1, what=f"{args.model} on {size}", hint="choose a smaller --image-size")
    if args.points:
        chain = split_points(backbone, example_input(shape, 1, tokens=len(shape) == 1))
        rows = [{"name": c.name, "shape": list(c.shape), "flops_fraction": c.flops / chain.total_flops,
                 "stage_end": c.stage_end} for c in chain.cuts]  # fmt: skip
        if args.json:
            return print_json(rows)
        print(f"{'point':<34} {'features':<16} {'FLOPs so far':>12}  stage end")
        for r in rows:
            print(f"{r['name']:<34} {'x'.join(map(str, r['shape'])):<16} {100 * r['flops_fraction']:>11.1f}%  "
                  f"{'yes' if r['stage_end'] else ''}")  # fmt: skip
        return 0
    model = attach_exits(backbone, args.exits, head=args.exit_head, num_classes=args.num_classes, input_shape=shape)
    if args.json:
        exits = [e.to_dict() for e in model.exit_info]
        return print_json({"model": args.model, "points": args.exits, "head": args.exit_head,
                           "backbone_flops": model.backbone_flops, "exits": exits})  # fmt: skip
    base = model.backbone_flops
    print(f"{args.model} with {model.num_steps} exits ({args.exit_head} heads), {size}")
    print(f"{'exit':<5} {'point':<30} {'features':<12} {'MFLOPs':>9} {'of base':>8} {'params':>10} "
          f"{'head':<7} {'head MFLOPs':>12} {'head params':>12}")  # fmt: skip
    for e in model.exit_info:
        print(f"{e.index:<5} {e.name:<30} {'x'.join(map(str, e.shape)):<12} {e.flops / 1e6:>9.2f} "
              f"{100 * e.flops / base:>7.1f}% {e.params:>10,} {e.head or '-':<7} {e.head_flops / 1e6:>12.3f} "
              f"{e.head_params:>12,}")  # fmt: skip
    print(
        f"FLOPs for one {'sentence' if len(shape) == 1 else 'image'}, a multiply-add counted as 2; cumulative: the "
        "backbone up to the exit and its head"
    )
    return 0
