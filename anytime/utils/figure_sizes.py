"""The sizes figures can be drawn at (names and measures only: the CLI and the run's folder rules read them
without importing matplotlib; :mod:`anytime.plotting.layout` draws at them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FigureSize:
    """A figure width and the font size that goes with it.

    ``width_in`` is None for ``screen``: each figure keeps the size it was designed at. ``min_panel_in`` is the
    narrowest a panel may get before panels wrap onto a new row.
    """

    name: str
    width_in: float | None
    font_pt: float | None
    min_panel_in: float
    description: str


FIGURE_SIZES = {
    s.name: s
    for s in (
        FigureSize("screen", None, None, 0.0, "each figure's own size, for screens and the report page"),
        FigureSize("page", 7.0, 8.0, 2.3, "7.0 in wide, 8 pt text: the full text width of a two-column paper"),
        FigureSize("column", 3.4, 7.0, 3.4, "3.4 in wide, 7 pt text: one column of a two-column paper (panels stack)"),
    )
}
