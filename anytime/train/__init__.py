"""Training: the recipe, the instrumented loop, checkpoints and model cards."""

from __future__ import annotations

from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.train.cards": ("ModelCard", "load_card", "record_results"),
        "anytime.train.checkpoint": ("load_checkpoint", "load_weights", "save_checkpoint", "save_weights"),
        "anytime.train.config": ("SCHEDULES", "TrainConfig"),
        "anytime.train.folder": ("RunFolder", "open_run"),
        "anytime.train.splits": ("load_splits", "run_splits"),
        "anytime.train.summary": ("RunSummary",),
        "anytime.train.evaluation": ("evaluate",),
        "anytime.train.logbook": ("read_metrics",),
        "anytime.train.recipe": ("lr_factor",),
        "anytime.train.trainer": ("EpochEnd", "Trainer"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
