"""``comm_matrix_figure``: bytes sent from rank i to rank j over a trace, all ops or one op at a time.

Two ways to count the same trace: ``schedule="direct"`` counts each op by its
definition as a direct exchange (what :mod:`simcomm.trace` records: an
all-reduce sends ``2b/n`` to every peer), ``schedule="ring"`` as NCCL's ring
moves it (every rank sends only to the next rank of its group: ``2(n-1)/n x b``
for an all-reduce). Each rank sends as many bytes either way; where they go
differs. Fonts are at least 14 px (cells grow to hold their numbers).

At cluster scale (a shape-only run of 1024 ranks) a rank-by-rank matrix has
a million cells; ``by="node"`` sums the ranks of each node (a preset's
``gpus_per_node``, or ``ranks_per_node``) and ``by=[[...], ...]`` the ranks
of each given group, so the diagonal is what stays inside a node or group.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..trace import Trace, TraceEvent
from .style import MIN_FONT_PX, TITLE_FONT_PX, fit_width
from .timeline import human_bytes

__all__ = ["comm_matrix_figure", "ring_sent", "RING_OPS", "blocks_of", "aggregated_matrix"]

_FONT = dict(size=MIN_FONT_PX)
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


def blocks_of(trace: Trace, by, ranks_per_node: int | None = None, topology=None
              ) -> tuple[list[str], dict[int, int]]:
    """``(labels, block of each rank)`` for ``by``: ``"rank"``, ``"node"`` (``ranks_per_node``
    consecutive ranks, or the ``gpus_per_node`` of ``topology``), or a list of groups of
    global ranks (a partition of the trace's ranks)."""
    size = max((max(e.group) for e in trace.events), default=-1) + 1
    if isinstance(by, str) and by == "rank":
        return [str(r) for r in range(size)], {r: r for r in range(size)}
    if isinstance(by, str) and by == "node":
        if ranks_per_node is None and topology is not None:
            from ..model.topology import get_topology
            ranks_per_node = get_topology(topology).gpus_per_node
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"comm_matrix_figure: by='node' needs ranks_per_node (a positive int) or "
                             f"topology=, got ranks_per_node={ranks_per_node!r}")
        nodes = -(-size // ranks_per_node)
        return [f"node {n}" for n in range(nodes)], {r: r // ranks_per_node for r in range(size)}
    if isinstance(by, str):
        raise ValueError(f"comm_matrix_figure: by={by!r} must be 'rank', 'node' or a list of groups of ranks")
    block: dict[int, int] = {}
    for index, group in enumerate(by):
        for rank in group:
            if rank in block:
                raise ValueError(f"comm_matrix_figure: rank {rank} is in groups {block[rank]} and {index}; "
                                 f"by= must be a partition of the ranks")
            block[rank] = index
    missing = [r for r in range(size) if r not in block]
    if missing:
        raise ValueError(f"comm_matrix_figure: ranks {missing[:10]} of the trace are in none of the "
                         f"{len(by)} groups of by=")
    return [f"group {i}" for i in range(len(by))], block


def aggregated_matrix(trace: Trace, block: dict[int, int], blocks: int, op: str | None = None,
                      schedule: str = "direct") -> list[list[int]]:
    """``matrix[a][b]``: bytes the ranks of block ``a`` sent to the ranks of block ``b``."""
    matrix = [[0] * blocks for _ in range(blocks)]
    for event in trace.events:
        if op is None or event.op == op:
            row = matrix[block[event.rank]]
            for peer, nbytes in (ring_sent(event) if schedule == "ring" else event.sent).items():
                row[block[peer]] += nbytes
    return matrix


def comm_matrix_figure(trace: Trace, schedule: str = "direct", *, by="rank", ranks_per_node: int | None = None,
                       topology=None) -> go.Figure:
    """Bytes rank ``i`` sent to rank ``j``, summed over the trace (row ``i``, column ``j``).

    A dropdown (no kernel needed) switches between all ops and each op that
    moved bytes. ``schedule="direct"``: bytes per peer follow each op's
    definition as a direct exchange (see :mod:`simcomm.trace`): e.g. an
    all-gather of ``b`` bytes per rank sends ``b`` from every rank to every
    other rank. ``schedule="ring"``: as NCCL's ring moves them
    (:func:`ring_sent`): only to the next rank of the group.

    ``by="node"`` sums over the ranks of each node (``ranks_per_node``, or the
    ``gpus_per_node`` of ``topology``: a preset name or Topology); ``by=`` a
    list of groups of global ranks sums over each group. The diagonal is then
    the traffic that stays inside a node (group).
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
    labels, block = blocks_of(trace, by, ranks_per_node, topology)
    unit = "rank" if isinstance(by, str) and by == "rank" else "node" if by == "node" else "group"
    selections = [("all ops", None)] + [(op, op) for op in ops]
    counted = ("as a direct exchange (each op's definition)" if schedule == "direct" else
               "as NCCL's ring moves them (only to the next rank)")
    traces, titles = [], []
    for index, (label, op) in enumerate(selections):
        matrix = (_matrix(trace, op, schedule) if unit == "rank"
                  else aggregated_matrix(trace, block, len(labels), op, schedule))
        size = len(matrix)
        total = sum(map(sum, matrix))
        small = size <= 64     # beyond that, per-cell strings would make the figure megabytes large
        text = [[human_bytes(v) if v else "" for v in row] for row in matrix] if small else None
        hover = [[f"{unit} {i} -> {unit} {j}: {human_bytes(v)} ({v} B)" for j, v in enumerate(row)]
                 for i, row in enumerate(matrix)] if small else None
        traces.append(dict(
            type="heatmap", z=matrix, x=list(range(size)), y=list(range(size)), text=text,
            texttemplate="%{text}" if size <= 12 else "", textfont=dict(size=14, color="rgb(30, 30, 30)"),
            customdata=hover, name=label,
            hovertemplate=("%{customdata}<extra></extra>" if small else
                           f"{unit} %{{y}} -> {unit} %{{x}}: %{{z}} B<extra></extra>"),
            colorscale=_COLOURSCALE, zmin=0, xgap=1 if small else 0, ygap=1 if small else 0,
            visible=index == 0,
            colorbar=dict(title=dict(text="bytes", side="top", font=_FONT), thickness=14, tickfont=_FONT)))
        titles.append(f"bytes sent from {unit} i (row) to {unit} j (column)<br>"
                      f"<span style='font-size:14px'>{counted}<br>{label}: {human_bytes(total)} in all</span>")
    size = len(traces[0]["z"])
    buttons = [dict(label=label, method="update",
                    args=[{"visible": [i == k for i in range(len(traces))]}, {"title.text": titles[k]}])
               for k, (label, _) in enumerate(selections)]
    # numbers like "1.5 KiB" at 14 px need about 64 px; beyond 12 ranks the cells carry colour only
    cell_px = 66 if size <= 12 else max(24, 800 // size) if size <= 64 else max(1, 900 // size)
    ticks = list(range(size)) if size <= 64 else list(range(0, size, -(-size // 16)))
    height = int(270 + cell_px * size)
    layout = dict(          # the title's three lines above the top axis's labels and title
        title=dict(text=titles[0], x=0.01, xanchor="left", y=1.0 - 24 / height, yref="container", yanchor="top",
                   font=dict(size=TITLE_FONT_PX)), font=_FONT,
        xaxis=dict(title=dict(text=f"to {unit}", font=_FONT), tickvals=ticks, side="top",
                   showgrid=False, zeroline=False, tickfont=_FONT),
        yaxis=dict(title=dict(text=f"from {unit}", font=_FONT), tickvals=ticks, autorange="reversed",
                   showgrid=False, zeroline=False, scaleanchor="x", tickfont=_FONT),
        updatemenus=[dict(type="dropdown", buttons=buttons, active=0, x=0.0, xanchor="left", y=-0.04,
                          yanchor="top", showactive=True, font=_FONT)],
        annotations=[dict(text="op:", xref="paper", yref="paper", x=0.0, xanchor="right", y=-0.04,
                          yanchor="top", showarrow=False, yshift=-4, font=_FONT)],
        width=fit_width(max(520, 170 + cell_px * size)), height=height,
        margin=dict(l=80, r=40, t=150, b=70), plot_bgcolor="white", paper_bgcolor="white")
    return go.Figure(data=traces, layout=layout)
