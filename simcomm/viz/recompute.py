"""Figures of lesson 13: activation bytes through a step, and the memory/compute trade of recomputation.

* :func:`activation_curve`: one line per recomputation mode, the activation
  bytes a rank holds at each mark of :func:`simcomm.planning.activations.activation_run`
  (after each layer's forward, then as each layer's backward finishes);
* :func:`trade_figure`: one point per mode, activation bytes per layer against
  the compute of a step relative to no recomputation.

Plain plotly (survives an HTML export); text at least :data:`~simcomm.viz.style.MIN_FONT_PX`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from ..memory import MemoryReport
from .style import BODY_FONT_PX, SERIES_COLOURS, TITLE_FONT_PX

__all__ = ["activation_curve", "trade_figure"]

_FONT = dict(size=BODY_FONT_PX)


def _style(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=dict(text=title, font=dict(size=TITLE_FONT_PX)), font=_FONT, template="plotly_white",
                      height=460, legend=dict(font=_FONT), margin=dict(l=90, r=30, t=80, b=90))
    return fig


def activation_curve(reports: Mapping[str, MemoryReport], rank: int = 0, label: str = "activations") -> go.Figure:
    """Bytes under ``label`` on ``rank`` at every mark, one line per report (``{mode: report}``)."""
    if not reports:
        raise ValueError("activation_curve: reports must map a name to a MemoryReport")
    fig = go.Figure()
    for index, (name, report) in enumerate(reports.items()):
        marks = report.marks
        values = [report[rank].at(mark)[label] for mark in marks]
        fig.add_scatter(x=marks, y=[v / 2 ** 10 for v in values], name=name, mode="lines+markers",
                        line=dict(color=SERIES_COLOURS[index % len(SERIES_COLOURS)], width=3),
                        customdata=values, hovertemplate="%{x}: %{customdata:,} B<extra>" + name + "</extra>")
    fig.update_yaxes(title_text=f"{label} on rank {rank} (KiB)", rangemode="tozero")
    fig.update_xaxes(tickangle=-30)
    return _style(fig, f"Activation memory through one step, by recomputation mode (rank {rank})")


def trade_figure(rows: Sequence[dict]) -> go.Figure:
    """``rows``: ``{"mode", "bytes" (activations per layer), "compute" (relative)}``; one point each."""
    if not rows:
        raise ValueError("trade_figure: rows must hold at least one mode")
    fig = go.Figure()
    for index, row in enumerate(rows):
        fig.add_scatter(x=[row["compute"]], y=[row["bytes"] / 2 ** 10], name=row["mode"], mode="markers+text",
                        text=[row["mode"]], textposition="top center", textfont=_FONT,
                        marker=dict(size=18, color=SERIES_COLOURS[index % len(SERIES_COLOURS)]),
                        hovertemplate="%{x:.3f} x compute, %{y:.1f} KiB per layer<extra></extra>")
    low, high = min(row["compute"] for row in rows), max(row["compute"] for row in rows)
    pad = 0.1 * (high - low) or 0.05          # room for the end points' markers and labels
    fig.update_xaxes(title_text="compute of a step (x the step without recomputation)",
                     range=[low - pad, high + pad])
    top = max(row["bytes"] for row in rows) / 2 ** 10
    # room above the top point's label, and below a point at zero for its whole marker
    fig.update_yaxes(title_text="activations per layer and rank (KiB)", range=[-0.07 * top, 1.2 * top or 1],
                     zeroline=True)
    fig.update_layout(showlegend=False)
    return _style(fig, "Recomputation trades compute for activation memory")
