"""A finished run folder opened once: what the workflows, the runtime and the server are handed instead of a path,
so that a run's record, recipe and the fingerprint of its weights are read and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError
from anytime.train.config import TrainConfig
from anytime.train.records import require_run, run_weights_fingerprint
from anytime.train.summary import SUMMARY, RunSummary
from anytime.utils.io import read_json

if TYPE_CHECKING:
    import torch

    from anytime.train.runs import LoadedRun


@dataclass(frozen=True)
class RunFolder:
    """A finished run: its folder ``path``, ``record`` (its ``config.json``, read-only), ``config`` (the recipe it
    was trained with), ``dataset`` (the description of its data) and ``fingerprint`` (of what it computes with:
    its weights and, for a converted run, its precision). Open one with :meth:`open` (or :func:`open_run`, which
    also takes one already open); what later stages add to the folder (caches, calibrations, profiles) is read
    when asked for, so one object serves a whole pipeline."""

    path: Path
    record: Mapping[str, Any]
    config: TrainConfig
    dataset: Mapping[str, Any]
    fingerprint: str

    @classmethod
    def open(cls, run_dir: str | Path) -> RunFolder:
        """The finished run at ``run_dir``; a one-line error for a missing, unfinished or malformed one."""
        path = Path(run_dir)
        record = require_run(path)
        config = TrainConfig.from_dict(record["train"], where=str(path / "config.json"))
        dataset = MappingProxyType(dict(record["dataset"]))
        return cls(path=path, record=MappingProxyType(record), config=config, dataset=dataset,
                   fingerprint=run_weights_fingerprint(path))  # fmt: skip

    @property
    def modality(self) -> str:
        """``image`` or ``text``: what the run's data holds."""
        return str(self.dataset.get("modality") or "image")

    def summary(self) -> RunSummary:
        """The run's ``summary.json`` as written when it finished."""
        where = self.path / SUMMARY
        record = read_json(where, what="training summary", make="its training has not finished",
                           redo="train the run again")  # fmt: skip
        if not isinstance(record, dict):
            raise AnytimeError(f"{where} is not a run's summary; was it edited?")
        return RunSummary.from_dict(record, where=str(where))

    def profiles(self) -> tuple[Path, ...]:
        """The device profiles the folder holds now (``profile-*.json``), by name."""
        return tuple(sorted(self.path.glob("profile-*.json")))

    def load(self, device: str | torch.device = "cpu", *, converted: bool = True, form: str = "eager") -> LoadedRun:
        """The run's model on ``device`` (:func:`anytime.train.runs.load_run`), refused in one line when its weights
        changed since the folder was opened."""
        # torch is imported here, not at module level: a folder is opened before (and without) any network
        from anytime.train.runs import load_run

        loaded = load_run(self.path, device, converted=converted, form=form)
        if loaded.fingerprint != self.fingerprint:
            raise AnytimeError(f"{self.path}'s weights changed since it was opened (another training wrote them); "
                               "open the run again")  # fmt: skip
        return loaded


def run_path(run: RunFolder | str | Path) -> Path:
    """The folder of ``run``, whether it is open already or a path (not opened here)."""
    return run.path if isinstance(run, RunFolder) else Path(run)


def open_run(run: RunFolder | str | Path) -> RunFolder:
    """``run`` itself when it is open already, else the run folder at that path opened (:meth:`RunFolder.open`)."""
    return run if isinstance(run, RunFolder) else RunFolder.open(run)
