"""How every figure looks, in one place: text sizes, and the colours (colour means the source rank;
a combination of ranks is neutral).

Text never falls below :data:`MIN_FONT_PX` (readable on a projector); titles
use :data:`TITLE_FONT_PX`. Palettes other than the ranks' (ops, memory labels,
series, links) are named here too, so one figure's op or label has the same
colour in every other.

Width: a figure sizes to its output column (plotly's autosize: no ``layout.width``), or,
where its content has a natural width (heatmap cells), is at most :data:`MAX_WIDTH_PX`, so
that it fits JupyterLab's output column at a 1024 px projector (844 px) and an exported
page's (894 px); titles, legends, colour bars and annotations stay inside the figure
(``tests/teaching/test_browser_figures.py`` measures every lesson's figures in Chromium).

Rank colours are light enough for dark cell text and distinct for ten ranks;
rank ``r`` and rank ``r + 10`` share a colour (their codes still differ, and
hover text names the rank).
"""
from __future__ import annotations

import plotly.colors

__all__ = ["MAX_WIDTH_PX", "fit_width", "MIN_FONT_PX", "BODY_FONT_PX", "TITLE_FONT_PX", "TEXT_COLOUR", "RANK_COLOURS", "SUM_COLOUR",
           "MIXED_COLOURSCALE", "VALUE_COLOURSCALE", "OP_COLOURS", "SERIES_COLOURS", "rank_colour",
           "rank_colourscale", "colour_at"]

#: the widest a figure may be (px): JupyterLab's output column at a 1024 px viewport is 844 px
MAX_WIDTH_PX = 840


def fit_width(width: float) -> int:
    """``width`` (px) as a figure's ``layout.width``: at most :data:`MAX_WIDTH_PX`."""
    return int(min(width, MAX_WIDTH_PX))


#: the smallest text any figure draws (px); grids of many cells may go one pixel below
MIN_FONT_PX = 14
#: axis, legend and label text of most figures (px)
BODY_FONT_PX = 16
#: figure titles (px)
TITLE_FONT_PX = 18
#: dark text on the light fills
TEXT_COLOUR = "rgb(30, 30, 30)"

#: plotly's "Pastel" qualitative palette without its grey, which marks combined values here
RANK_COLOURS: tuple[str, ...] = tuple(plotly.colors.qualitative.Pastel[:10])

#: a value that combines several ranks (a sum, a mean, a product): one neutral colour, no scale;
#: the cell's text names the ranks combined (``Σ0-3``), its hover the position they combine
SUM_COLOUR = "rgb(228, 228, 228)"

#: plain values that are not provenance codes (``rank_grid`` of any tensors): near-white to grey
VALUE_COLOURSCALE: list[list] = [[0.0, "rgb(250, 250, 250)"], [1.0, "rgb(160, 160, 160)"]]

#: the colour axis of combined values: every value gets :data:`SUM_COLOUR`
MIXED_COLOURSCALE: list[list] = [[0.0, SUM_COLOUR], [1.0, SUM_COLOUR]]

#: one colour per op in the timelines (plotly's "Set2")
OP_COLOURS: tuple[str, ...] = tuple(plotly.colors.qualitative.Set2)

#: one colour per series (a method, a layout) in bar charts: Paul Tol's "bright" scheme
SERIES_COLOURS: tuple[str, ...] = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb")


def rank_colour(rank: int) -> str:
    """The colour of rank ``rank`` in every figure."""
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def rank_colourscale(world_size: int) -> list[list]:
    """A stepped colour scale over ``[0, 1]``: band ``r`` of ``world_size`` equal bands is rank ``r``'s colour.

    With ``cmin=-0.5`` and ``cmax=world_size * base - 0.5`` it colours every
    provenance code ``r * base + i`` (``0 <= i < base``) by its source rank
    ``r``, and no code falls on a band edge.
    """
    scale = []
    for rank in range(world_size):
        scale.append([rank / world_size, rank_colour(rank)])
        scale.append([(rank + 1) / world_size, rank_colour(rank)])
    return scale


def colour_at(colourscale: list[list], fraction: float) -> str:
    """The colour a plotly colour scale gives ``fraction`` in ``[0, 1]``.

    On a stepped scale, the colour of the band holding ``fraction``; the
    figures keep values off band edges (see :func:`rank_colourscale`).
    """
    fraction = min(max(fraction, 0.0), 1.0)
    for (low, low_colour), (high, high_colour) in zip(colourscale, colourscale[1:]):
        if low <= fraction <= high and high > low:
            if low_colour == high_colour:
                return low_colour
            mixed = plotly.colors.find_intermediate_color(
                plotly.colors.unlabel_rgb(low_colour), plotly.colors.unlabel_rgb(high_colour),
                (fraction - low) / (high - low))
            return plotly.colors.label_rgb(tuple(round(c) for c in mixed))
    return colourscale[-1][1]
