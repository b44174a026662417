"""Figures of lesson 15: memory per GPU by label and modelled step time, one bar per layout.

:func:`layout_memory_figure` draws the rows of :func:`simcomm.planning.planner.plan`
(sorted by step time, the fastest first): stacked bars of bytes per GPU by
label, a dashed line at the memory limit, and the modelled step time as
markers on a second axis. Plain plotly; text at least 14 px; 1000 px wide.
"""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ..planning.planner import LABELS, GiB, key
from .memory import LABEL_COLOURS
from .style import BODY_FONT_PX, TITLE_FONT_PX

__all__ = ["layout_memory_figure"]

_FONT = dict(size=BODY_FONT_PX)


def layout_memory_figure(rows: Sequence[dict], limit: float | None = None, *, title: str = "",
                         top: int | None = 16) -> go.Figure:
    """Bars of GiB per GPU by label for ``rows`` (the ``top`` fastest; ``None``: all), the
    ``limit`` (bytes) as a line, the step time (s) as markers on the right axis."""
    if not rows:
        raise ValueError("layout_memory_figure: rows must hold at least one layout")
    shown = sorted(rows, key=lambda row: row["step_time"])[:top]
    names = ["tp{} cp{} pp{} dp{}".format(*key(row)) for row in shown]
    fig = go.Figure()
    for label in LABELS:
        fig.add_bar(x=names, y=[row[label] / GiB for row in shown], name=label.replace("_", " "),
                    marker_color=LABEL_COLOURS[label],
                    hovertemplate="%{x}: %{y:.1f} GiB<extra>" + label + "</extra>")
    fig.add_scatter(x=names, y=[row["step_time"] for row in shown], name="modelled step (s)", yaxis="y2",
                    mode="markers", marker=dict(symbol="diamond", size=12, color="black"),
                    hovertemplate="%{x}: %{y:.2f} s<extra></extra>")
    if limit is not None:
        fig.add_hline(y=limit / GiB, line=dict(dash="dash", color="rgb(200, 0, 0)", width=2),
                      annotation_text=f"{limit / GiB:.0f} GiB", annotation_font=_FONT)
    fig.update_layout(barmode="stack", template="plotly_white", font=_FONT, width=1000, height=520,
                      title=dict(text=title or "Memory per GPU and modelled step time, fastest layouts first",
                                 font=dict(size=TITLE_FONT_PX)),
                      yaxis=dict(title="GiB per GPU (the fullest stage)", rangemode="tozero"),
                      yaxis2=dict(title="modelled step (s)", overlaying="y", side="right", rangemode="tozero",
                                  showgrid=False),
                      xaxis=dict(tickangle=-40, tickfont=dict(size=14)),
                      legend=dict(orientation="h", y=1.08, x=0, font=_FONT), margin=dict(l=80, r=80, t=110, b=140))
    return fig
