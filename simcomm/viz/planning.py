"""Figures of lesson 15: memory per GPU by label and modelled step time, one bar per layout.

:func:`layout_memory_figure` draws rows of :func:`simcomm.planning.planner.plan`:
with a memory ``limit`` it first keeps the rows that fit it, then ranks those by
modelled step time and draws the ``top`` fastest (filter, then rank: a layout
that does not fit is no candidate however fast); ``fitting_only=False`` draws
the fastest rows whether they fit or not (to show what fails). Stacked bars of
GiB per GPU by label (:data:`~simcomm.planning.planner.LABELS`), a dashed line at
the limit, the modelled step time as markers on a second axis. Plain plotly;
text at least 14 px; the figure takes its container's width (no fixed pixel
width), legend below the plot so nothing is clipped at 1024 px.
"""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ..planning.planner import LABELS, GiB, key
from .style import BODY_FONT_PX, TITLE_FONT_PX

__all__ = ["layout_memory_figure", "COLOURS"]

_FONT = dict(size=BODY_FONT_PX)
#: one colour per memory label (plotly's "Safe" palette, readable for colour-blind viewers)
COLOURS = dict(zip(LABELS, ("#88CCEE", "#CC6677", "#DDCC77", "#AA4499", "#117733", "#332288", "#BBBBBB")))


def layout_memory_figure(rows: Sequence[dict], limit: float | None = None, *, title: str = "",
                         top: int | None = 16, fitting_only: bool = True) -> go.Figure:
    """Bars of GiB per GPU by label for the ``top`` fastest of ``rows`` (``None``: all) that fit
    ``limit`` bytes (all rows when ``limit`` is None or ``fitting_only`` is False), the ``limit`` as
    a line, the step time (s) as markers on the right axis."""
    if not rows:
        raise ValueError("layout_memory_figure: rows must hold at least one layout")
    candidates = [row for row in rows if limit is None or not fitting_only or row["total"] <= limit]
    if not candidates:
        raise ValueError(f"layout_memory_figure: no row fits limit={limit!r} bytes "
                         f"({limit / GiB:.1f} GiB); pass fitting_only=False to draw them anyway")
    shown = sorted(candidates, key=lambda row: row["step_time"])[:top]
    names = ["tp{} cp{} pp{} dp{}".format(*key(row)) for row in shown]
    fig = go.Figure()
    for label in LABELS:
        if not any(row.get(label, 0) for row in shown):
            continue
        fig.add_bar(x=names, y=[row.get(label, 0) / GiB for row in shown], name=label.replace("_", " "),
                    marker_color=COLOURS[label], hovertemplate="%{x}: %{y:.1f} GiB<extra>" + label + "</extra>")
    fig.add_scatter(x=names, y=[row["step_time"] for row in shown], name="modelled step (s)", yaxis="y2",
                    mode="markers", marker=dict(symbol="diamond", size=12, color="black"),
                    hovertemplate="%{x}: %{y:.2f} s<extra></extra>")
    if limit is not None:
        fig.add_hline(y=limit / GiB, line=dict(dash="dash", color="rgb(200, 0, 0)", width=2),
                      annotation_text=f"{limit / GiB:.1f} GiB", annotation_font=_FONT,
                      annotation_position="top left")
    rule = "fastest fitting layouts first" if limit is not None and fitting_only else "fastest layouts first"
    fig.update_layout(barmode="stack", template="plotly_white", font=_FONT, autosize=True, height=560,
                      title=dict(text=title or f"Memory per GPU and modelled step time, {rule}",
                                 font=dict(size=TITLE_FONT_PX), x=0.01, xanchor="left"),
                      yaxis=dict(title="GiB per GPU (the fullest stage)", rangemode="tozero"),
                      yaxis2=dict(title="modelled step (s)", overlaying="y", side="right", rangemode="tozero",
                                  showgrid=False),
                      xaxis=dict(tickangle=-40, tickfont=dict(size=14), automargin=True),
                      legend=dict(orientation="h", y=-0.3, yanchor="top", x=0, font=_FONT),
                      margin=dict(l=70, r=70, t=70, b=60))
    return fig
