"""Measurement on the device: the device profile of an anytime model, training-step timing and memory."""

from anytime.profile.latency import latency_summary, per_sample_latency, quantile_of
from anytime.profile.steps import DEFAULT_BATCH_SIZES, profile_model
from anytime.profile.store import PROFILE_FORMAT, BatchLatency, DeviceProfile, device_slug
from anytime.profile.training import TrainStepTiming, measure_train_step, run_isolated

__all__ = [
    "DEFAULT_BATCH_SIZES", "PROFILE_FORMAT", "BatchLatency", "DeviceProfile", "TrainStepTiming", "device_slug",
    "latency_summary", "measure_train_step", "per_sample_latency", "profile_model", "quantile_of", "run_isolated",
]  # fmt: skip
