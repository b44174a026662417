"""Which part of a weight matrix each rank holds: :func:`tp_mlp_shards_figure`.

Megatron's tensor-parallel MLP (lesson 04) splits ``w1`` ``(ffn, hidden)`` by
rows and ``w2`` ``(hidden, ffn)`` by columns, exactly as
:func:`simcomm.parallel.tensor.shard_mlp` does; the figure colours every weight by the
rank that holds it, in the rank colours of every other figure.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import MAX_WIDTH_PX, MIN_FONT_PX, rank_colour, rank_colourscale

__all__ = ["tp_mlp_shards_figure"]

#: the smallest font any label of the figure uses, in px (readable when projected)


def tp_mlp_shards_figure(hidden: int, ffn: int, world_size: int) -> go.Figure:
    """``w1`` and ``w2`` side by side, each weight coloured by the rank that holds it.

    Rank ``r`` holds rows ``r*ffn/P .. (r+1)*ffn/P`` of ``w1`` (and the same
    entries of ``b1``) and the same columns of ``w2``; ``b2`` is replicated.
    Raises ``ValueError`` naming the argument when ``ffn`` is not divisible by
    ``world_size`` or a size is not positive.
    """
    for name, value in (("hidden", hidden), ("ffn", ffn), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tp_mlp_shards_figure: {name}={value!r} must be a positive int")
    if ffn % world_size:
        raise ValueError(f"tp_mlp_shards_figure: ffn={ffn} is not divisible by the world size {world_size}")
    per_rank = ffn // world_size
    owner_w1 = [[row // per_rank for _ in range(hidden)] for row in range(ffn)]      # (ffn, hidden)
    owner_w2 = [[col // per_rank for col in range(ffn)] for _ in range(hidden)]      # (hidden, ffn)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[hidden, ffn],
                        subplot_titles=(f"w1 ({ffn}, {hidden}): split by rows",
                                        f"w2 ({hidden}, {ffn}): split by columns"))
    scale = rank_colourscale(world_size)
    for col, owner in ((1, owner_w1), (2, owner_w2)):
        fig.add_trace(go.Heatmap(
            z=owner, zmin=-0.5, zmax=world_size - 0.5, colorscale=scale, showscale=False, xgap=1, ygap=1,
            text=[[f"r{r}" for r in row] for row in owner], texttemplate="%{text}",
            textfont=dict(size=MIN_FONT_PX), hovertemplate="row %{y}, column %{x}: held by rank %{z}<extra></extra>"),
            row=1, col=col)
        fig.update_yaxes(autorange="reversed", title_text="row", scaleanchor="x" if col == 1 else "x2",
                         constrain="domain", row=1, col=col)
        fig.update_xaxes(title_text="column", side="bottom", row=1, col=col)
    for rank in range(world_size):      # a legend: one entry per rank, in its colour
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"rank {rank}",
                                 marker=dict(size=14, symbol="square", color=rank_colour(rank))))
    cell = min(26, (MAX_WIDTH_PX - 160) * 0.88 / (hidden + ffn))     # the figure fits MAX_WIDTH_PX
    fig.update_layout(
        title=dict(text=(f"tensor-parallel MLP on {world_size} ranks: each rank holds {per_rank} rows of w1 "
                         f"and the same {per_rank} columns of w2"), font=dict(size=16)),
        font=dict(size=MIN_FONT_PX), plot_bgcolor="white", paper_bgcolor="white",
        width=int(160 + cell * (hidden + ffn) / 0.88), height=int(180 + cell * max(ffn, hidden)),
        legend=dict(orientation="h", x=0, xref="container", y=0, yref="container", yanchor="bottom"),
        margin=dict(t=90, l=60, r=20, b=110))
    return fig
