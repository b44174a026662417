"""``comm_matrix_figure``: bytes sent from rank i to rank j over a trace, all ops or one op at a time.

Fonts are at least 14 px (cells grow to hold their numbers), for a projector.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..trace import Trace
from .timeline import human_bytes

__all__ = ["comm_matrix_figure"]

_FONT = dict(size=14)
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
            texttemplate="%{text}" if size <= 12 else "", textfont=dict(size=14, color="rgb(30, 30, 30)"),
            customdata=hover, hovertemplate="%{customdata}<extra></extra>", name=label,
            colorscale=_COLOURSCALE, zmin=0, xgap=1, ygap=1, visible=index == 0,
            colorbar=dict(title=dict(text="bytes", side="top", font=_FONT), thickness=14, tickfont=_FONT)))
        titles.append(f"bytes sent from rank i (row) to rank j (column)<br><span style='font-size:14px'>"
                      f"{label}: {human_bytes(total)} in all</span>")
    size = len(traces[0]["z"])
    buttons = [dict(label=label, method="update",
                    args=[{"visible": [i == k for i in range(len(traces))]}, {"title.text": titles[k]}])
               for k, (label, _) in enumerate(selections)]
    # numbers like "1.5 KiB" at 14 px need about 64 px; beyond 12 ranks the cells carry colour only
    cell_px = 66 if size <= 12 else max(24, 800 // size)
    layout = dict(
        title=dict(text=titles[0], x=0.01, xanchor="left", font=dict(size=18)), font=_FONT,
        xaxis=dict(title=dict(text="to rank", font=_FONT), tickvals=list(range(size)), side="top",
                   showgrid=False, zeroline=False, tickfont=_FONT),
        yaxis=dict(title=dict(text="from rank", font=_FONT), tickvals=list(range(size)), autorange="reversed",
                   showgrid=False, zeroline=False, scaleanchor="x", tickfont=_FONT),
        updatemenus=[dict(type="dropdown", buttons=buttons, active=0, x=0.0, xanchor="left", y=-0.04,
                          yanchor="top", showactive=True, font=_FONT)],
        annotations=[dict(text="op:", xref="paper", yref="paper", x=0.0, xanchor="right", y=-0.04,
                          yanchor="top", showarrow=False, yshift=-4, font=_FONT)],
        width=int(max(520, 170 + cell_px * size)), height=int(230 + cell_px * size),
        margin=dict(l=80, r=40, t=110, b=70), plot_bgcolor="white", paper_bgcolor="white")
    return go.Figure(data=traces, layout=layout)
