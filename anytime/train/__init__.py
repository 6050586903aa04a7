"""Training: the recipe, the instrumented loop, checkpoints and model cards."""

from anytime.train.cards import ModelCard, load_card, record_results
from anytime.train.checkpoint import load_checkpoint, load_weights, save_checkpoint, save_weights
from anytime.train.config import SCHEDULES, TrainConfig
from anytime.train.trainer import EpochEnd, Trainer, evaluate, load_splits, lr_factor, read_metrics

__all__ = [
    "SCHEDULES", "EpochEnd", "ModelCard", "TrainConfig", "Trainer", "evaluate", "load_card", "load_checkpoint",
    "load_splits", "load_weights", "lr_factor", "read_metrics", "record_results", "save_checkpoint", "save_weights",
]  # fmt: skip
