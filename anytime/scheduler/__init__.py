"""Deadline scheduling: the frontier of options on a device profile, online drift, the anytime runtime."""

from anytime.scheduler.deadline import DeadlineScheduler, Option, PrecisionScheduler, Selection
from anytime.scheduler.online import DriftEstimator
from anytime.scheduler.runtime import AnytimePrediction, AnytimeRunner

__all__ = ["AnytimePrediction", "AnytimeRunner", "DeadlineScheduler", "DriftEstimator", "Option", "PrecisionScheduler", "Selection"]
