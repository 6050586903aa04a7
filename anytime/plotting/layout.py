"""Figure sizes: each figure's own size on screen, or a paper's full text width or one column of it.

Plot functions build their figures with :func:`panels` or :func:`scaled` and stay unaware of the size; a caller
picks it for everything drawn inside ``with figure_size("column"):``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text

from anytime.errors import AnytimeError
from anytime.utils.figure_sizes import FIGURE_SIZES, FigureSize

_current: ContextVar[FigureSize] = ContextVar("anytime_figure_size", default=FIGURE_SIZES["screen"])


def current_figure_size() -> FigureSize:
    """The size figures are drawn at here (``screen`` outside :func:`figure_size`)."""
    return _current.get()


@contextmanager
def figure_size(name: str) -> Iterator[FigureSize]:
    """Draw every figure made inside at the size ``name`` (one of :data:`FIGURE_SIZES`)."""
    size = FIGURE_SIZES.get(name)
    if size is None:
        raise AnytimeError(f"unknown figure size '{name}'; choose one of: {', '.join(FIGURE_SIZES)}")
    token = _current.set(size)
    try:
        if size.font_pt is None:
            yield size
        else:
            small = size.font_pt - 1
            with rc_context({"font.size": size.font_pt, "axes.titlesize": size.font_pt, "axes.labelsize": size.font_pt,
                             "xtick.labelsize": small, "ytick.labelsize": small, "legend.fontsize": small,
                             "figure.titlesize": size.font_pt + 1, "lines.markersize": 4.0, "lines.linewidth": 1.2}):  # fmt: skip
                yield size
    finally:
        _current.reset(token)


def panels(
    count: int, panel_in: tuple[float, float], *, max_columns: int | None = None,
    width_ratios: Sequence[float] | None = None, **subplot_kw: Any,
) -> tuple[Figure, list[Axes]]:  # fmt: skip
    """A figure of ``count`` panels, each ``panel_in`` (inches) on screen, side by side (``max_columns`` to a
    row). At a paper's width the panels share the width, wrapping onto more rows where a panel would get narrower
    than the size allows, and keep their on-screen shape. Panels are laid out by matplotlib's constrained layout,
    so that labels never overlap a neighbour."""
    size = current_figure_size()
    columns = min(count, max_columns or count)
    if size.width_in is not None:
        columns = max(1, min(columns, int(size.width_in // size.min_panel_in)))
    rows = math.ceil(count / columns)
    columns = math.ceil(count / rows)  # rows as evenly filled as they can be: 3 + 3, not 5 + 1
    width, height = panel_in
    if size.width_in is not None:
        height = min(max(height / width, 0.55), 0.85) * size.width_in / columns
        width = size.width_in / columns
    fig = Figure(figsize=(width * columns, height * rows + (0.3 if size.width_in else 0.0)), layout="constrained")
    ratios = {"width_ratios": width_ratios} if width_ratios and rows == 1 and columns == count else None
    axes = list(np.ravel(fig.subplots(rows, columns, squeeze=False, gridspec_kw=ratios, **subplot_kw)))
    for spare in axes[count:]:
        spare.remove()
    return fig, axes[:count]


def scaled(figsize: tuple[float, float], **figure_kw: Any) -> Figure:
    """A figure of ``figsize`` (inches) on screen, scaled to the width of a paper's page or column (a grid of
    images, a heat map: drawings that keep their proportions)."""
    size = current_figure_size()
    if size.width_in is None:
        return Figure(figsize=figsize, **figure_kw)
    return Figure(figsize=(size.width_in, figsize[1] * size.width_in / figsize[0]), **figure_kw)


def fit_to_size(fig: Figure) -> None:
    """At a paper's width: wrap the titles and axis labels that would run past their axes (or the figure), and
    keep legends off the data (a figure's only legend moves below the panels; several shrink to the small font)."""
    size = current_figure_size()
    if size.width_in is None or size.font_pt is None:
        return
    width_in = fig.get_figwidth()

    def wrap(text: str, inches: float, points: float) -> str:
        chars = max(12, int(inches * 72 / (0.55 * points)))
        return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))

    for text in fig.findobj(Text):  # sizes a plot chose for the screen (annotations, ticks) capped at the paper's
        text.set_fontsize(min(float(text.get_fontsize()), size.font_pt))
    if fig.get_suptitle():
        fig.suptitle(wrap(fig.get_suptitle(), width_in, size.font_pt + 1), fontsize=size.font_pt + 1)
    for ax in fig.axes:
        box = ax.get_position()
        if ax.get_title():
            ax.set_title(wrap(ax.get_title(), box.width * width_in, float(ax.title.get_fontsize())))
        if ax.get_xlabel():
            ax.set_xlabel(wrap(ax.get_xlabel(), box.width * width_in, float(ax.xaxis.label.get_fontsize())))
        if ax.get_ylabel():
            ax.set_ylabel(wrap(ax.get_ylabel(), box.height * fig.get_figheight(), float(ax.yaxis.label.get_fontsize())))
    legends = [(ax, legend) for ax in fig.axes if (legend := ax.get_legend()) is not None]
    small = size.font_pt - 1
    if len(legends) == 1:
        ax, legend = legends[0]
        handles, labels = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
        legend.remove()
        fig.legend(handles, labels, loc="outside lower center", ncol=1 if max(map(len, labels)) > 30 else 2,
                   fontsize=small, frameon=False)  # fmt: skip
    elif legends:
        for _, legend in legends:
            for text in legend.get_texts():
                text.set_fontsize(min(float(text.get_fontsize()), small))
