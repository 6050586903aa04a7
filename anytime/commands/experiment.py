"""``anytime experiment``: run one of the studies in experiments/ (a source checkout's), at a figure size, its
results.json printed as JSON where asked."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from anytime.commands.options import FIGURE_SIZE_HELP, add_device, add_figure_size, add_json, add_out, add_overwrite
from anytime.errors import AnytimeError

SUMMARY = (
    "run a study from experiments/ (batch-time, memory, time-accuracy, residual-cutting, precision, "
    "ensemble-baselines, ensembles, lottery)"
)


def experiments_dir() -> Path:
    """The folder of the studies: experiments/ beside the package, in a source checkout."""
    return Path(__file__).resolve().parents[2] / "experiments"


def _experiment_names() -> list[str]:
    folder = experiments_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem.replace("_", "-") for p in folder.glob("*.py") if not p.name.startswith("_"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime experiment`` (the studies it names are those found now)."""
    parser.add_argument("name", metavar="NAME", help="one of: " + ", ".join(_experiment_names()))
    parser.add_argument("--quick", action="store_true", help="a few minutes on a laptop-class CPU")
    add_out(parser, "results folder (default results/NAME)")
    add_overwrite(parser, "replace the study's earlier results in --out")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="studies that read from disk (batch-time, memory, time-accuracy): drop the OS page "
        "cache first (root; it affects the whole machine)",
    )
    add_device(parser, "studies that time a device (precision): cpu (default) or cuda[:N]", default=None)
    add_figure_size(parser, FIGURE_SIZE_HELP + " (default screen)")
    add_json(parser, "print the study's results.json (its progress goes to stderr)")


def run(args: argparse.Namespace) -> int:
    """Load the study's module and run its ``main`` with the options it takes; returns its exit status."""
    names = _experiment_names()
    if args.name not in names:
        where = experiments_dir()
        hint = (
            f"one of: {', '.join(names)}" if names else f"no experiments found in {where} (run from a source checkout)"
        )
        raise AnytimeError(f"unknown experiment '{args.name}'; {hint}")
    path = experiments_dir() / f"{args.name.replace('-', '_')}.py"
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
