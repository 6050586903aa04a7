"""SACT's ponder-cost maps: residual units run per position, for every step, beside the image."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import scaled


def plot_ponder_maps(images: np.ndarray, units: np.ndarray, step_names: Sequence[str], stem: str | os.PathLike[str],
                     title: str, *, least: float, most: float) -> list[Path]:  # fmt: skip
    """One row per image (``images`` ``[N, H, W, C]`` in [0, 1]): the image, then each step's map of units run
    (``units`` ``[K, N, H, W]``), on one colour scale from ``least`` (every stage's first unit) to ``most`` (the
    most any map shows, so that the differences are visible)."""
    count, columns = images.shape[0], 1 + units.shape[0]
    fig = scaled((1.9 * columns + 0.8, 2.0 * count + 0.4), layout="constrained")
    axes = np.atleast_2d(fig.subplots(count, columns, squeeze=False))
    gray = images.shape[-1] == 1
    shown = None
    for i in range(count):
        axes[i, 0].imshow(images[i, ..., 0] if gray else images[i], cmap="gray" if gray else None, vmin=0, vmax=1)
        axes[i, 0].set_title("image", fontsize=7)
        for k in range(units.shape[0]):
            shown = axes[i, k + 1].imshow(units[k, i], cmap="viridis", vmin=least, vmax=most)
            axes[i, k + 1].set_title(f"{step_names[k]}: {units[k, i].mean():.1f} units", fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if shown is not None:
        fig.colorbar(shown, ax=axes[:, 1:].ravel().tolist(), shrink=0.6, label="residual units run")
    fig.suptitle(f"{title}: residual units run per position (ponder cost)", fontsize=9)
    return save_figure(fig, stem, formats=("png", "svg"))
