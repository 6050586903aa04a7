"""Measurement on the device: the device profile of an anytime model, training-step timing and memory."""

from __future__ import annotations

from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.profile.latency": ("per_sample_latency",),
        "anytime.profile.stats": ("latency_summary", "quantile_of"),
        "anytime.profile.steps": (
            "DEFAULT_BATCH_SIZES",
            "Instruments",
            "ModelIdentity",
            "ProfileInputs",
            "StepTiming",
            "profile_model",
        ),
        "anytime.profile.store": ("PROFILE_FORMAT", "BatchLatency", "DeviceProfile", "Steadiness", "device_slug"),
        "anytime.profile.training": ("TrainStepTiming", "measure_train_step", "run_isolated"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
