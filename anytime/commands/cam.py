"""``anytime cam``: class activation maps of every step for the same images (CAM for global-pooled heads, Grad-CAM
otherwise): a figure side by side, and the arrays."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_device, add_images, add_json, add_out, add_steps, step_list
from anytime.commands.output import print_json

SUMMARY = (
    "class activation maps of every step (CAM for global-pooled heads, Grad-CAM otherwise) for the same images: "
    "a figure side by side and the arrays"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime cam``."""
    parser.usage = "anytime cam RUN (--images FILE [FILE ...] | --split test [--count N]) [options]"
    parser.add_argument("run", metavar="RUN")
    add_images(parser)
    add_steps(parser, "the steps to map (default every one)")
    parser.add_argument(
        "--explain",
        choices=["predicted", "label"],
        default="predicted",
        help="map the class each step answered (default) or the true class (--split only)",
    )
    add_device(parser)
    add_out(parser, "default RUN/cam (cam.png/.svg, cam.npz, cam.json, replaced together)")
    add_json(parser, "print the files and the method of each step as JSON")


def run(args: argparse.Namespace) -> int:
    """Draw the maps; print each step's method and the files written."""
    from anytime.tasks.cam import cam_run

    report = cam_run(args.run, images=args.images, split=args.split, count=args.count, steps=step_list(args.steps),
                     explain=args.explain, out=args.out, device=args.device)  # fmt: skip
    if args.json:
        return print_json(report)
    for entry in report.steps:
        print(f"{entry['name']}: {entry['method']} on {entry['layer']}")
    for path in report.paths:
        print(path)
    return 0
