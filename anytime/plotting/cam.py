"""The class activation maps of every step, side by side for the same images."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from anytime.plotting.figures import save_figure
from anytime.plotting.layout import scaled

if TYPE_CHECKING:
    from anytime.tasks.cam import StepMaps


def plot_step_maps(
    images: np.ndarray, maps: Sequence[StepMaps], step_names: Sequence[str], stem: str | os.PathLike[str], title: str,
    *, class_names: Sequence[str] | None = None, labels: np.ndarray | None = None,
) -> list[Path]:  # fmt: skip
    """One row per image (``images`` ``[N, H, W, C]`` in [0, 1]): the image, then each step's map over it, titled
    with the step's answer and confidence (red where it is wrong, when ``labels`` are known)."""
    count = images.shape[0]
    columns = 1 + len(maps)
    fig = scaled((1.9 * columns, 2.1 * count + 0.4), layout="constrained")
    axes = np.atleast_2d(fig.subplots(count, columns, squeeze=False))

    def name(c: int) -> str:
        return class_names[c] if class_names is not None and 0 <= c < len(class_names) else str(c)

    gray = images.shape[-1] == 1
    for i in range(count):
        picture = images[i, ..., 0] if gray else images[i]
        axes[i, 0].imshow(picture, cmap="gray" if gray else None, vmin=0, vmax=1)
        axes[i, 0].set_title("image" + (f": {name(int(labels[i]))}" if labels is not None else ""), fontsize=7)
        for j, step in enumerate(maps, start=1):
            ax = axes[i, j]
            ax.imshow(picture, cmap="gray" if gray else None, vmin=0, vmax=1)
            ax.imshow(step.maps[i], cmap="jet", alpha=0.45, vmin=0, vmax=1)
            wrong = labels is not None and int(step.predicted[i]) != int(labels[i])
            ax.set_title(f"{step_names[step.step]} ({step.method})\n{name(int(step.predicted[i]))} "
                         f"{100 * float(step.confidence[i]):.0f}%", fontsize=7, color="#C44E52" if wrong else "black")  # fmt: skip
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{title}: where each step looked (maps of the class it answered)", fontsize=9)
    return save_figure(fig, stem, formats=("png", "svg"))
