"""Plots of training runs and studies. The only package that imports matplotlib."""

from anytime.plotting.exits import (
    plot_class_accuracy,
    plot_exit_accuracy_epochs,
    plot_exit_histogram,
    plot_exit_pareto,
    plot_reliability,
    plot_threshold_curves,
)
from anytime.plotting.figures import (
    plot_batch_time,
    plot_memory,
    plot_time_accuracy,
    plot_training_curves,
    save_figure,
)
from anytime.plotting.layout import figure_size
from anytime.plotting.schedule import (
    plot_deadline_accuracy,
    plot_deadline_runs,
    plot_energy_accuracy,
    plot_latency_distributions,
)

__all__ = [
    "figure_size", "plot_batch_time", "plot_class_accuracy", "plot_reliability", "plot_deadline_accuracy", "plot_deadline_runs", "plot_energy_accuracy", "plot_exit_accuracy_epochs",
    "plot_exit_histogram", "plot_exit_pareto", "plot_latency_distributions", "plot_memory", "plot_threshold_curves",
    "plot_time_accuracy", "plot_training_curves", "save_figure",
]  # fmt: skip
