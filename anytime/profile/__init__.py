"""Measurement on the device: training-step timing and memory, and latency per sample."""

from anytime.profile.latency import latency_summary, per_sample_latency
from anytime.profile.training import TrainStepTiming, measure_train_step, run_isolated

__all__ = ["TrainStepTiming", "latency_summary", "measure_train_step", "per_sample_latency", "run_isolated"]
