"""Figure of lesson 14: training loss per step, the distributed runs drawn over the one-device run.

:func:`loss_curves` draws each series as a line over the steps it covers: the
first (the oracle) wide and pale, the others thin with markers on top of it, so
curves that agree lie on each other and a disagreement shows as a marker off
the pale line. The title states the largest difference from the first series.

Plain plotly (survives an HTML export); text at least :data:`~simcomm.viz.style.MIN_FONT_PX`;
as wide as its output column (no fixed width), so it fits a 1024 px screen.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch

from .style import BODY_FONT_PX, SERIES_COLOURS, TITLE_FONT_PX

__all__ = ["loss_curves"]

_FONT = dict(size=BODY_FONT_PX)


def loss_curves(series: Mapping[str, Sequence[float] | torch.Tensor],
                first_steps: Mapping[str, int] | None = None, title: str = "Training loss per step") -> go.Figure:
    """One line per ``{name: losses}``; ``first_steps[name]`` is the step a series starts at (0 if not
    given, e.g. a run resumed from a checkpoint). The first series is the reference; the title
    gives the largest absolute difference of the others from it at the steps they share."""
    if len(series) < 1:
        raise ValueError("loss_curves: series must map at least one name to its losses")
    first_steps = dict(first_steps or {})
    names = list(series)
    values = {name: [float(v) for v in series[name]] for name in names}
    reference = values[names[0]]
    largest = 0.0
    fig = go.Figure()
    for index, name in enumerate(names):
        start = first_steps.get(name, 0)
        steps = list(range(start, start + len(values[name])))
        if index:
            shared = [(v, reference[s]) for v, s in zip(values[name], steps) if s < len(reference)]
            largest = max([largest, *(abs(a - b) for a, b in shared)])
        colour = SERIES_COLOURS[index % len(SERIES_COLOURS)]
        line = dict(color=colour, width=10) if index == 0 else dict(color=colour, width=2)
        fig.add_scatter(x=steps, y=values[name], name=name, mode="lines" if index == 0 else "lines+markers",
                        line=line, opacity=0.35 if index == 0 else 1.0, marker=dict(size=6),
                        hovertemplate="step %{x}: loss %{y:.15f}<extra>" + name + "</extra>")
    subtitle = f"largest difference from {names[0]}: {largest:.1e}" if len(names) > 1 else ""
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss of the global batch")
    heading = f"{title}<br>{subtitle}" if subtitle else title
    fig.update_layout(title=dict(text=heading, font=dict(size=TITLE_FONT_PX)),
                      font=_FONT, template="plotly_white", height=520,
                      legend=dict(font=_FONT, orientation="h", yanchor="top", y=-0.18, x=0),
                      margin=dict(l=90, r=30, t=100, b=130))
    return fig
