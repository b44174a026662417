"""Figures and the layout widget of lessons 09-12 (plotly; text never below 14 px).

=============================  =================================================
``bars_per_rank``              one bar group per rank: a quantity per method (work, bytes)
``tokens_per_expert_figure``   heatmap: tokens each rank sends to each expert
``load_balance_figure``        tokens per expert for several routers (before / after training), mean load
``layout_figure``              modelled step time per layout on each topology, and memory
``LayoutExplorer``             ipywidgets: pick a layout and a topology, run the step, redraw
=============================  =================================================

Every function returns a ``plotly.graph_objects.Figure`` (or the widget) and prints nothing.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..parallel.mesh import Layout
from .style import BODY_FONT_PX, SERIES_COLOURS, TITLE_FONT_PX

__all__ = ["FONT", "bars_per_rank", "tokens_per_expert_figure", "load_balance_figure", "layout_figure",
           "LayoutExplorer"]

#: the smallest text the figures use (px)
FONT = dict(size=BODY_FONT_PX)
_COLOURS = SERIES_COLOURS


def _style(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(title=dict(text=title, font=dict(size=TITLE_FONT_PX)), font=FONT, height=height,
                      legend=dict(font=FONT), hoverlabel=dict(font=dict(size=14)), margin=dict(t=80, l=80, r=30))
    fig.update_xaxes(tickfont=FONT, title_font=FONT)
    fig.update_yaxes(tickfont=FONT, title_font=FONT)
    return fig


def bars_per_rank(values: dict[str, Sequence[float]], *, title: str, y_title: str) -> go.Figure:
    """Grouped bars: for each series name (a method, a layout) its value on each rank."""
    fig = go.Figure()
    for index, (name, per_rank) in enumerate(values.items()):
        fig.add_bar(name=name, x=[f"rank {r}" for r in range(len(per_rank))], y=list(per_rank),
                    marker_color=_COLOURS[index % len(_COLOURS)])
    fig.update_layout(barmode="group", yaxis_title=y_title)
    return _style(fig, title, 420)


def tokens_per_expert_figure(counts: Sequence[Sequence[int]], *, title: str) -> go.Figure:
    """Heatmap of ``counts[rank][expert]``: assignments each rank sends to each expert, with the totals
    per expert (the load each expert's rank computes) above."""
    ranks, experts = len(counts), len(counts[0])
    totals = [sum(row[e] for row in counts) for e in range(experts)]
    fig = make_subplots(rows=2, cols=1, row_heights=[0.3, 0.7], shared_xaxes=True, vertical_spacing=0.06)
    fig.add_bar(x=[f"expert {e}" for e in range(experts)], y=totals, marker_color="#4477aa", name="total",
                showlegend=False, text=totals, textposition="outside", textfont=FONT, row=1, col=1)
    fig.add_heatmap(z=[list(row) for row in counts], x=[f"expert {e}" for e in range(experts)],
                    y=[f"from rank {r}" for r in range(ranks)], colorscale="Blues", text=[list(r) for r in counts],
                    texttemplate="%{text}", textfont=FONT, showscale=False, row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_yaxes(title_text="tokens", row=1, col=1, range=[0, max(totals + [1]) * 1.3])
    return _style(fig, title, 460)


def load_balance_figure(loads: dict[str, Sequence[int]], *, title: str) -> go.Figure:
    """Grouped bars: for each named routing (``{name: tokens per expert}``) the load of every expert, its
    busiest-over-mean ratio in the legend, and the mean load (the same for all: the number of
    assignments does not change) as a dashed line."""
    fig = go.Figure()
    for index, (name, counts) in enumerate(loads.items()):
        counts = list(counts)
        mean = sum(counts) / len(counts)
        fig.add_bar(name=f"{name} (max/mean {max(counts) / mean:.2f})", x=[f"expert {e}" for e in range(len(counts))],
                    y=counts, marker_color=_COLOURS[index % len(_COLOURS)])
    first = list(next(iter(loads.values())))
    fig.add_hline(y=sum(first) / len(first), line_dash="dash", line_color="rgb(60, 60, 60)",
                  annotation_text="mean load", annotation_font=FONT, annotation_position="top right")
    fig.update_layout(barmode="group", yaxis_title="assignments kept", legend=dict(orientation="h", y=-0.2))
    return _style(fig, title, 460)


def _label(row: dict) -> str:
    return f"tp{row['tp']} dp{row['dp']} pp{row['pp']}"


def layout_figure(rows: Sequence[dict], topologies: Sequence[str]) -> go.Figure:
    """Left: modelled step time of each layout on each topology; right: peak memory per rank."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("modelled step time (us)", "peak memory per rank (KiB)"),
                        horizontal_spacing=0.12)
    labels = [_label(row) for row in rows]
    for index, name in enumerate(topologies):
        fig.add_bar(name=name, x=labels, y=[row[name] * 1e6 for row in rows], marker_color=_COLOURS[index],
                    row=1, col=1)
    fig.add_bar(name="memory", x=labels, y=[row["peak_bytes"] / 1024 for row in rows], marker_color="#aa3377",
                showlegend=False, row=1, col=2)
    fig.update_layout(barmode="group")
    fig.update_annotations(font=FONT)
    return _style(fig, "one training step of the block on 8 ranks, per layout (tp, dp, pp)", 480)


def _plotly_output(fig: go.Figure) -> dict:
    spec = json.loads(fig.to_json())
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": spec, "text/plain": fig.layout.title.text or "figure"}}


class LayoutExplorer:
    """Widgets to pick a layout and a topology; each change runs the step
    (:func:`simcomm.planning.layout_choice.measure_layout`, checked against one device) and redraws the
    modelled timeline, titled with the step time and the peak memory per rank.

    Display ``explorer.panel``; ``explorer.figure`` is the figure drawn last (the default one
    until a control changes), ``explorer.row`` its measurements.
    """

    def __init__(self, x, weights, params, heads: int, layouts: Sequence[Layout],
                 topologies: dict, *, layout: Layout | None = None):
        import ipywidgets as widgets

        from ..planning.layout_choice import measure_layout
        from . import timeline_figure

        self._measure, self._timeline = measure_layout, timeline_figure
        self._args = (x, weights, params, heads)
        self.topologies = dict(topologies)
        for given in (*layouts, layout):
            if given is not None and not isinstance(given, Layout):
                raise TypeError(f"LayoutExplorer: {given!r} is not a simcomm.parallel.mesh.Layout; name the "
                                "sizes, e.g. Layout(pp=2, dp=2, tp=2)")
        options = [(f"tp={lay.tp} dp={lay.dp} pp={lay.pp}", lay) for lay in layouts]
        self.layout = widgets.Dropdown(options=options, value=layout or layouts[0], description="layout")
        self.topology = widgets.Dropdown(options=list(self.topologies), description="topology")
        self.output = widgets.Output()
        self.panel = widgets.VBox([widgets.HBox([self.layout, self.topology]), self.output])
        self.layout.observe(lambda change: self.redraw(), names="value")
        self.topology.observe(lambda change: self.redraw(), names="value")
        self.figure: go.Figure | None = None
        self.row: dict | None = None
        self.redraw()

    def redraw(self) -> go.Figure:
        """Run the step for the chosen layout and draw its modelled timeline on the chosen topology."""
        self.row = self._measure(*self._args, self.layout.value)
        name = self.topology.value
        fig = self._timeline(self.row["trace"], modelled=True, topology=self.topologies[name])
        headline = (f"tp={self.row['tp']} dp={self.row['dp']} pp={self.row['pp']} on the {name}: step "
                    f"{self.row[name] * 1e6:.1f} us, peak memory {self.row['peak_bytes'] / 1024:.0f} KiB per rank")
        legend = (fig.layout.title.text or "").partition("<br>")[2]      # the timeline's own key to its patterns
        fig.update_layout(title=dict(text=headline + ("<br>" + legend if legend else ""), font=dict(size=TITLE_FONT_PX)))
        self.figure = fig
        self.output.outputs = (_plotly_output(fig),)
        return fig
