"""Plots of training runs and studies. The only package that imports matplotlib."""

from anytime.plotting.figures import (
    plot_batch_time,
    plot_memory,
    plot_time_accuracy,
    plot_training_curves,
    save_figure,
)

__all__ = ["plot_batch_time", "plot_memory", "plot_time_accuracy", "plot_training_curves", "save_figure"]
