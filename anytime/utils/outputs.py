"""Where commands write: one policy for every output location, a lock per output against concurrent writers,
and the clean-up of temporary files that killed processes left behind.

The policy, checked before any computing:

- An output **folder** (a run, a study's results, the demo, a cut study) must be new, an empty folder, or a
  folder anytime wrote for the same purpose. anytime marks the folders it writes with ``.anytime.json`` (its
  kind and the entries it wrote). A marked folder is resumed or extended (runs), or replaced when the user
  passes ``--overwrite``, and only while it holds nothing but what anytime wrote there.
- An output **file** must not be a folder; its folder must exist (or be anytime's own default) and be
  writable; a file already there is replaced only when it is an anytime file of the same kind.
- Nothing a command did not create is ever renamed, moved or deleted.

Temporary names carry the host and process id (``.NAME.HOST.PID.RANDOM.tmp``); a later command removes those
of dead processes of this host from the folders it writes.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from anytime.errors import AnytimeError
from anytime.utils.figure_sizes import FIGURE_SIZES
from anytime.utils.tempnames import LOCK_SUFFIX, host_tag, is_temporary, remove_stale, temp_prefix

MARKER = ".anytime.json"
MARKER_FORMAT = "anytime-output-v1"

# What a run folder may hold: everything `anytime train` and the commands that extend a run write there.
RUN_ENTRIES: tuple[str, ...] = (
    MARKER, "config.json", "checkpoint.pt", "model.safetensors", "quant.safetensors", "summary.json", "metrics.csv",
    "iterations.csv", "mask.safetensors", "checkpoint-epoch*.pt",
    "outputs", "plots", "cut", "profile-*.json", "calibration*.json", "sweep-*.csv", "sweep-*.json",
    "evaluation-*.json", "report.html",
)  # fmt: skip
RUN = "run"

# ---- locks ---------------------------------------------------------------------------------------------------


def _lock_file(target: Path) -> Path:
    beside = target.parent / f".{target.name}{LOCK_SUFFIX}"
    if target.is_dir() and not os.access(target.parent, os.W_OK):
        return target / LOCK_SUFFIX
    return beside


@contextlib.contextmanager
def output_lock(target: str | os.PathLike[str], *, command: str = "") -> Iterator[None]:
    """Hold the lock of one output (a file or a folder) for the block; a second writer is refused at once
    with the first one's process id. The lock dies with its process, and its file is removed on release."""
    path = _lock_file(Path(target))
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # the file may be removed by its holder between our open and our lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = _lock_holder(path)
            raise AnytimeError(
                f"another anytime process{holder} is writing {target}; wait for it to finish or choose another output"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise AnytimeError(f"could not lock {target}: its lock file keeps changing; is another process writing it?")
    try:
        with contextlib.suppress(OSError):  # on a full disk the lock still holds; only the holder's name is lost
            os.ftruncate(fd, 0)
            os.write(
                fd,
                json.dumps({"pid": os.getpid(), "host": host_tag(), "command": command or " ".join(sys.argv)}).encode(),
            )
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _lock_holder(path: Path) -> str:
    try:
        doc = json.loads(path.read_text())
        command = f", `{doc['command']}`" if doc.get("command") else ""
        return f" (pid {int(doc['pid'])} on {doc['host']}{command})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


# ---- markers -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """What ``.anytime.json`` says of a folder: its kind and the entries (names or patterns) anytime wrote."""

    kind: str
    entries: tuple[str, ...]

    def owns(self, name: str) -> bool:
        """True if ``name`` (an entry of the folder, a file or a sub-folder) is one anytime wrote there."""
        # A run made by an earlier version also owns what runs hold today (a page added later, say).
        patterns = self.entries + (RUN_ENTRIES if self.kind == RUN else ())
        return (
            name == MARKER
            or is_temporary(name)
            or any(fnmatch.fnmatchcase(name, p) or p.startswith(f"{name}/") for p in patterns)
        )


def write_marker(folder: str | os.PathLike[str], kind: str, entries: Sequence[str]) -> Path:
    """Mark ``folder`` as anytime's own, of ``kind``, holding ``entries``."""
    from anytime.utils.io import write_json

    return write_json(Path(folder) / MARKER, {"format": MARKER_FORMAT, "kind": kind, "entries": sorted(set(entries))})


def read_marker(folder: str | os.PathLike[str]) -> Marker | None:
    """The folder's marker; legacy runs (written before markers) are recognised by their files."""
    path = Path(folder) / MARKER
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") == MARKER_FORMAT:
                return Marker(str(doc["kind"]), tuple(str(e) for e in doc["entries"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None
    if (Path(folder) / "config.json").is_file() and any(
        (Path(folder) / name).is_file() for name in ("checkpoint.pt", "model.safetensors")
    ):
        return Marker(RUN, RUN_ENTRIES)
    return None


# ---- the policy ----------------------------------------------------------------------------------------------


class DirState(enum.Enum):
    """What an output folder is before a command writes it."""

    NEW = "new"  # nothing there yet
    EMPTY = "empty"  # an existing empty folder (the user's: kept, filled)
    OURS = "ours"  # a folder anytime wrote, of the same kind, holding nothing else


def _check_parent(path: Path, flag: str, create_parents: bool) -> None:
    parent = path.parent
    ancestor = parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    where = f"{flag} {path}" if flag else str(path)
    advice = f"choose another {flag}" if flag else "move it away or fix the run folder"
    if ancestor.exists() and not ancestor.is_dir():
        raise AnytimeError(f"{where}: {ancestor} is a file, so nothing can be written below it; {advice}")
    if ancestor != parent and not create_parents:
        raise AnytimeError(f"{where}: the folder {parent} does not exist; create it first or {advice}")
    probe_writable(ancestor, flag=flag, given=path)


def probe_writable(folder: Path, *, flag: str = "--out", given: Path | None = None) -> None:
    """Refuse, in one line, a folder this process cannot create files in (read-only, no permission, full)."""
    try:
        fd, name = tempfile.mkstemp(prefix=temp_prefix("probe"), suffix=".tmp", dir=folder)
    except OSError as exc:
        what = (f"{flag} {given}: " if flag else f"{given}: ") if given is not None else ""
        advice = (
            f"fix its permissions or free space, or choose another {flag}"
            if flag
            else "fix its permissions or free space"
        )
        raise AnytimeError(f"{what}cannot write in {folder} ({exc.strerror or exc}); {advice}") from None
    os.close(fd)
    os.unlink(name)


def check_output_dir(
    path: str | os.PathLike[str], kind: str, *, flag: str = "--out", create_parents: bool = True
) -> DirState:
    """Check an output folder before any work: see the module's policy. Returns whether it is new, an empty
    folder, or anytime's own of ``kind``; anything else is a one-line :class:`AnytimeError` naming ``path``."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise AnytimeError(
            f"{flag} {target} is a file, not a folder; give a new folder name (anytime never replaces a file)"
        )
    if not target.exists():
        _check_parent(target, flag, create_parents)
        return DirState.NEW
    probe_writable(target, flag=flag, given=target)
    names = sorted(e for e in os.listdir(target) if not is_temporary(e))
    if not names:
        return DirState.EMPTY
    marker = read_marker(target)
    if marker is None:
        raise AnytimeError(
            f"{flag} {target} already holds files anytime did not write (e.g. {names[0]}); choose a new or empty folder"
        )
    if marker.kind != kind:
        raise AnytimeError(f"{flag} {target} holds a {marker.kind}, not a {kind}; choose another folder")
    strays = _strays(target, marker)
    if strays:
        raise AnytimeError(
            f"{flag} {target} holds a {kind} and also files anytime did not write (e.g. {strays[0]}); "
            "anytime will not replace it: choose another folder"
        )
    return DirState.OURS


def check_output_file(
    path: str | os.PathLike[str], *, what: str, format_tag: str | None = None, flag: str = "--out",
    create_parents: bool = True, example: str = "result.json",
) -> Path:  # fmt: skip
    """Check an output file before any work: not a folder, its folder writable (and existing, unless
    ``create_parents``), and an existing file replaced only if it is an anytime ``what`` (its ``format_tag``)."""
    target = Path(path)
    label = f"{flag} {target}" if flag else str(target)
    if target.is_symlink():
        if not target.exists():
            raise AnytimeError(f"{label} is a symbolic link to nothing ({os.readlink(target)}); give a real file name")
        target = target.resolve()  # written where the link points, the link kept
    if target.is_dir():
        raise AnytimeError(f"{label} is a folder; give the {what} a file name, e.g. {target / example}")
    if target.exists() and not target.is_file():
        raise AnytimeError(f"{label} is not a regular file (a pipe or a device); give a file name")
    if target.exists():
        if format_tag is not None and not _has_format(target, format_tag):
            raise AnytimeError(
                f"{label} exists and is not an anytime {what}; anytime never overwrites a file it did not "
                "write: choose another file name"
            )
        probe_writable(target.parent, flag=flag, given=target)
        return target
    _check_parent(target, flag, create_parents)
    return target


def _has_format(path: Path, tag: str) -> bool:
    """Whether ``path`` is anytime's file of ``tag``: a JSON document with that ``format``, or an HTML page with
    that ``generator``."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 20)
        if head.lstrip()[:15].lower() == b"<!doctype html>":
            return f'<meta name="generator" content="{tag}">'.encode() in head[:4096]
        doc = json.loads(head)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == tag


# What the run's own sub-folders hold, and their own folders (the cut study's folder is marked as its own):
# plots/ keeps the figures drawn at a paper's size in a folder named after it.
_RUN_SUBFOLDERS = {
    "outputs": (("*.npz",), ()),
    "plots": (("*.png", "*.svg", "*.pdf"), tuple(name for name in FIGURE_SIZES if name != "screen")),
}


def _strays(folder: Path, marker: Marker) -> list[str]:
    """Everything below ``folder`` that ``marker`` does not own, sub-folders included: a sub-folder with a
    marker of its own is checked against it, a run's ``outputs`` and ``plots`` against what they hold, any
    other against the files recorded when the results were staged."""
    strays: list[str] = []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        if name == MARKER or is_temporary(name):
            continue
        if not marker.owns(name):
            strays.append(name)
        elif path.is_dir() and not path.is_symlink():
            inner = read_marker(path)
            if inner is not None:
                strays += [f"{name}/{n}" for n in _strays(path, inner)]
                continue
            patterns, nested = _RUN_SUBFOLDERS.get(name, (None, ())) if marker.kind == RUN else (None, ())
            for file in sorted(p for p in path.rglob("*") if not p.is_dir()):
                relative = file.relative_to(folder).as_posix()
                if is_temporary(file.name):
                    continue
                if patterns is not None:
                    at_home = file.parent == path or (file.parent.parent == path and file.parent.name in nested)
                    ours = at_home and any(fnmatch.fnmatchcase(file.name, p) for p in patterns)
                else:  # the files recorded, or anything below an entry NAME/** (a folder anytime fills freely)
                    ours = relative in marker.entries or any(
                        e.endswith("/**") and relative.startswith(e[:-2]) for e in marker.entries
                    )
                if not ours:
                    strays.append(relative)
    return strays


def clear_run(folder: str | os.PathLike[str]) -> None:
    """Remove what ``anytime train`` and the pipeline wrote in a run folder (``--overwrite``), nothing else;
    the caller has checked with :func:`check_output_dir` that nothing else is there."""
    target = Path(folder)
    marker = read_marker(target) or Marker(RUN, RUN_ENTRIES)
    for entry in os.listdir(target):
        if entry == MARKER or is_temporary(entry) or not marker.owns(entry):
            continue
        path = target / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def refuse_existing(target: Path, kind: str, flag: str = "--out") -> AnytimeError:
    """The error for a folder that already holds anytime's results of ``kind`` when --overwrite was not given."""
    return AnytimeError(
        f"{flag} {target} holds an earlier {kind}; pass --overwrite to replace it, or choose another folder"
    )


def check_replaceable(
    target: str | os.PathLike[str], kind: str, *, overwrite: bool = False, flag: str = "--out",
    create_parents: bool = True,
) -> DirState:  # fmt: skip
    """:func:`check_output_dir`, and an earlier result of ``kind`` is refused unless ``overwrite`` allows it."""
    state = check_output_dir(target, kind, flag=flag, create_parents=create_parents)
    if state is DirState.OURS and not overwrite:
        raise refuse_existing(Path(target), kind, flag)
    return state


@contextlib.contextmanager
def staged_dir(
    target: str | os.PathLike[str], kind: str, *, overwrite: bool = False, flag: str = "--out",
    create_parents: bool = True, entries: Sequence[str] | None = None,
) -> Iterator[Path]:  # fmt: skip
    """Check ``target`` (the policy above), lock it, and yield a fresh folder to fill. When the block succeeds
    the results take ``target``'s place: a new folder, the contents of the user's empty folder, or (with
    ``overwrite``) the replacement of anytime's earlier results of the same kind. A failed or interrupted
    block leaves ``target`` as it was and removes the staged folder. The marker records ``entries`` (names or
    patterns) as anytime's own, by default what the block wrote."""
    final = Path(target)
    check_replaceable(final, kind, overwrite=overwrite, flag=flag, create_parents=create_parents)
    final.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(final):
        remove_stale(final.parent)
        work = Path(tempfile.mkdtemp(prefix=temp_prefix(final.name), suffix=".partial", dir=final.parent))
        try:
            yield work
            written = [p.relative_to(work).as_posix() for p in work.rglob("*") if not p.is_dir()]
            written = [name for name in written if name != MARKER]  # nested runs keep their own markers
            write_marker(work, kind, entries if entries is not None else written)
            _put_in_place(work, final, kind, flag)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _put_in_place(work: Path, final: Path, kind: str, flag: str) -> None:
    os.chmod(work, 0o777 & ~_umask())  # mkdtemp made it private; results get a plain mkdir's permissions
    state = check_output_dir(final, kind, flag=flag)  # again: the user may have put something there meanwhile
    if state is DirState.NEW:
        os.rename(work, final)
    elif state is DirState.EMPTY:
        for name in os.listdir(work):
            os.rename(work / name, final / name)
    else:
        old = Path(tempfile.mkdtemp(prefix=temp_prefix(final.name), suffix=".old", dir=final.parent))
        os.rmdir(old)
        os.rename(final, old)
        os.rename(work, final)
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_files(folder: str | os.PathLike[str], kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``folder``; when the block succeeds, every file written there is moved
    into ``folder`` (replacing files of the same names). A failed block writes nothing into ``folder``. Given
    ``kind``, ``folder`` is a user's output folder: marked as anytime's ``kind`` holding what was moved in (so that
    :func:`check_output_dir` lets a later command of that kind replace it, and nobody else's files)."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent)
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(final.name), suffix=".partial", dir=final.parent))
    try:
        yield work
        final.mkdir(exist_ok=True)
        names = sorted(os.listdir(work))
        for name in names:
            os.replace(work / name, final / name)
        if kind is not None:
            earlier = read_marker(final)
            write_marker(final, kind, [*names, *(earlier.entries if earlier and earlier.kind == kind else ())])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_figure_folder(folder: Path, first: str, *, kind: str, given: bool) -> None:
    """Check where a figure command writes before any work: a folder the user gave (``given``) must be new, empty
    or anytime's of ``kind`` (see :func:`check_output_dir`); the run's own default folder only has to take
    ``first``, the first file written there."""
    if given:
        check_output_dir(folder, kind)
    else:
        check_output_file(folder / first, what=kind, flag="")
