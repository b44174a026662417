"""All-reduce algorithms step by step: :func:`ring_allreduce_figure` (ring or tree).

The figure is a plotly animation: one frame per step, a slider and a play
button that work in a static HTML export (no kernel). Each rank's buffer is
split into ``world_size`` chunks; chunk ``c`` of rank ``r`` starts as the
provenance code ``r * base + c`` (:mod:`simcomm.viz.provenance`). A cell
shows the chunk's current partial sum and which ranks it already contains;
its colour is how many ranks it contains. Arrows show the sends of the step.

Ring (the bandwidth-optimal algorithm NCCL uses for large messages), with
``n`` ranks: ``n - 1`` reduce-scatter steps (rank ``r`` sends chunk
``(r - s) mod n`` to rank ``r + 1``, which adds it), after which rank ``r``
holds the complete sum of chunk ``(r + 1) mod n``; then ``n - 1`` all-gather
steps (rank ``r`` sends chunk ``(r + 1 - s) mod n`` to rank ``r + 1``, which
keeps it). Frames: ``2 (n - 1)`` steps plus the start.

Tree: a binomial tree rooted at rank 0 (a simpler relative of NCCL's double
binary tree, without its pipelining): in reduce step ``k`` each rank ``r``
with ``r mod 2^(k+1) = 2^k`` sends its whole buffer to ``r - 2^k``, which
adds it; rank 0 then holds the full sum and the broadcast runs the same tree
backwards. Frames: ``2 ceil(log2 n)`` steps plus the start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from ..parallel.ring import ring_schedule
from .provenance import provenance_base
from .style import SUM_COLOUR, rank_colour

__all__ = ["AllReduceStep", "allreduce_steps", "allreduce_figure", "ring_allreduce_figure", "tree_allreduce_figure"]



def _owner_colourscale(world_size: int) -> list[list]:
    """Bands ``0 .. n-1``: the rank colours; band ``n``: the neutral colour of a sum of several ranks."""
    bands = world_size + 1
    scale = []
    for index in range(bands):
        colour = rank_colour(index) if index < world_size else SUM_COLOUR
        scale += [[index / bands, colour], [(index + 1) / bands, colour]]
    return scale

_ARROW_COLOUR = "rgb(214, 96, 77)"
_SHORT = {"reduce-scatter": "RS", "all-gather": "AG", "reduce": "reduce", "broadcast": "bcast"}


@dataclass
class AllReduceStep:
    """The state after one step: ``values[r][c]`` and ``ranks[r][c]`` (the ranks summed in it).

    ``sends`` are ``(src, dst, chunks)`` of this step; ``phase`` is ``"start"``,
    ``"reduce-scatter"``, ``"all-gather"``, ``"reduce"`` or ``"broadcast"``.
    """

    phase: str
    index: int
    values: list[list[float]]
    ranks: list[list[frozenset[int]]]
    sends: list[tuple[int, int, tuple[int, ...]]]
    explanation: str


def _apply(state: AllReduceStep, sends: list[tuple[int, int, tuple[int, ...]]], add: bool,
           phase: str, index: int, explanation: str) -> AllReduceStep:
    """Every send of a step reads the state before the step, as on real links."""
    values = [row[:] for row in state.values]
    ranks = [row[:] for row in state.ranks]
    for src, dst, chunks in sends:
        for chunk in chunks:
            if add:
                values[dst][chunk] = state.values[dst][chunk] + state.values[src][chunk]
                ranks[dst][chunk] = state.ranks[dst][chunk] | state.ranks[src][chunk]
            else:
                values[dst][chunk] = state.values[src][chunk]
                ranks[dst][chunk] = state.ranks[src][chunk]
    return AllReduceStep(phase, index, values, ranks, sends, explanation)


def allreduce_steps(world_size: int, algorithm: str = "ring") -> list[AllReduceStep]:
    """The start state and the state after every step of ``algorithm`` (``"ring"`` or ``"tree"``)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= 64:
        raise ValueError(f"allreduce_steps: world_size={world_size!r} must be an int from 1 to 64")
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"allreduce_steps: algorithm={algorithm!r} must be 'ring' or 'tree'")
    n = world_size
    base = provenance_base(n)
    state = AllReduceStep(
        "start", 0, [[float(r * base + c) for c in range(n)] for r in range(n)],
        [[frozenset({r}) for _ in range(n)] for r in range(n)], [],
        f"start: rank r's buffer is split into {n} chunks; chunk c of rank r holds r*{base} + c")
    steps = [state]
    if algorithm == "ring":
        schedule = ring_schedule(n)
        for index, transfers in enumerate(schedule):
            reduce = index < n - 1
            s = index if reduce else index - (n - 1)
            sends = [(src, dst, (chunk,)) for src, dst, chunk in transfers]
            if reduce:
                text = (f"reduce-scatter step {s + 1}/{n - 1}: rank r sends chunk (r - {s}) mod {n} to "
                        f"rank r+1, which adds it to its own")
            else:
                text = (f"all-gather step {s + 1}/{n - 1}: rank r sends the complete chunk "
                        f"(r + 1 - {s}) mod {n} to rank r+1, which keeps it")
            state = _apply(state, sends, reduce, "reduce-scatter" if reduce else "all-gather", s + 1, text)
            steps.append(state)
        return steps
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    every_chunk = tuple(range(n))
    for k in range(levels):
        stride = 2 ** k
        sends = [(r, r - stride, every_chunk) for r in range(n) if r % (2 * stride) == stride]
        state = _apply(state, sends, True, "reduce", k + 1,
                       f"tree reduce step {k + 1}/{levels}: each rank r with r mod {2 * stride} = {stride} "
                       f"sends its whole buffer to rank r - {stride}, which adds it")
        steps.append(state)
    for k in reversed(range(levels)):
        stride = 2 ** k
        sends = [(r, r + stride, every_chunk) for r in range(n) if r % (2 * stride) == 0 and r + stride < n]
        state = _apply(state, sends, False, "broadcast", levels - k,
                       f"tree broadcast step {levels - k}/{levels}: each rank r with r mod {2 * stride} = 0 "
                       f"sends the full sum to rank r + {stride}")
        steps.append(state)
    return steps


