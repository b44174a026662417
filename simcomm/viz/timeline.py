"""``timeline_figure``: one row per rank, one bar per traced call, forward and backward told apart."""
from __future__ import annotations

import plotly.colors
import plotly.graph_objects as go

from ..cost import modelled_timeline
from ..trace import Trace, TraceEvent

__all__ = ["timeline_figure", "human_bytes"]

_OP_COLOURS = plotly.colors.qualitative.Set2
_COMPUTE_COLOUR = "rgb(200, 200, 200)"


def human_bytes(nbytes: float) -> str:
    """``1536`` as ``"1.5 KiB"``; below 1 KiB as ``"96 B"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds < 1e-3:
        return "µs", 1e6
    if seconds < 1.0:
        return "ms", 1e3
    return "s", 1.0


def _hover(event: TraceEvent, start: float, duration: float, unit: str, scale: float) -> str:
    shape = f"{event.shape} -> {event.out_shape}" if event.shape is not None else "no tensor"
    lines = [f"<b>{event.op}</b> ({event.phase}), step {event.step}, rank {event.rank}",
             f"group {list(event.group)}", f"shape {shape} {event.dtype or ''}".rstrip(),
             f"sent {human_bytes(sum(event.sent.values()))}, received {human_bytes(sum(event.received.values()))}",
             f"{start * scale:.4g} to {(start + duration) * scale:.4g} {unit}"]
    return "<br>".join(lines)


def timeline_figure(trace: Trace, modelled: bool = False) -> go.Figure:
    """When each rank was in each call: one row per rank, one bar per traced call.

    Bars are coloured by op; backward-phase calls are hatched and listed as
    their own legend entries. Hover shows op, phase, step, group, shapes and
    bytes sent/received.

    ``modelled=False`` draws the measured start and end times of the run
    (threads of this process: they show order and overlap, not network
    speed). ``modelled=True`` draws each event's ``modelled`` duration (set by
    ``simcomm.cost.annotate(trace, topology)``) with every rank's calls laid
    end to end in their order, a collective starting when the last member of
    its group reaches it (:func:`simcomm.cost.modelled_timeline`); a trace
    whose calls do not match up across ranks (filtered) is laid out rank by
    rank without that wait.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"timeline_figure: trace must be a simcomm.Trace, got {type(trace).__name__}")
    if not trace.events:
        raise ValueError("timeline_figure: the trace has no events; run a program with World(n).run first")
    placed: list[tuple[TraceEvent, float, float]] = []
    if modelled:
        missing = [e for e in trace.events if e.modelled is None]
        if missing:
            raise ValueError(
                f"timeline_figure: modelled=True but {len(missing)} of {len(trace.events)} events have no "
                f"modelled duration (first: {missing[0].op} on rank {missing[0].rank}); call "
                f"simcomm.cost.annotate(trace, topology) first")
        try:  # collectives start when the last member arrives (simcomm.cost.modelled_timeline)
            placed = [(event, start, end - start) for event, start, end in modelled_timeline(trace)]
            synchronised = True
        except ValueError:  # a filtered trace whose calls do not match up: each rank on its own
            cursor: dict[int, float] = {}
            for event in trace.events:  # sorted by start time: each rank's calls in program order
                start = cursor.get(event.rank, 0.0)
                placed.append((event, start, event.modelled))
                cursor[event.rank] = start + event.modelled
            synchronised = False
    else:
        placed = [(e, e.start, max(e.duration, 0.0)) for e in trace.events]
    unit, scale = _time_unit(max(start + duration for _, start, duration in placed) or 1e-6)
    ops = sorted({e.op for e in trace.events if e.op != "compute"})
    colours = {op: _OP_COLOURS[i % len(_OP_COLOURS)] for i, op in enumerate(ops)}
    colours["compute"] = _COMPUTE_COLOUR
    groups: dict[tuple[str, str], list[tuple[TraceEvent, float, float]]] = {}
    for item in placed:
        groups.setdefault((item[0].op, item[0].phase), []).append(item)
    ranks = trace.ranks
    traces = []
    for (op, phase), items in sorted(groups.items(), key=lambda kv: (kv[0][0] == "compute", kv[0])):
        backward = phase == "backward"
        traces.append(dict(
            type="bar", orientation="h", name=f"{op} ({phase})" if op != "compute" else "compute",
            legendgroup=op, y=[f"rank {e.rank}" for e, _, _ in items], base=[s * scale for _, s, _ in items],
            x=[d * scale for _, _, d in items], customdata=[_hover(e, s, d, unit, scale) for e, s, d in items],
            hovertemplate="%{customdata}<extra></extra>",
            marker=dict(color=colours[op], line=dict(color="rgb(90, 90, 90)", width=0.5),
                        pattern=dict(shape="/" if backward else "", fgcolor="rgb(80, 80, 80)", solidity=0.25)),
            width=0.6))
    what = (("modelled time: each rank's calls end to end with the cost model's durations"
             + ("; a collective starts when its last member arrives" if synchronised else
                "; the trace's calls do not match up across ranks, so each rank is laid out alone"))
            if modelled else
            "measured time of the simulated run (threads in this process: order and overlap, not link speed)")
    layout = dict(
        title=dict(text=f"timeline: one row per rank, one bar per collective; hatched bars are backward<br>"
                        f"<sup>{what}</sup>", x=0.01, xanchor="left", font=dict(size=14)),
        barmode="overlay", bargap=0.3, plot_bgcolor="white", paper_bgcolor="white",
        xaxis=dict(title=f"{'modelled ' if modelled else ''}time ({unit})", showgrid=True,
                   gridcolor="rgb(235, 235, 235)", zeroline=False),
        yaxis=dict(categoryorder="array", categoryarray=[f"rank {r}" for r in ranks], autorange="reversed"),
        legend=dict(title=dict(text="op (phase)")), height=160 + 40 * len(ranks), width=900,
        margin=dict(l=70, r=20, t=80, b=50))
    return go.Figure(data=traces, layout=layout)
