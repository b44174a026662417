"""``comm_matrix_figure``: bytes sent from rank i to rank j over a trace, all ops or one op at a time.

Two ways to count the same trace: ``schedule="direct"`` counts each op by its
definition as a direct exchange (what :mod:`simcomm.trace` records: an
all-reduce sends ``2b/n`` to every peer), ``schedule="ring"`` as NCCL's ring
moves it (every rank sends only to the next rank of its group: ``2(n-1)/n x b``
for an all-reduce). Each rank sends as many bytes either way; where they go
differs. Fonts are at least 14 px (cells grow to hold their numbers).
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..trace import Trace, TraceEvent
from .timeline import human_bytes

__all__ = ["comm_matrix_figure", "ring_sent", "RING_OPS"]

_FONT = dict(size=14)
_COLOURSCALE = [[0.0, "rgb(255, 255, 255)"], [0.15, "rgb(222, 235, 247)"], [1.0, "rgb(107, 174, 214)"]]


#: ops NCCL runs as a ring (a pipelined chain for broadcast and reduce)
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def ring_sent(event: TraceEvent) -> dict[int, int]:
    """Bytes ``event``'s rank sends to each peer when NCCL runs the op as a ring.

    Ring ops (:data:`RING_OPS`) send only to the next rank of the group; other
    ops keep their direct-exchange bytes (``event.sent``). ``b`` is the rank's
    input: all_reduce ``2(n-1)/n x b``; all_gather ``(n-1) x b``;
    reduce_scatter ``(n-1)/n x b``; broadcast and reduce: the whole buffer along
    the chain that starts (ends) at the root.
    """
    group, n = event.group, len(event.group)
    if event.op not in RING_OPS or n < 2:
        return event.sent
    me = group.index(event.rank)
    after = group[(me + 1) % n]
    b = event.nbytes
    if event.op == "all_reduce":
        return {after: 2 * (n - 1) * b // n}
    if event.op == "all_gather":
        return {after: (n - 1) * b}
    if event.op == "reduce_scatter":
        return {after: (n - 1) * b // n}
    if event.op == "broadcast":          # root -> root+1 -> ... -> root-1
        return {} if after == event.root else {after: b}
    return {} if event.rank == event.root else {after: b}        # reduce: ... -> root


def _matrix(trace: Trace, op: str | None, schedule: str) -> list[list[int]]:
    if schedule == "direct":
        return trace.comm_matrix(op)
    size = max((max(e.group) for e in trace.events), default=-1) + 1
    matrix = [[0] * size for _ in range(size)]
    for event in trace.events:
        if op is None or event.op == op:
            for peer, nbytes in ring_sent(event).items():
                matrix[event.rank][peer] += nbytes
    return matrix


def comm_matrix_figure(trace: Trace, schedule: str = "direct") -> go.Figure:
    """Bytes rank ``i`` sent to rank ``j``, summed over the trace (row ``i``, column ``j``).

    A dropdown (no kernel needed) switches between all ops and each op that
    moved bytes. ``schedule="direct"``: bytes per peer follow each op's
    definition as a direct exchange (see :mod:`simcomm.trace`): e.g. an
    all-gather of ``b`` bytes per rank sends ``b`` from every rank to every
    other rank. ``schedule="ring"``: as NCCL's ring moves them
    (:func:`ring_sent`): only to the next rank of the group.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"comm_matrix_figure: trace must be a simcomm.Trace, got {type(trace).__name__}")
    if schedule not in ("direct", "ring"):
        raise ValueError(f"comm_matrix_figure: schedule must be 'direct' or 'ring', got {schedule!r}")
    if not trace.events:
        raise ValueError("comm_matrix_figure: the trace has no events; run a program with World(n).run first")
    totals: dict[str, int] = {}
    for event in trace.events:
        moved = sum((ring_sent(event) if schedule == "ring" else event.sent).values())
        totals[event.op] = totals.get(event.op, 0) + moved
    ops = sorted(op for op, total in totals.items() if total > 0)
    selections = [("all ops", None)] + [(op, op) for op in ops]
    counted = ("as a direct exchange (each op's definition)" if schedule == "direct" else
               "as NCCL's ring moves them (only to the next rank)")
    traces, titles = [], []
    for index, (label, op) in enumerate(selections):
        matrix = _matrix(trace, op, schedule)
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
        titles.append(f"bytes sent from rank i (row) to rank j (column), {counted}<br>"
                      f"<span style='font-size:14px'>{label}: {human_bytes(total)} in all</span>")
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
