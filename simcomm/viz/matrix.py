"""``comm_matrix_figure``: bytes sent from rank i to rank j over a trace, all ops or one op at a time."""
from __future__ import annotations

import plotly.graph_objects as go

from ..trace import Trace
from .timeline import human_bytes

__all__ = ["comm_matrix_figure"]

_COLOURSCALE = [[0.0, "rgb(255, 255, 255)"], [0.15, "rgb(222, 235, 247)"], [1.0, "rgb(107, 174, 214)"]]


def comm_matrix_figure(trace: Trace) -> go.Figure:
    """Bytes rank ``i`` sent to rank ``j``, summed over the trace (row ``i``, column ``j``).

    A dropdown (no kernel needed) switches between all ops and each op that
    moved bytes. Bytes per peer follow each op's definition as a direct
    exchange (see :mod:`simcomm.trace`): e.g. an all-gather of ``b`` bytes per
    rank sends ``b`` from every rank to every other rank.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"comm_matrix_figure: trace must be a simcomm.Trace, got {type(trace).__name__}")
    if not trace.events:
        raise ValueError("comm_matrix_figure: the trace has no events; run a program with World(n).run first")
    by_op = trace.bytes_by_op()
    ops = sorted(op for op, total in by_op.items() if total > 0)
    selections = [("all ops", None)] + [(op, op) for op in ops]
    traces, titles = [], []
    for index, (label, op) in enumerate(selections):
        matrix = trace.comm_matrix(op)
        size = len(matrix)
        total = sum(map(sum, matrix))
        text = [[human_bytes(v) if v else "" for v in row] for row in matrix]
        hover = [[f"rank {i} -> rank {j}: {human_bytes(v)} ({v} B)" for j, v in enumerate(row)]
                 for i, row in enumerate(matrix)]
        traces.append(dict(
            type="heatmap", z=matrix, x=list(range(size)), y=list(range(size)), text=text,
            texttemplate="%{text}" if size <= 12 else "", textfont=dict(size=11, color="rgb(40, 40, 40)"),
            customdata=hover, hovertemplate="%{customdata}<extra></extra>", name=label,
            colorscale=_COLOURSCALE, zmin=0, xgap=1, ygap=1, visible=index == 0,
            colorbar=dict(title=dict(text="bytes", side="top"), thickness=14)))
        titles.append(f"bytes sent from rank i (row) to rank j (column)<br><sup>{label}: "
                      f"{human_bytes(total)} in all</sup>")
    size = len(traces[0]["z"])
    buttons = [dict(label=label, method="update",
                    args=[{"visible": [i == k for i in range(len(traces))]}, {"title.text": titles[k]}])
               for k, (label, _) in enumerate(selections)]
    cell_px = max(24, min(70, 560 // max(size, 1)))
    layout = dict(
        title=dict(text=titles[0], x=0.01, xanchor="left", font=dict(size=14)),
        xaxis=dict(title="to rank", tickvals=list(range(size)), side="top", showgrid=False, zeroline=False),
        yaxis=dict(title="from rank", tickvals=list(range(size)), autorange="reversed", showgrid=False,
                   zeroline=False, scaleanchor="x"),
        updatemenus=[dict(type="dropdown", buttons=buttons, active=0, x=0.0, xanchor="left", y=-0.04,
                          yanchor="top", showactive=True)],
        annotations=[dict(text="op:", xref="paper", yref="paper", x=0.0, xanchor="right", y=-0.04,
                          yanchor="top", showarrow=False, yshift=-4)],
        width=int(max(520, 170 + cell_px * size)), height=int(230 + cell_px * size),
        margin=dict(l=80, r=40, t=110, b=70), plot_bgcolor="white", paper_bgcolor="white")
    return go.Figure(data=traces, layout=layout)
