"""Open a trained run for answering under deadlines: its model, device profile(s) and calibrated policy, loaded
once into the anytime runtime (what ``anytime serve``, ``schedule --check`` and split runs answer with)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from anytime.errors import AnytimeError
from anytime.profile.store import DeviceProfile
from anytime.scheduler.deadline import DeadlineScheduler, Option
from anytime.scheduler.query import CALIBRATION, find_profile, load_calibration, profiled_lengths, run_options
from anytime.scheduler.runtime import AnytimeRunner
from anytime.train.folder import RunFolder, open_run
from anytime.train.runs import LoadedRun
from anytime.utils.memory import hold_freed_memory
from anytime.utils.threads import set_threads


@dataclass(frozen=True)
class AnsweringRun:
    """A run opened once for answering: its runtime, the run folder and the model loaded from it, the profile files
    the runtime prices with (by length in tokens for a text run's buckets) and the options ``anytime schedule``
    offers (every step and every calibrated policy), read once. :meth:`scheduler` builds ``anytime schedule``'s
    scheduler from the profiles the runtime holds, so the two price with the same figures and the server reads its
    profile once."""

    runner: AnytimeRunner
    folder: RunFolder
    run: LoadedRun
    profile_path: Path
    length_paths: Mapping[int, Path]
    options: tuple[Option, ...]

    def bucket_of(self, length: int | None) -> int | None:
        """The length bucket whose profile prices a text request of ``length`` tokens (cut to the model's maximum,
        as the model reads it); None for the runtime's own profile (no length given, or no length profiles)."""
        if length is None or not self.runner.length_profiles:
            return None
        maximum = self.run.dataset.get("max_length")
        return self.runner.bucket_of(min(length, maximum) if isinstance(maximum, int) else length)

    def scheduler(self, length: int | None = None) -> tuple[DeadlineScheduler, Path]:
        """The deadline scheduler of ``anytime schedule`` (with the file its profile came from); a text run's
        ``length`` picks its length bucket's profile (:meth:`bucket_of`)."""
        bucket = self.bucket_of(length)
        if bucket is None:
            return DeadlineScheduler(self.runner.profile, self.options), self.profile_path
        return DeadlineScheduler(self.runner.length_profiles[bucket], self.options), self.length_paths[bucket]


def runner_for_run(
    run: RunFolder | str | Path, profile: str | Path | None = None, *, calibration: str | Path | None = None,
    device: str = "cpu", quantile: float = 0.99, adapt: bool = True, policy: bool = True, threads: int | str | None = None,
) -> tuple[AnytimeRunner, LoadedRun]:  # fmt: skip
    """The anytime runtime for a run and the loaded run (:func:`open_for_answers`, which says what is loaded)."""
    opened = open_for_answers(run, profile, calibration=calibration, device=device, quantile=quantile, adapt=adapt,
                              policy=policy, threads=threads)  # fmt: skip
    return opened.runner, opened.run


def open_for_answers(
    run: RunFolder | str | Path, profile: str | Path | None = None, *, calibration: str | Path | None = None,
    device: str = "cpu", quantile: float = 0.99, adapt: bool = True, policy: bool = True, threads: int | str | None = None,
) -> AnsweringRun:  # fmt: skip
    """A run opened for answering: the anytime runtime (its model, its device profile and, if calibrated, its
    early-exit policy) and what ``anytime schedule`` needs beside it.

    It runs what the profile measured: the profile's inference form, and on a CPU its torch thread count unless
    ``threads`` says otherwise (a number, or ``auto``: chosen from the cores the machine leaves free now). A text
    run without ``profile`` takes every length profile it has (``anytime profile RUN --length T``): each request
    is priced by its length bucket."""
    folder = open_run(run)  # "not a run" before "no profile"
    run_dir = folder.path
    buckets: dict[int, DeviceProfile] = {}
    bucket_paths: dict[int, Path] = {}
    if profile is None and folder.modality == "text":
        lengths = profiled_lengths(folder.profiles())
        for length, paths in lengths.items():
            if len(paths) > 1:
                raise AnytimeError(f"{run_dir} has several profiles of {length} tokens "
                                   f"({', '.join(p.name for p in paths)}); keep one per length")  # fmt: skip
            buckets[length] = DeviceProfile.load(paths[0])
            bucket_paths[length] = paths[0]
    path = lengths[max(lengths)][0] if buckets else find_profile(run_dir, profile)
    loaded = DeviceProfile.load(path)
    profiled_threads = loaded.settings.get("threads")
    if threads is None and loaded.device.get("type") == "cpu" and isinstance(profiled_threads, int):
        threads = profiled_threads
    set_threads(threads)
    hold_freed_memory()  # as profile_run does, so the latencies the profile holds are the ones met here
    answering = folder.load(device, form=str(loaded.settings.get("form", "eager")))  # run what was measured
    if "execution" in loaded.settings and hasattr(answering.model, "execution"):
        answering.model.execution = str(loaded.settings["execution"])  # type: ignore[assignment]
    loaded.check_model(answering.fingerprint, answering.num_steps, where=str(path))
    for length, bucket in buckets.items():
        where = f"the profile of {length} tokens in {run_dir}"
        bucket.check_model(answering.fingerprint, answering.num_steps, where=where)
    exit_policy, policy_accuracy, exit_share = None, None, None
    calibration_path = Path(calibration) if calibration else run_dir / CALIBRATION
    if policy and answering.num_steps > 1 and (calibration is not None or calibration_path.is_file()):
        exit_policy, report = load_calibration(calibration_path, fingerprint=answering.fingerprint,
                                               num_steps=answering.num_steps)  # fmt: skip
        policy_accuracy = float(report["validation"]["accuracy"])
        exit_share = [float(v) for v in report["validation"]["exit_share"]]
    options = tuple(run_options(run_dir, loaded.step_names))
    accuracy = [o.accuracy for o in options if o.step is not None]
    runner = AnytimeRunner(answering.model, loaded, exit_policy, quantile=quantile, adapt=adapt,
                           step_accuracy=accuracy, policy_accuracy=policy_accuracy, exit_share=exit_share,
                           length_profiles=buckets or None)  # fmt: skip
    return AnsweringRun(runner, folder, answering, Path(path), bucket_paths, options)
