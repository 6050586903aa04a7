"""Sweeps of many independent training runs on an engine users already have: joblib processes on this
machine, or SLURM job arrays through submitit. No scheduler of our own.

A sweep file (TOML) has a ``[base]`` table (the fields :class:`~anytime.train.TrainConfig` takes, or
``card = "NAME"`` and overrides of it) and either a ``[grid]`` table of lists, whose product is the set of
jobs, or a ``[[job]]`` list of tables (each job's own overrides, optionally with a ``name``); ``[slurm]`` sets
the SLURM backend's resources. Every job is an ordinary run folder under the sweep's output folder: a
finished job is skipped, an interrupted one resumes from its checkpoint, a failed one is reported with its
log and does not stop the others.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError
from anytime.utils.io import read_toml
from anytime.utils.outputs import DirState

BACKENDS: tuple[str, ...] = ("local", "slurm", "submitit-local")
SWEEP = "sweep"  # the kind of a sweep's folder in its .anytime.json
SWEEP_ENTRIES: tuple[str, ...] = (
    "logs/**",
    "submitit/**",
    "results.csv",
    "results.json",
    "results.png",
    "results.svg",
    "results.pdf",
)  # beside one run folder per job (named in the marker too)
_TOP_LEVEL = ("base", "grid", "job", "slurm")
SLURM_KEYS: dict[str, type] = {"partition": str, "time_min": int, "gpus_per_job": int, "cpus_per_job": int,
                               "mem_gb": int, "max_parallel": int, "account": str, "constraint": str}  # fmt: skip
RESULT_COLUMNS = ("job", "status", "val_acc", "test_acc", "best_val_acc", "train_time_s", "epochs", "run_dir", "error")
_SAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


@dataclass(frozen=True)
class Job:
    """One run of a sweep: its name, the values that set it apart, its full recipe and its run folder."""

    name: str
    params: Mapping[str, Any]
    config: Mapping[str, Any]  # TrainConfig.to_dict() of the job's recipe
    run_dir: str
    card: str | None = None


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file."""

    path: Path
    jobs: tuple[Job, ...]
    slurm: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobOutcome:
    """How one job ended: ``done`` (trained now), ``finished`` (found finished earlier) or ``failed``."""

    job: str
    status: str
    run_dir: str
    params: Mapping[str, Any]
    val_acc: float | None = None
    test_acc: float | None = None
    best_val_acc: float | None = None
    train_time_s: float | None = None
    epochs: int | None = None
    error: str | None = None
    log: str | None = None

    def row(self) -> dict[str, Any]:
        """One row of the results table: the job's values, then the columns of :data:`RESULT_COLUMNS`."""
        values = {column: getattr(self, column) for column in RESULT_COLUMNS}
        return {**values, **{f"param.{k}": v for k, v in self.params.items()}}


def _job_name(params: Mapping[str, Any]) -> str:
    if not params:
        return "base"
    text = "_".join(f"{key}={_value_text(value)}" for key, value in params.items())
    return _SAFE.sub("-", text)[:150]


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_value_text(v) for v in value)
    return str(value)


