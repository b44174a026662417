"""The stage x time chart of a pipeline schedule, drawn from a program's own trace.

``pipeline_figure(trace, plans)`` lays the trace out in modelled time
(:func:`simcomm.model.cost.modelled_timeline`), takes each rank's ``compute`` events
in program order and names them by the rank's schedule (``plans[rank]``, the
``("F", i)`` / ``("B", i)`` actions of :mod:`simcomm.parallel.pipeline`): one row per
stage, forward boxes light and backward boxes dark in microbatch ``i``'s colour,
each labelled ``F3`` / ``B3``; the gaps are the bubble. Plain plotly with
fonts of at least 14 px: it survives an HTML export.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..model.cost import modelled_timeline
from ..trace import Trace

__all__ = ["pipeline_figure", "pipeline_boxes"]

_FONT = dict(size=15, color="rgb(30, 30, 30)")
_PALETTE = plotly.colors.qualitative.Plotly + plotly.colors.qualitative.Set3


def pipeline_boxes(trace: Trace, plans: Sequence[Sequence[tuple[str, int]]], preset: str = "h100-nvswitch"
                   ) -> list[tuple[int, str, int, float, float]]:
    """``(stage, kind, microbatch, start, end)`` of every action, in modelled seconds.

    Raises ``ValueError`` when a rank's compute events are not one per action of its plan.
    """
    timeline = modelled_timeline(trace, preset)
    boxes = []
    for stage, plan in enumerate(plans):
        compute = [p for p in timeline if p.lane == "compute" and p.event.rank == stage]
        if len(compute) != len(plan):
            raise ValueError(f"pipeline_figure: rank {stage} has {len(compute)} compute events but its plan has "
                             f"{len(plan)} actions; is this the trace of that schedule?")
        boxes += [(stage, kind, i, p.start, p.end) for (kind, i), p in zip(plan, compute)]
    return boxes


def _panel(figure: go.Figure, boxes, row: int, scale: float, show_legend: bool) -> None:
    for kind, label, opacity in (("F", "forward", 0.45), ("B", "backward", 1.0)):
        mine = [b for b in boxes if b[1] == kind]
        if not mine:
            continue
        figure.add_trace(go.Bar(
            orientation="h", y=[f"stage {s}" for s, *_ in mine], base=[start * scale for *_, start, _ in mine],
            x=[(end - start) * scale for *_, start, end in mine], name=label, legendgroup=label,
            showlegend=show_legend, opacity=opacity, width=0.8,
            marker=dict(color=[_PALETTE[i % len(_PALETTE)] for _, _, i, _, _ in mine],
                        line=dict(color="rgb(40, 40, 40)", width=1)),
            text=[f"{kind}{i}" for _, _, i, _, _ in mine], textposition="inside", insidetextanchor="middle", textangle=0, constraintext="none",
            textfont=dict(size=14, color="black"),
            hovertemplate="%{text} on %{y}: %{base:.2f} to %{customdata:.2f} ms<extra></extra>",
            customdata=[end * scale for *_, end in mine]), row=row, col=1)


def pipeline_figure(trace: Trace | Mapping[str, Trace], plans, preset: str = "h100-nvswitch",
                    title: str | None = None) -> go.Figure:
    """Stage x time chart(s): one trace and its plans, or ``{name: trace}`` with ``{name: plans}``
    drawn one above the other on a shared time axis (milliseconds)."""
    traces = dict(trace) if isinstance(trace, Mapping) else {"": trace}
    all_plans = dict(plans) if isinstance(plans, Mapping) else {"": plans}
    if set(traces) != set(all_plans):
        raise ValueError(f"pipeline_figure: traces for {sorted(traces)} but plans for {sorted(all_plans)}")
    names = list(traces)
    figure = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                           subplot_titles=[n for n in names] if names != [""] else None)
    scale = 1e3
    for row, name in enumerate(names, start=1):
        _panel(figure, pipeline_boxes(traces[name], all_plans[name], preset), row, scale, row == 1)
        stages = len(all_plans[name])
        figure.update_yaxes(categoryorder="array", categoryarray=[f"stage {s}" for s in range(stages)],
                            autorange="reversed", tickfont=_FONT, row=row, col=1)
    figure.update_xaxes(title=dict(text="modelled time (ms)", font=_FONT), tickfont=_FONT, showgrid=True,
                        gridcolor="rgb(225, 225, 225)", row=len(names), col=1)
    figure.update_annotations(font=dict(size=16))
    figure.update_layout(
        barmode="overlay", plot_bgcolor="white", paper_bgcolor="white", font=_FONT,
        title=dict(text=title or "pipeline schedule: one row per stage; light = forward, dark = backward; "
                   "gaps = bubble", font=dict(size=17)),
        legend=dict(font=_FONT), height=140 + 190 * len(names), width=1100, margin=dict(l=90, r=20, t=80, b=60))
    return figure
