"""Results folders that appear complete or not at all, with the context that made them."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, git_sha


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh sibling folder to fill; it replaces ``target`` only if the block succeeds.

    Earlier results in ``target`` survive a failed or interrupted run untouched.
    """
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    work.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_study_config(
    folder: Path, *, study: str, hyper: dict[str, Any], data_path: str | os.PathLike[str] | None = None,
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