def _ranges(ranks: frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` as ``"0-2,5"``."""
    ordered, parts = sorted(ranks), []
    start = previous = ordered[0]
    for rank in ordered[1:] + [None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ",".join(parts)


def _frame_parts(step: AllReduceStep, world_size: int, algorithm: str, cell_px: int
                 ) -> tuple[list[dict], list[dict]]:
    """The traces (heatmap, received-cell outlines) and arrow annotations of one step.

    The heatmap's ``z`` is the number of ranks in each partial sum, its
    ``customdata`` the partial sums, its ``text`` the sum and the ranks.
    """
    n = world_size
    # colour means the source rank, as in every figure: a chunk holding one rank's data has that
    # rank's colour; a partial sum of several ranks is neutral, and its text names the ranks
    owner = [[next(iter(cell)) if len(cell) == 1 else n for cell in row] for row in step.ranks]
    labels = [[f"{value:g}<br>{{{_ranges(cell)}}}" for value, cell in zip(values, cells)]
              for values, cells in zip(step.values, step.ranks)]
    show_text = cell_px >= 50
    heatmap = dict(
        type="heatmap", z=owner, customdata=step.values, text=labels, zmin=-0.5, zmax=n + 0.5,
        colorscale=_owner_colourscale(n), showscale=False, xgap=2, ygap=2,
        texttemplate="%{text}" if show_text else "",
        textfont=dict(size=14 if cell_px >= 70 else 12, color="rgb(40, 40, 40)"),
        hovertemplate="rank %{y}, chunk %{x}: partial sum %{text}<extra></extra>",
        x=list(range(n)), y=list(range(n)))
    received = [(dst, chunk) for _, dst, chunks in step.sends for chunk in chunks]
    outline = dict(type="scatter", mode="markers", hoverinfo="skip", showlegend=False,
                   x=[chunk for _, chunk in received], y=[dst for dst, _ in received],
                   marker=dict(symbol="square-open", size=max(6, cell_px - 8),
                               color=_ARROW_COLOUR, line=dict(width=2)))
    arrows = []
    for src, dst, chunks in step.sends:
        # ring: one arrow per chunk, at the cell's right edge; tree: one arrow per buffer, right of the grid
        lanes = [chunk + 0.38 for chunk in chunks] if algorithm == "ring" else [n - 0.5 + 0.3 + 0.25 * (src % 3)]
        for x in lanes:
            arrows.append(dict(x=x, y=dst, ax=x, ay=src, xref="x", yref="y", axref="x", ayref="y", text="",
                               showarrow=True, arrowhead=2, arrowsize=1.2, arrowwidth=2,
                               arrowcolor=_ARROW_COLOUR, standoff=6, startstandoff=6))
    return [heatmap, outline], arrows


def ring_allreduce_figure(world_size: int = 4) -> go.Figure:
    """The ring all-reduce step by step: ``allreduce_figure(world_size, "ring")``."""
    return allreduce_figure(world_size, "ring")


def tree_allreduce_figure(world_size: int = 4) -> go.Figure:
    """The binomial-tree all-reduce step by step: ``allreduce_figure(world_size, "tree")``."""
    return allreduce_figure(world_size, "tree")


def allreduce_figure(world_size: int = 4, algorithm: str = "ring") -> go.Figure:
    """An all-reduce step by step, as animation frames with a slider and a play button.

    Rows are ranks, columns are chunks of each rank's buffer. Every cell
    shows the chunk's partial sum and the ranks it contains (``{0-2}``: ranks
    0, 1 and 2); its colour is how many ranks it contains, outlined cells
    received data in this step, arrows are the step's sends. ``"ring"``:
    ``2 (n - 1)`` steps (reduce-scatter, then all-gather); ``"tree"``:
    ``2 ceil(log2 n)`` steps (binomial-tree reduce to rank 0, then broadcast).
    Frames: the steps plus the start. Works without a kernel, also in
    ``fig.write_html`` exports.
    """
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"allreduce_figure: algorithm={algorithm!r} must be 'ring' or 'tree'")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= 64:
        raise ValueError(f"allreduce_figure: world_size={world_size!r} must be an int from 1 to 64")
    n = world_size
    steps = allreduce_steps(n, algorithm)
    summary = ("ring all-reduce: reduce-scatter then all-gather, each rank sends 2(n-1)/n of its buffer"
               if algorithm == "ring" else
               "tree all-reduce: reduce up a binomial tree to rank 0, then broadcast down it")
    cell_px = max(24, min(84, 600 // n))
    frames, names = [], []
    for step in steps:
        traces, arrows = _frame_parts(step, n, algorithm, cell_px)
        name = "start" if step.phase == "start" else f"{_SHORT[step.phase]}{step.index}"
        names.append(name)
        frames.append(go.Frame(name=name, data=traces, layout=dict(
            annotations=arrows, title=dict(text=f"{summary}<br><sup>{step.explanation}</sup>"))))
    right_lane = 0 if algorithm == "ring" else 1
    animate = dict(mode="immediate", frame=dict(duration=0, redraw=True), transition=dict(duration=0))
    layout = dict(
        title=dict(text=f"{summary}<br><sup>{steps[0].explanation}</sup>", x=0.01, xanchor="left",
                   font=dict(size=14)),
        xaxis=dict(tickvals=list(range(n)), ticktext=[f"chunk {c}" for c in range(n)], range=[-0.5, n - 0.5 + right_lane],
                   showgrid=False, zeroline=False, side="top"),
        yaxis=dict(tickvals=list(range(n)), ticktext=[f"rank {r}" for r in range(n)],
                   range=[n - 0.5, -0.5], showgrid=False, zeroline=False),
        annotations=frames[0].layout.annotations,
        width=int(80 + 130 + cell_px * (n + right_lane)), height=int(120 + 110 + cell_px * n),
        margin=dict(l=80, r=130, t=120, b=110), plot_bgcolor="white", paper_bgcolor="white", font=dict(size=13),
        updatemenus=[dict(
            type="buttons", direction="left", x=0.0, xanchor="right", y=0.0, yanchor="top",
            pad=dict(r=10, t=48), showactive=False, buttons=[
                dict(label="Play", method="animate",
                     args=[None, dict(frame=dict(duration=1000, redraw=True), fromcurrent=True,
                                      transition=dict(duration=0))]),
                dict(label="Pause", method="animate", args=[[None], animate])])],
        sliders=[dict(
            active=0, x=0.0, len=1.0, y=0.0, yanchor="top", pad=dict(t=30),
            currentvalue=dict(prefix="step: "),
            steps=[dict(label=name, method="animate", args=[[name], animate]) for name in names])])
    return go.Figure(data=frames[0].data, layout=layout, frames=frames)
