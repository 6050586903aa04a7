"""The writer of shard folders: :func:`prepare_shards` decodes an image folder, resizes and packs each split into
shards of raw uint8 images in worker processes, writes the labels and rewrites the manifest after each shard, so an
interrupted preparation resumes where it stopped and a folder of other arguments or a changed source is refused
(the format, the manifest types and their checks are in :mod:`anytime.data.shards`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anytime.data.shards import (
    CHANNELS,
    MANIFEST,
    SPLITS,
    ShardFile,
    ShardManifest,
    ShardSplit,
    file_sha1,
    read_manifest,
    shard_name,
)
from anytime.errors import AnytimeError

KIND = "shard folder"  # the output-folder kind recorded in the folder's marker
SHARD_BYTES = 64 * 2**20  # default shard size: as many images as fill this
_ENTRIES = (MANIFEST, "train-*.bin", "test-*.bin", "train-labels.npy", "test-labels.npy")


@dataclass(frozen=True)
class PreparedShards:
    """What :func:`prepare_shards` did: the finished manifest, the shards it wrote and those it found already
    done (an earlier run's), and the seconds it took."""

    manifest: ShardManifest
    written: int
    reused: int
    seconds: float


# ---- preparing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    split: str
    index: int
    target: str
    paths: tuple[str, ...] = field(repr=False)
    image_size: int


def _pixel_stats(images: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    values = np.arange(256, dtype=np.int64)
    sums, squares = [], []
    for c in range(images.shape[1]):
        # A 256-bin histogram gives exact integer sums without a wide copy of the shard.
        hist = np.bincount(images[:, c].ravel(), minlength=256).astype(np.int64)
        sums.append(int((hist * values).sum()))
        squares.append(int((hist * values * values).sum()))
    return tuple(sums), tuple(squares)


def _write_shard(job: _Job) -> ShardFile | tuple[str, str]:
    """Decode, resize and pack one shard (in a worker process); the shard, or (path, error) for a bad image."""
    from anytime.data.imagefolder import decode_image_file
    from anytime.utils.io import atomic_path

    size = job.image_size
    images = np.empty((len(job.paths), CHANNELS, size, size), dtype=np.uint8)
    for i, path in enumerate(job.paths):
        _, decoded = decode_image_file((path, size))
        if isinstance(decoded, str):
            return path, decoded
        images[i] = decoded[None] if decoded.ndim == 2 else decoded.transpose(2, 0, 1)
    sums, squares = _pixel_stats(images)
    payload = memoryview(images.reshape(-1))
    with atomic_path(job.target) as tmp, open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return ShardFile(os.path.basename(job.target), len(job.paths), images.nbytes, hashlib.sha1(payload).hexdigest(),
                     sums, squares)  # fmt: skip


def _source_bytes(root: Path, relative: Sequence[str]) -> int:
    return sum(os.stat(root / rel).st_size for rel in relative)


def _describe(manifest: ShardManifest) -> str:
    return (f"shards of {manifest.source} at {manifest.image_size}x{manifest.image_size}, "
            f"{manifest.shard_size} images per shard")  # fmt: skip


def _check_same_plan(old: ShardManifest, new: ShardManifest, out: Path) -> None:
    """Refuse to mix shards of different arguments or of a changed source in one folder."""
    differences = []
    if old.image_size != new.image_size:
        differences.append(f"--image-size {new.image_size}")
    if old.shard_size != new.shard_size:
        differences.append(f"--shard-size {new.shard_size}")
    if old.channels != new.channels or old.resample != new.resample:
        differences.append("another image layout")
    if (
        old.source_fingerprint != new.source_fingerprint
        or old.classes != new.classes
        or any(old.split(s).count != new.split(s).count for s in SPLITS)
    ):
        differences.append(f"a source that differs ({new.source_files:,} files in {new.source}; "
                           f"{old.source_files:,} then)")  # fmt: skip
    if differences:
        raise AnytimeError(
            f"--out {out} holds {_describe(old)}, not {' and '.join(differences)} as asked; anytime never overwrites "
            "them: choose another --out (or remove that folder yourself)"
        )


def _default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def prepare_shards(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    image_size: int,
    workers: int | None = None,
    shard_size: int | None = None,
    verify: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> PreparedShards:
    """Decode, resize to ``image_size`` x ``image_size`` and pack the image folder ``src`` into shards in ``out``.

    ``workers`` processes (default: the cores, at most 8) each write whole shards of ``shard_size`` images
    (default: as many as fill 64 MiB). ``out`` must be new, empty, or a shard folder of the same source and
    arguments: then only the shards not yet finished are written (``verify`` also re-checks the finished ones'
    SHA-1 and rewrites those that differ). ``on_progress`` receives one line per shard written.
    """
    from anytime.data.imagefolder import scan_folder
    from anytime.utils.outputs import check_output_dir, output_lock, write_marker

    started = time.perf_counter()
    workers, shard_size, source = _checked_arguments(src, image_size, workers, shard_size)
    target = Path(out).expanduser()
    check_output_dir(target, KIND, flag="--out")  # before the scan: a wrong --out is said at once
    scan = scan_folder(source)
    listed = {"train": scan.train, "test": scan.test}
    plan = ShardManifest(
        root=target, image_size=image_size, channels=CHANNELS, shard_size=shard_size, classes=scan.classes,
        train=ShardSplit("train", len(scan.train), "train-labels.npy", ()),
        test=ShardSplit("test", len(scan.test), "test-labels.npy", ()),
        mean=(), std=(), source=str(scan.root), source_fingerprint=scan.fingerprint,
        source_files=len(scan.train) + len(scan.test),
        source_bytes=_source_bytes(scan.root, [rel for rel, _ in scan.train + scan.test]), complete=False,
    )  # fmt: skip
    target.mkdir(parents=True, exist_ok=True)
    with output_lock(target, command="anytime prepare-data"):
        check_output_dir(target, KIND, flag="--out")  # again, under the lock
        old = read_manifest(target)
        if old is not None:
            _check_same_plan(old, plan, target)
        write_marker(target, KIND, _ENTRIES)
        done = _finished_shards(old, plan, verify)
        reused = sum(len(d) for d in done.values())
        _write_labels(plan, listed)
        jobs = _missing_jobs(plan, listed, scan.root, done)
        manifest = _write_missing(plan, jobs, done, workers, reused, on_progress)
    return PreparedShards(manifest, written=len(jobs), reused=reused, seconds=time.perf_counter() - started)


def _checked_arguments(
    src: str | os.PathLike[str], image_size: int, workers: int | None, shard_size: int | None
) -> tuple[int, int, Path]:
    """The workers, the shard size (defaults filled in) and the source folder, each checked."""
    if image_size < 1:
        raise AnytimeError(f"--image-size must be a positive number of pixels, got {image_size}")
    workers = _default_workers() if workers is None else workers
    if workers < 1:
        raise AnytimeError(f"--workers must be >= 1, got {workers}")
    image_bytes = CHANNELS * image_size * image_size
    shard_size = max(1, SHARD_BYTES // image_bytes) if shard_size is None else shard_size
    if shard_size < 1:
        raise AnytimeError(f"--shard-size must be >= 1 image, got {shard_size}")
    source = Path(src).expanduser()
    if not source.exists():
        raise AnytimeError(f"no image folder at {source}; give a folder holding train/<class>/* and test/<class>/*")
    if not source.is_dir():
        raise AnytimeError(f"{source} is a file, not an image folder; give a folder holding train/<class>/* and "
                           "test/<class>/*")  # fmt: skip
    return workers, shard_size, source


def _finished_shards(old: ShardManifest | None, plan: ShardManifest, verify: bool) -> dict[str, dict[int, ShardFile]]:
    """The shards of ``plan`` an earlier run finished (with ``verify``, only those whose SHA-1 still matches)."""
    target, shard_size, image_bytes = plan.root, plan.shard_size, plan.image_bytes
    done: dict[str, dict[int, ShardFile]] = {name: {} for name in SPLITS}
    for name in SPLITS:
        names = {shard_name(name, i): i for i in range(plan.shard_count(name))}
        for shard in old.split(name).shards if old is not None else ():
            index = names.get(shard.file)
            if index is None:
                continue  # not a shard of this plan: left alone, and never read
            path = target / shard.file
            expected = min(shard_size, plan.split(name).count - index * shard_size) * image_bytes
            if shard.bytes != expected or not path.is_file() or path.stat().st_size != expected:
                continue
            if verify and file_sha1(path) != shard.sha1:
                continue
            done[name][index] = shard
    return done


def _write_labels(plan: ShardManifest, listed: dict[str, tuple[tuple[str, int], ...]]) -> None:
    """Each split's labels file, in the order of its images."""
    from anytime.utils.io import atomic_path

    for name in SPLITS:
        labels = np.array([label for _, label in listed[name]], dtype=np.int64)
        with atomic_path(plan.root / plan.split(name).labels) as tmp, open(tmp, "wb") as handle:
            np.save(handle, labels, allow_pickle=False)


def _missing_jobs(
    plan: ShardManifest,
    listed: dict[str, tuple[tuple[str, int], ...]],
    root: Path,
    done: dict[str, dict[int, ShardFile]],
) -> list[_Job]:
    """One job per shard of ``plan`` not in ``done``: its images' paths (under the source ``root``) and its file."""
    target, shard_size, image_size = plan.root, plan.shard_size, plan.image_size
    jobs = []
    for name in SPLITS:
        files = listed[name]
        for index in range(plan.shard_count(name)):
            if index not in done[name]:
                chunk = files[index * shard_size : (index + 1) * shard_size]
                jobs.append(_Job(name, index, str(target / shard_name(name, index)),
                                 tuple(str(root / rel) for rel, _ in chunk), image_size))  # fmt: skip
    return jobs


def _manifest_now(plan: ShardManifest, done: dict[str, dict[int, ShardFile]], complete: bool) -> ShardManifest:
    """``plan`` with the shards in ``done`` (in order), and the mean and std once ``complete``."""
    splits = {name: ShardSplit(name, plan.split(name).count, plan.split(name).labels,
                               tuple(done[name][i] for i in sorted(done[name])))
              for name in SPLITS}  # fmt: skip
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    if complete:
        mean, std = _mean_std(splits["train"], plan.image_size)
    return dataclasses.replace(plan, train=splits["train"], test=splits["test"], mean=mean, std=std,
                               complete=complete)  # fmt: skip


def _write_missing(
    plan: ShardManifest, jobs: list[_Job], done: dict[str, dict[int, ShardFile]], workers: int, reused: int,
    on_progress: Callable[[str], None] | None,
) -> ShardManifest:  # fmt: skip
    """Write the shards of ``jobs`` into ``done``, the manifest rewritten after each; the finished manifest."""
    from anytime.utils.io import write_json
    from anytime.utils.resources import check_disk

    target, image_size = plan.root, plan.image_size
    missing = sum(len(job.paths) for job in jobs) * plan.image_bytes
    check_disk(target, missing, f"{len(jobs)} shards of {image_size}x{image_size} images",
               "free some space or choose another --out")  # fmt: skip
    write_json(target / MANIFEST, _manifest_now(plan, done, False).to_dict())
    if reused and on_progress is not None:
        left = f"writing the {len(jobs)} left" if jobs else "nothing left to write"
        on_progress(f"{reused} shards already done in {target}; {left}")
    total = reused + len(jobs)

    def record(job: _Job, result: ShardFile | tuple[str, str]) -> None:
        if isinstance(result, tuple):
            raise AnytimeError(f"cannot decode image {result[0]} ({result[1]}); remove or replace the file, then "
                               "run the same command again to finish")  # fmt: skip
        done[job.split][job.index] = result
        write_json(target / MANIFEST, _manifest_now(plan, done, False).to_dict())
        if on_progress is not None:
            finished = sum(len(d) for d in done.values())
            on_progress(f"{finished}/{total} shards: {result.file} ({result.count:,} images)")

    _run_jobs(jobs, workers, record)
    manifest = _manifest_now(plan, done, True)
    write_json(target / MANIFEST, manifest.to_dict())
    return manifest


def _run_jobs(jobs: list[_Job], workers: int, record: Callable[[_Job, ShardFile | tuple[str, str]], None]) -> None:
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            record(job, _write_shard(job))
        return
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)))
    try:
        futures = {pool.submit(_write_shard, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            record(futures[future], future.result())
    except BaseException:
        # Interrupted or failed: queued shards are dropped; a shard being written leaves only a temporary file.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _mean_std(split: ShardSplit, image_size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std (in [0,1] units) from the shards' integer sums, as ``channel_stats``."""
    pixels = split.count * image_size * image_size
    means, stds = [], []
    for c in range(CHANNELS):
        if pixels == 0:
            means.append(0.0)
            stds.append(1.0)
            continue
        total = sum(s.sums[c] for s in split.shards)
        squares = sum(s.squares[c] for s in split.shards)
        mean = total / pixels
        var = squares / pixels - mean**2
        means.append(mean / 255.0)
        stds.append(max(float(np.sqrt(max(var, 0.0))) / 255.0, 1e-3))
    return tuple(means), tuple(stds)
