"""Starting data-parallel training on this machine (`anytime train --nproc N`), as torchrun would: the
processes' environment, the launch, and who failed first. Nothing here imports torch, so that the launching
process starts in a fraction of a second and leaves the cores to the processes it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from anytime.errors import AnytimeError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def place_from_environment(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from the variables torchrun (or SLURM through torchrun) sets; None when
    the process runs alone (no ``WORLD_SIZE``, or a world of one)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        rank, world, local = (int(env.get(name, "0")) for name in _ENV)
    except ValueError:
        raise AnytimeError(f"RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers (got "
                           f"{', '.join(f'{n}={env.get(n)!r}' for n in _ENV)})") from None  # fmt: skip
    if world < 1 or not 0 <= rank < world:
        raise AnytimeError(f"RANK {rank} is not within WORLD_SIZE {world}; start the processes with torchrun")
    return None if world == 1 else (rank, world, local)


@dataclass(frozen=True)
class LaunchResult:
    """How a local launch of ``nproc`` processes ended."""

    returncode: int
    failed_rank: int | None  # the first process that failed, None when all succeeded
    signalled: bool  # the failed process was killed by a signal rather than exiting with an error


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(
    rank: int, nproc: int, port: int, *, threads: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables torchrun would give process ``rank`` of ``nproc`` on one machine."""
    env = dict(os.environ if base is None else base)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def launch_local(
    argv: Sequence[str],
    nproc: int,
    *,
    threads: int | None = None,
    poll_s: float = 0.2,
    grace_s: float = 10.0,
    program: Sequence[str] | None = None,
) -> LaunchResult:
    """Run ``python -m anytime ARGV`` (or ``program ARGV``) as ``nproc`` data-parallel processes on this machine,
    as torchrun would.

    Each process gets the cores divided among them as threads (unless ``OMP_NUM_THREADS`` is set). When one
    fails, the others are stopped (SIGTERM, then SIGKILL after ``grace_s``): a run stopped that way keeps its
    last complete epoch and continues with ``--resume``.
    """
    if nproc < 1:
        raise AnytimeError(f"--nproc must be at least 1 (got {nproc})")
    from anytime.utils.threads import usable_cores

    threads = threads or max(1, usable_cores() // nproc)
    port = free_port()
    command = [sys.executable, "-m", "anytime"] if program is None else list(program)
    procs = [
        subprocess.Popen([*command, *argv],
                         env=rank_environment(rank, nproc, port, threads=threads))
        for rank in range(nproc)
    ]  # fmt: skip
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = first_failure(codes)
            if failed is not None or None not in codes:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGINT, grace_s)
        raise
    finally:  # also when this process is itself terminated: no trainer is left writing the run
        _stop(procs, signal.SIGTERM, grace_s)
    if failed is None:
        return LaunchResult(0, None, False)
    code = procs[failed].returncode
    return LaunchResult(code if code > 0 else 128 - code, failed, code < 0)


def first_failure(codes: Sequence[int | None]) -> int | None:
    """The process to blame among exit statuses (``None``: still running; negative: killed by that signal): one
    killed by a signal before one that exited with an error, since the others fail in turn once a peer is gone
    and may end before the next look; then the lowest rank. ``None`` when none failed."""
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    return min(failed, key=lambda rank: (codes[rank] >= 0, rank)) if failed else None  # type: ignore[operator]


def _stop(procs: list[subprocess.Popen[bytes]], sig: int, grace_s: float) -> None:
    """Send ``sig`` to the processes still running, then kill those still running after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
