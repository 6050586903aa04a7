"""Figure sizes: panels keep to a paper's page or column width, titles and legends fit it."""

from __future__ import annotations

import pytest
from PIL import Image

from anytime.errors import AnytimeError
from anytime.plotting import figure_size, save_figure
from anytime.plotting.layout import current_figure_size, panels
from anytime.utils.figure_sizes import FIGURE_SIZES
from anytime.utils.outputs import _RUN_SUBFOLDERS


def _grid(axes):
    spec = axes[0].get_subplotspec().get_gridspec()
    return spec.nrows, spec.ncols


def test_panels_sit_side_by_side_on_screen_and_wrap_at_a_papers_width():
    fig, axes = panels(3, (5, 4.2))
    assert tuple(fig.get_size_inches()) == pytest.approx((15, 4.2)) and _grid(axes) == (1, 3)
    fig, axes = panels(6, (2.6, 2.8), max_columns=5)
    assert _grid(axes) == (2, 3) and tuple(fig.get_size_inches()) == pytest.approx((7.8, 5.6))
    with figure_size("page"):
        fig, axes = panels(3, (5, 4.2))
        assert fig.get_figwidth() == pytest.approx(7.0) and _grid(axes) == (1, 3)
        fig, axes = panels(4, (2.6, 2.8), max_columns=5)  # rows as even as they can be: 2 x 2, not 3 + 1
        assert _grid(axes) == (2, 2) and len(axes) == 4
        fig, axes = panels(5, (2.6, 2.8), max_columns=5)
        assert _grid(axes) == (2, 3) and len(fig.axes) == 5  # the sixth cell is not drawn
    with figure_size("column"):
        fig, axes = panels(3, (5, 4.2), width_ratios=[2, 1, 1])  # stacked: the ratios of one row no longer apply
        assert fig.get_figwidth() == pytest.approx(3.4) and _grid(axes) == (3, 1)
        assert fig.get_figheight() > 3 * 0.55 * 3.4
    assert current_figure_size().name == "screen"  # the size ends with its block


def test_a_column_figure_is_a_column_wide_with_its_text_fitted(tmp_path):
    long_title = (
        "fastcnn on cifar10: accuracy of every exit against the mean FLOPs per sample (5000 validation samples)"
    )
    with figure_size("column"):
        fig, (ax,) = panels(1, (7, 4.8))
        for k in range(6):
            ax.plot([0, 1], [k, k + 1], label=f"criterion {k} (Pareto front, area 81.{k}%)")
        ax.annotate("exit0", (0.5, 0.5), fontsize=12)
        ax.set_title(long_title)
        ax.legend(fontsize=8)
        paths = save_figure(fig, tmp_path / "fig")
    assert {p.suffix for p in paths} == {".png", ".svg", ".pdf"}
    width = Image.open(tmp_path / "fig.png").size[0]
    assert 430 <= width <= 580  # 3.4 in at 150 dpi; an unwrapped title would have widened it past 1,000 pixels
    assert ax.get_legend() is None and len(fig.legends) == 1  # the only legend moved below the panel
    assert "\n" in ax.get_title()
    assert max(t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize"))) <= 8


def test_an_unknown_size_is_refused_and_the_run_folder_rule_knows_every_paper_size():
    with pytest.raises(AnytimeError, match="unknown figure size 'poster'; choose one of: screen, page, column"):
        with figure_size("poster"):
            pass
    assert set(_RUN_SUBFOLDERS["plots"][1]) == set(FIGURE_SIZES) - {"screen"}