def _recipe(values: Mapping[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    """The full recipe of ``values`` (a card's, with the other values over it) and the card's path."""
    from anytime.train import TrainConfig, load_card

    values = dict(values)
    card_name = values.pop("card", None)
    if card_name is not None and not isinstance(card_name, str):
        raise AnytimeError(f"{where}: card must be a card's name or file (got {card_name!r})")
    base = TrainConfig().to_dict()
    card_path = None
    if card_name is not None:
        card = load_card(card_name)
        base, card_path = card.config.to_dict(), str(card.path)
    config = TrainConfig.from_dict({**base, **values}, where=where)
    return config.to_dict(), card_path


def check_sweep_folder(out: str | os.PathLike[str]) -> DirState:
    """Refuse, before any work, a sweep folder that is not new, empty, or a sweep anytime wrote there (resumed):
    a sweep never writes among the user's files (their own results.csv, say)."""
    from anytime.utils.outputs import RUN, check_output_dir, read_marker
    from anytime.utils.tempnames import is_temporary

    folder = Path(out)
    if folder.is_dir() and read_marker(folder) is None:
        entries = [folder / e for e in os.listdir(folder) if not is_temporary(e)]
        # Run folders alone (a sweep of an earlier version, or jobs trained before their sweep ran): the runs are
        # anytime's, each checked as a job; nothing of the user's is there.
        if entries and all(e.is_dir() and (m := read_marker(e)) is not None and m.kind == RUN for e in entries):
            return DirState.OURS
    return check_output_dir(out, SWEEP)


def load_sweep(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Sweep:
    """Read and check a sweep file; every job's run folder is ``out/NAME`` (checked by
    :func:`check_sweep_folder`). Problems are one-line errors."""
    check_sweep_folder(out)
    sweep_path = Path(path)
    if not sweep_path.is_file():
        raise AnytimeError(
            f"no sweep file at {sweep_path}; write one with [base] and [grid] tables (see docs/guides/scaling-out.md)"
        )
    raw = read_toml(sweep_path)
    unknown = sorted(set(raw) - set(_TOP_LEVEL))
    if unknown:
        raise AnytimeError(f"{sweep_path}: unknown table(s) {', '.join(unknown)}; a sweep has "
                           "[base], [grid] or [[job]], and [slurm]")  # fmt: skip
    base = raw.get("base", {})
    if not isinstance(base, dict):
        raise AnytimeError(f"{sweep_path}: base must be a [base] table of recipe fields")
    if ("grid" in raw) == ("job" in raw):
        raise AnytimeError(f"{sweep_path}: give either a [grid] table of lists or a [[job]] list, not "
                           f"{'both' if 'grid' in raw else 'neither'}")  # fmt: skip
    variants: list[tuple[str | None, dict[str, Any]]] = []
    if "grid" in raw:
        grid = raw["grid"]
        if not isinstance(grid, dict) or not grid:
            raise AnytimeError(f"{sweep_path}: [grid] is empty; give lists such as lr = [0.05, 0.1]")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise AnytimeError(f"{sweep_path}: [grid] {key} must be a non-empty list, e.g. {key} = [1, 2]")
        for combo in itertools.product(*grid.values()):
            variants.append((None, dict(zip(grid.keys(), combo))))
    else:
        entries = raw["job"]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise AnytimeError(f"{sweep_path}: [[job]] must be a list of tables, e.g. [[job]] then lr = 0.1")
        for entry in entries:
            entry = dict(entry)
            name = entry.pop("name", None)
            if name is not None and (not isinstance(name, str) or not name.strip(".") or _SAFE.search(name)):
                raise AnytimeError(f"{sweep_path}: job name {name!r} must be letters, digits and . _ = + - only")
            variants.append((name, entry))
    jobs: list[Job] = []
    for name, params in variants:
        job_name = name or _job_name(params)
        where = f"{sweep_path} job {job_name}"
        config, card = _recipe({**base, **params}, where)
        jobs.append(Job(name=job_name, params=params, config=config, run_dir=str(Path(out) / job_name), card=card))
    names = [job.name for job in jobs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise AnytimeError(f"{sweep_path}: several jobs are named {', '.join(repeated)}; give each [[job]] a name")
    return Sweep(path=sweep_path, jobs=tuple(jobs), slurm=_slurm_settings(raw.get("slurm", {}), sweep_path))


def _slurm_settings(values: Any, where: Path) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise AnytimeError(f"{where}: slurm must be a [slurm] table")
    for key, value in values.items():
        expected = SLURM_KEYS.get(key)
        if expected is None:
            raise AnytimeError(f"{where}: unknown [slurm] setting {key}; valid ones are {', '.join(SLURM_KEYS)}")
        if not isinstance(value, expected) or isinstance(value, bool):
            raise AnytimeError(f"{where}: [slurm] {key} must be {expected.__name__} (got {value!r})")
    return dict(values)


def ticket_jobs(
    dense_run: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    sparsity: float,
    reset_epoch: int,
    rounds: int = 1,
    scope: str = "global",
    unit: str = "weights",
) -> list[Job]:
    """The rounds of iterative magnitude pruning from ``dense_run`` to ``sparsity`` as jobs (``out/round-R``), each
    a ticket of the dense run's recipe that prunes the round before's (the first, the dense run's) final weights,
    or with ``unit`` ``channels`` its whole channels."""
    from anytime.train import TrainConfig
    from anytime.train.pruning import round_sparsities

    check_sweep_folder(out)
    dense = Path(dense_run)
    try:
        base = json.loads((dense / "config.json").read_text())["train"]
    except (OSError, ValueError, KeyError):
        raise AnytimeError(f"{dense} is not a finished run (no readable config.json); train it first") from None
    if base.get("prune_from") is not None:
        raise AnytimeError(f"{dense} is itself a ticket; give the dense run it was pruned from")
    jobs: list[Job] = []
    previous = str(dense)
    for r, target in enumerate(round_sparsities(sparsity, rounds), start=1):
        values = {**base, "prune_from": previous, "sparsity": target, "reset_epoch": reset_epoch,
                  "prune_scope": scope, "prune_unit": unit, "keep_checkpoints": []}  # fmt: skip
        config = TrainConfig.from_dict(values, where=f"{dense}/config.json").to_dict()
        run_dir = str(Path(out) / f"round-{r}")
        jobs.append(Job(name=f"round-{r}", params={"sparsity": round(target, 6)}, config=config, run_dir=run_dir))
        previous = run_dir
    return jobs


def job_state(job: Job) -> str:
    """``finished``, ``started`` (a checkpoint to resume) or ``new``; a folder holding another recipe, or
    something that is not a run, is refused."""
    from anytime.train import TrainConfig
    from anytime.utils.outputs import RUN, DirState, check_output_dir

    run_dir = Path(job.run_dir)
    if not run_dir.exists():
        return "new"
    state = check_output_dir(run_dir, RUN, create_parents=True)
    if state is not DirState.OURS:
        return "new"
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        return "new"  # a run that never finished an epoch holds nothing to keep
    try:
        saved = json.loads(config_path.read_text())["train"]
        saved = TrainConfig.from_dict(saved, where=str(config_path)).to_dict()
    except (ValueError, KeyError, TypeError):
        raise AnytimeError(f"job {job.name}: {config_path} is unreadable; move that run elsewhere") from None
    runtime = set(TrainConfig.RUNTIME_FIELDS)
    differing = sorted(k for k in job.config if k not in runtime and saved.get(k) != job.config[k])
    if differing:
        raise AnytimeError(
            f"job {job.name}: {run_dir} holds a run of another recipe ({', '.join(differing)} differ); "
            "choose another --out or move that run"
        )
    if (run_dir / "summary.json").is_file():
        return "finished"
    return "started" if (run_dir / "checkpoint.pt").is_file() else "new"


def _outcome_from_summary(job: Job, status: str) -> JobOutcome:
    summary = json.loads((Path(job.run_dir) / "summary.json").read_text())
    final = summary["final"]
    return JobOutcome(job=job.name, status=status, run_dir=job.run_dir, params=job.params,
                      val_acc=final["val_acc"], test_acc=final["test_acc"], best_val_acc=summary["best_val_acc"],
                      train_time_s=summary["train_time_s"], epochs=summary["epochs"])  # fmt: skip


def run_job(job: Job, threads: int | None = None, log_dir: str | None = None) -> JobOutcome:
    """Train (or resume, or skip) one job in this process; a failure is returned, with its log, not raised."""
    from anytime.train import TrainConfig, Trainer

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    log = Path(log_dir or Path(job.run_dir).parent / "logs") / f"{job.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        state = job_state(job)
        if state == "finished":
            return _outcome_from_summary(job, "finished")
        with open(log, "a", encoding="utf-8") as handle:

            def say(line: str) -> None:
                handle.write(line + "\n")
                handle.flush()

            trainer = Trainer(
                TrainConfig.from_dict(dict(job.config)), job.run_dir, on_start=say, create_parents=True,
                on_epoch_end=lambda end: say(f"epoch {end.epoch + 1}: val_acc {end.metrics['val_acc']:.4f}"),
                extra_config={"sweep_job": job.name, **({"card": job.card} if job.card else {})},
            )  # fmt: skip
            trainer.fit(resume=state == "started")
        return _outcome_from_summary(job, "done")
    except Exception as exc:  # noqa: BLE001  one job's failure must not stop the sweep
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(traceback.format_exc())
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return JobOutcome(job=job.name, status="failed", run_dir=job.run_dir, params=job.params,
                          error=f"{type(exc).__name__}: {message}" if not isinstance(exc, AnytimeError) else message,
                          log=str(log))  # fmt: skip


class _SlurmJob:
    """What a SLURM array task runs. submitit calls :meth:`checkpoint` when the job is preempted or times out:
    the job is requeued as it is, and the trainer resumes it from its last complete epoch."""

    def __init__(self, job: Job, log_dir: str) -> None:
        self.job = job
        self.log_dir = log_dir

    def __call__(self) -> JobOutcome:
        return run_job(self.job, log_dir=self.log_dir)

    def checkpoint(self) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(_SlurmJob(self.job, self.log_dir))


def run_local(jobs: Sequence[Job], workers: int, *, log_dir: str, threads: int | None = None) -> Iterator[JobOutcome]:
    """Run ``jobs`` in ``workers`` joblib processes, each with ``threads`` torch threads (default: its share of the
    cores); yields outcomes as jobs end."""
    from anytime.utils.threads import usable_cores

    threads = threads or max(1, usable_cores() // workers)
    if workers == 1:
        for job in jobs:
            yield run_job(job, threads, log_dir)
        return
    from joblib import Parallel, delayed

    tasks = (delayed(run_job)(job, threads, log_dir) for job in jobs)
    yield from Parallel(n_jobs=workers, backend="loky", return_as="generator_unordered")(tasks)


def check_slurm(cluster: str | None) -> None:
    """Refuse, in one line, a SLURM backend that cannot work here."""
    import importlib.util

    if importlib.util.find_spec("submitit") is None:
        raise AnytimeError("the slurm backend needs submitit: pip install 'anytime[slurm]' (or use --backend local)")
    if cluster is None and shutil.which("sbatch") is None:
        raise AnytimeError("no sbatch on this machine: run on a SLURM login node, or use --backend local "
                           "(--backend submitit-local runs the SLURM path here)")  # fmt: skip


def run_submitit(
    jobs: Sequence[Job],
    settings: Mapping[str, Any],
    *,
    folder: str,
    log_dir: str,
    workers: int | None,
    cluster: str | None = None,
) -> Iterator[JobOutcome]:
    """Submit ``jobs`` as one job array through submitit (``cluster=None``: SLURM; ``"local"``: submitit's local
    executor), then yield their outcomes in order as they end. Stopping the wait leaves the array running."""
    check_slurm(cluster)
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    params: dict[str, Any] = {"name": "anytime-sweep", "timeout_min": int(settings.get("time_min", 24 * 60))}
    if "gpus_per_job" in settings:
        params["gpus_per_node"] = settings["gpus_per_job"]
    if "cpus_per_job" in settings:
        params["cpus_per_task"] = settings["cpus_per_job"]
    if "mem_gb" in settings:
        params["mem_gb"] = settings["mem_gb"]
    if cluster is None:
        params["slurm_array_parallelism"] = int(workers or settings.get("max_parallel", len(jobs)))
        for key in ("partition", "account", "constraint"):
            if key in settings:
                params[f"slurm_{key}"] = settings[key]
    executor.update_parameters(**params)
    with executor.batch():
        submitted = [executor.submit(_SlurmJob(job, log_dir)) for job in jobs]
    for job, handle in zip(jobs, submitted):
        try:
            yield handle.result()
        except Exception as exc:  # noqa: BLE001  the job's process died; its own error is in submitit's log
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            yield JobOutcome(job=job.name, status="failed", run_dir=job.run_dir, params=job.params,
                             error=message[:300], log=str(handle.paths.stderr))  # fmt: skip


@dataclass(frozen=True)
class SweepResult:
    """Every job's outcome, and where the table (and plot) were written."""

    outcomes: tuple[JobOutcome, ...]
    table_csv: Path
    table_json: Path

    @property
    def failed(self) -> tuple[JobOutcome, ...]:
        """The jobs that failed."""
        return tuple(o for o in self.outcomes if o.status == "failed")


def run_sweep(
    sweep: Sweep,
    out: str | os.PathLike[str],
    *,
    backend: str = "local",
    workers: int | None = None,
    threads: int | None = None,
    on_outcome: Callable[[JobOutcome], None] | None = None,
) -> SweepResult:
    """Run every job of ``sweep`` not finished yet on ``backend``, then gather all jobs into ``out/results.csv``
    and ``results.json`` (written atomically). ``workers``: jobs at once (local: default 1; SLURM: default
    ``[slurm] max_parallel``, else all). ``threads``: torch threads per local job (default: the cores shared
    out over the workers). The states of the jobs' folders are checked first, so a folder
    holding another recipe stops the sweep before anything runs."""
    from anytime.utils.io import write_csv, write_json
    from anytime.utils.outputs import DirState, read_marker, write_marker

    if backend not in BACKENDS:
        raise AnytimeError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if workers is not None and workers < 1:
        raise AnytimeError(f"--workers must be at least 1 (got {workers})")
    out_dir = Path(out)
    state = check_sweep_folder(out_dir)
    states = {job.name: job_state(job) for job in sweep.jobs}
    if backend != "local":
        check_slurm("local" if backend == "submitit-local" else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = read_marker(out_dir) if state is DirState.OURS else None
    write_marker(out_dir, SWEEP, [*SWEEP_ENTRIES, *(earlier.entries if earlier else ()),
                                  *(job.name for job in sweep.jobs)])  # fmt: skip
    log_dir = str(out_dir / "logs")
    pending = [job for job in sweep.jobs if states[job.name] != "finished"]
    outcomes: dict[str, JobOutcome] = {
        job.name: _outcome_from_summary(job, "finished") for job in sweep.jobs if states[job.name] == "finished"
    }
    for outcome in outcomes.values():
        if on_outcome is not None:
            on_outcome(outcome)
    if backend == "local":
        stream = run_local(pending, min(workers or 1, max(1, len(pending))), log_dir=log_dir, threads=threads)
    else:
        stream = run_submitit(pending, sweep.slurm, folder=str(out_dir / "submitit"), log_dir=log_dir,
                              workers=workers, cluster="local" if backend == "submitit-local" else None)  # fmt: skip
    try:
        for outcome in stream:
            outcomes[outcome.job] = outcome
            if on_outcome is not None:
                on_outcome(outcome)
    except Exception as exc:  # noqa: BLE001  the engine itself failed (a worker killed for memory): say so per job
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        message = f"the {backend} backend stopped: {type(exc).__name__}: {first}"
        for job in pending:
            if job.name not in outcomes:
                outcomes[job.name] = JobOutcome(job=job.name, status="failed", run_dir=job.run_dir, params=job.params,
                                                error=message)  # fmt: skip
                if on_outcome is not None:
                    on_outcome(outcomes[job.name])
    ordered = tuple(outcomes[job.name] for job in sweep.jobs if job.name in outcomes)
    rows = [o.row() for o in ordered]
    params = list(dict.fromkeys(k for row in rows for k in row if k.startswith("param.")))
    table_csv = write_csv(out_dir / "results.csv", rows, [*RESULT_COLUMNS, *params])
    table_json = write_json(out_dir / "results.json", {"sweep": str(sweep.path), "backend": backend,
                                                       "workers": workers or 1, "jobs": rows})  # fmt: skip
    return SweepResult(outcomes=ordered, table_csv=table_csv, table_json=table_json)


def numeric_axis(outcomes: Sequence[JobOutcome]) -> str | None:
    """The one parameter that varies over numbers (what a results plot puts on its x axis), if there is one."""
    keys = list(dict.fromkeys(k for o in outcomes for k in o.params))
    varying = [k for k in keys if len({json.dumps(o.params.get(k), sort_keys=True) for o in outcomes}) > 1]
    numeric = [k for k in varying if all(isinstance(o.params.get(k), (int, float)) and not isinstance(
        o.params.get(k), bool) and math.isfinite(o.params.get(k)) for o in outcomes)]  # fmt: skip
    return numeric[0] if numeric else None
