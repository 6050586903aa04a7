"""The record written beside a study's results: its hyper-parameters and the context that made them."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, drop_page_cache, git_sha
from anytime.utils.outputs import check_replaceable


def study_parser(name: str, description: str, *, drops_caches: bool = False) -> argparse.ArgumentParser:
    """The options every study takes: ``--quick``, ``--out DIR`` (default ``results/NAME``), ``--overwrite``
    and, for studies that read from disk, ``--drop-caches``."""
    parser = argparse.ArgumentParser(prog=f"anytime experiment {name}", description=description)
    parser.add_argument("--quick", action="store_true", help="a few minutes on a laptop-class CPU")
    parser.add_argument("--out", help=f"results folder (default results/{name})")
    parser.add_argument("--overwrite", action="store_true", help="replace this study's earlier results in --out")
    if drops_caches:
        parser.add_argument(
            "--drop-caches",
            action="store_true",
            help="drop the OS page cache before reading from disk (root; affects the whole machine)",
        )
    return parser


def study_output(args: argparse.Namespace, name: str) -> tuple[Path, bool]:
    """The study's results folder, checked before any work, and whether its parents may be created (only
    for the default ``results/NAME``)."""
    out = Path(args.out) if args.out else Path("results") / name
    check_replaceable(out, f"{name} study", overwrite=args.overwrite, create_parents=args.out is None)
    return out, args.out is None


def page_cache_note(args: argparse.Namespace) -> str:
    """Drop the page cache only when ``--drop-caches`` asks for it; the sentence for the study's record."""
    if not getattr(args, "drop_caches", False):
        return "page cache not dropped (pass --drop-caches to drop it first; it affects the whole machine)"
    return drop_page_cache()[1]


def write_study_config(
    folder: Path,
    *,
    study: str,
    hyper: dict[str, Any],
    data_path: str | os.PathLike[str] | None = None,
    notes: list[str] | None = None,
) -> Path:
    """Write ``config.json``: the study's hyper-parameters, git SHA, machine, command line and date."""
    return write_json(
        folder / "config.json",
        {
            "study": study,
            "hyper_parameters": hyper,
            "git_sha": git_sha(),
            "command": " ".join(sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": describe_machine(data_path),
            "notes": notes or [],
        },
    )
