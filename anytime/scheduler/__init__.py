"""Deadline scheduling: the frontier of options on a device profile, online drift, the anytime runtime."""

from __future__ import annotations

from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.scheduler.deadline": ("DeadlineScheduler", "Option", "PrecisionScheduler", "Selection"),
        "anytime.scheduler.online": ("DriftEstimator",),
        "anytime.scheduler.runtime": ("AnytimePrediction", "AnytimeRunner"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
