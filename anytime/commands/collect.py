"""``anytime collect``: run a trained multi-exit model once over a split and cache every exit's logits, which
``sweep``, ``calibrate`` and ``plot`` read."""

from __future__ import annotations

import argparse
import sys

from anytime.commands.options import add_batch_size, add_device, add_json, add_split
from anytime.commands.output import print_json

SUMMARY = "run a trained multi-exit model once over a split and cache every exit's logits"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime collect``."""
    parser.add_argument("run", metavar="RUN", help="a run directory written by 'anytime train --exits ...'")
    add_split(parser, ("val", "test", "dev"), default="val")
    add_device(parser)
    add_batch_size(parser, default=512)
    add_json(parser, "print what was collected as JSON")


def run(args: argparse.Namespace) -> int:
    """Collect the split's outputs and print each exit's accuracy."""
    from anytime.outputs import cache_path
    from anytime.tasks.collect import collect_run

    cache = collect_run(
        args.run, args.split, device=args.device, batch_size=args.batch_size, progress=sys.stderr.isatty()
    )
    acc = cache.step_accuracy()
    where = cache_path(args.run, args.split)
    if args.json:
        steps = [
            {"index": k, "name": n, "flops": int(cache.step_flops[k]), "accuracy": float(acc[k])}
            for k, n in enumerate(cache.step_names)
        ]
        return print_json({"cache": where, "split": args.split, "samples": cache.num_samples, "steps": steps})
    print(f"collected {cache.num_samples} {args.split} samples x {cache.num_steps} exits -> {where}")
    for k, name in enumerate(cache.step_names):
        share = 100 * cache.step_flops[k] / cache.base_flops
        print(f"  exit {k} {name:<16} {share:5.1f}% FLOPs  accuracy {100 * acc[k]:.2f}%")
    return 0
