"""Measurement on the device: training-step timing and memory (latency profiles come in a later issue)."""

from anytime.profile.training import TrainStepTiming, measure_train_step, run_isolated

__all__ = ["TrainStepTiming", "measure_train_step", "run_isolated"]
