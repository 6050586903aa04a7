"""``anytime models``: the model zoo and torchvision's classifiers, with their parameter counts (and FLOPs)."""

from __future__ import annotations

import argparse
from typing import Any

from anytime.commands.options import add_json
from anytime.commands.output import print_json

SUMMARY = "list the model zoo and torchvision classifiers, with parameter counts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime models``."""
    parser.add_argument("--no-torchvision", action="store_true", help="list only the zoo")
    parser.add_argument("--flops", action="store_true", help="also count forward FLOPs per 32x32 image (slower)")
    add_json(parser, help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """List the models as a table, or as JSON."""
    from anytime.backbones import get_spec, list_models, model_modality
    from anytime.backbones.registry import model_costs

    rows: list[dict[str, Any]] = []
    names = list_models(include_torchvision=not args.no_torchvision)
    for name, cost in zip(names, model_costs(names, count_flops=args.flops), strict=False):
        family = "torchvision" if name.startswith("tv:") else get_spec(name).family
        description = "" if name.startswith("tv:") else get_spec(name).description
        rows.append({"name": name, "family": family, "modality": model_modality(name), "parameters": cost.parameters,
                     "flops": cost.flops, "description": description})  # fmt: skip
    if args.json:
        return print_json(rows)
    header = f"{'model':<24} {'family':<13} {'params':>9}" + (f" {'MFLOPs':>9}" if args.flops else "")
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['name']:<24} {r['family']:<13} {r['parameters'] / 1e6:>8.2f}M"
        if args.flops:
            line += f" {r['flops'] / 1e6:>9.1f}" if r["flops"] is not None else f" {'n/a':>9}"
        print(line)
    if args.flops:
        print(f"\n{len(rows)} models; parameters for 10 classes, 3 input channels; FLOPs per 32x32 image, a "
              "multiply-add counted as 2")  # fmt: skip
    else:
        print(f"\n{len(rows)} models")
    return 0
