"""anytime's temporary names (``.NAME.HOST.PID.RANDOM.tmp``, ``.partial`` and ``.old``) and lock files: how they are
made, read back into the path a user knows, and cleaned up after processes that died."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
from pathlib import Path

LOCK_SUFFIX = ".anytime-lock"
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.(?P<rand>[A-Za-z0-9_]+)\."
                   r"(?P<kind>tmp|partial|old)$")  # fmt: skip


def host_tag() -> str:
    """This machine's name as it appears in temporary names (dots replaced)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname() or "host")[:40] or "host"


def temp_prefix(name: str) -> str:
    """The start of a temporary name for ``name`` owned by this process: ``.NAME.HOST.PID.``."""
    return f".{name}.{host_tag()}.{os.getpid()}."


def user_path(path: str | os.PathLike[str]) -> str:
    """The path a user knows for a path through our temporary names (what each was about to become)."""
    parts = []
    for part in Path(os.fspath(path)).parts:
        match = _TEMP.match(part)
        parts.append(match["name"] if match else part)
    return str(Path(*parts)) if parts else os.fspath(path)


def is_temporary(name: str) -> bool:
    """True for the names anytime gives its temporary files, staged folders and lock files."""
    return bool(_TEMP.match(name)) or (name.startswith(".") and name.endswith(LOCK_SUFFIX))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files and folders that dead processes of this host left in ``folder``, and lock
    files nobody holds; return what was removed. Names that are not anytime's are never touched."""
    removed: list[Path] = []
    here = host_tag()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        path = Path(entry.path)
        if match and match["host"] == here and int(match["pid"]) != os.getpid() and not _alive(int(match["pid"])):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed.append(path)
        elif entry.name.startswith(".") and entry.name.endswith(LOCK_SUFFIX) and entry.is_file(follow_symlinks=False):
            if _remove_free_lock(path):
                removed.append(path)
    return removed


def _remove_free_lock(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            os.unlink(path)
            return True
        return False
    except OSError:
        return False
    finally:
        os.close(fd)
