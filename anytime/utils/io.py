"""Atomic writes: a result file is either the old one or the complete new one, never half-written."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from anytime.errors import AnytimeError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only if the block succeeds.

    The temporary name carries this host and process id, and it is removed on any exit the process survives;
    the temporary files of dead processes in the same folder are removed first. A failure to write (no space,
    no permission) is reported as an :class:`AnytimeError` that names ``path``, never the temporary file.
    """
    from anytime.utils.tempnames import remove_stale, temp_prefix

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent)
        fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise write_error(target, exc) from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            yield tmp
        except AnytimeError:
            raise
        except Exception as exc:  # noqa: BLE001  the block only writes: torch, safetensors and numpy fail in their own ways
            raise write_error(target, exc) from None
        # mkstemp creates 0600 files; results and checkpoints get the permissions a plain open() would give.
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, target)
        except OSError as exc:
            raise write_error(target, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


class DiskFullError(AnytimeError):
    """A result could not be written because its file system is full (or over quota)."""


def write_error(target: Path, exc: BaseException) -> AnytimeError:
    """The one-line error for a failed write of ``target``: the path, the reason and, when the disk is full,
    the free space left."""
    from anytime.utils.resources import format_bytes, free_space
    from anytime.utils.tempnames import user_path

    code = getattr(exc, "errno", None)
    free = free_space(target.parent)
    target = Path(user_path(target))  # a file inside a staged folder is named where it will be
    if code in (errno.ENOSPC, errno.EDQUOT) or not isinstance(exc, OSError):
        if code in (errno.ENOSPC, errno.EDQUOT) or free < 64 * 2**20 or "space" in str(exc).lower():
            return DiskFullError(
                f"no space left to write {target} ({format_bytes(free)} free on its file system); "
                "free some space or write elsewhere"
            )
        return AnytimeError(f"could not write {target} ({str(exc).splitlines()[0]}); check the disk and try again")
    if isinstance(exc, IsADirectoryError) or target.is_dir():
        return AnytimeError(f"{target} is a folder, not a file; choose another path")
    reason = getattr(exc, "strerror", None) or str(exc)
    return AnytimeError(f"could not write {target} ({reason}); check the folder's permissions or choose another path")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; it replaces ``path`` when the block exits cleanly."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically and return the path."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return Path(path)


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


def write_csv(
    path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> Path:
    """Write ``rows`` (dicts) as CSV with a header, atomically; ``columns`` defaults to the first row's keys."""
    header = list(columns) if columns is not None else list(rows[0]) if rows else []
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _csv_cell(row.get(key)) for key in header})
    return write_text(path, buffer.getvalue())


def read_json(path: str | os.PathLike[str], *, what: str, make: str, redo: str) -> Any:
    """A JSON document the pipeline wrote; a missing or unparsable file is a one-line error that says how to
    ``make`` it (when missing) or ``redo`` it (when broken)."""
    target = Path(path)
    if not target.is_file():
        raise AnytimeError(f"no {what} at {target}; {make}")
    try:
        return json.loads(target.read_text())
    except ValueError:
        raise AnytimeError(f"{target} is not valid JSON; {redo}") from None


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML file, or a one-line error saying it is not valid TOML."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10 (JetPack 6): the same parser, published as tomli
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AnytimeError(f"{path} is not valid TOML ({exc})") from None


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The rows of a CSV file with a header, as dicts of strings."""
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def json_default(value: Any) -> Any:
    """What ``json`` cannot write on its own: paths as strings, numpy and torch scalars and arrays as numbers and
    lists, dataclasses (the results the library returns) as dicts."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")
