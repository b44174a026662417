"""``timeline_figure``: where each rank's time went, measured or modelled.

Measured (``modelled=False``): one row per rank, one bar per traced call at its
recorded start and end. Modelled (``modelled=True``): per rank a compute row
and a communication row (:func:`simcomm.model.cost.modelled_timeline`), compute bars,
communication split into *exposed* (the compute lane waits for it: cross-hatched)
and *hidden* (it overlaps compute: plain), and a per-rank summary beside the rows.
Fonts are at least 14 px, for a projector; figures are plain plotly JSON, so an
HTML export keeps them.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..model.cost import modelled_timeline
from ..model.overlap import Placed, Timeline
from ..model.topology import Topology
from ..trace import Trace, TraceEvent
from .style import MAX_WIDTH_PX, MIN_FONT_PX, OP_COLOURS

__all__ = ["timeline_figure", "human_bytes", "MIN_FONT_PX", "sample_ranks", "SAMPLE_ABOVE"]

#: traces of more ranks than this draw a sample of ranks (``ranks=`` picks them)
SAMPLE_ABOVE = 16


def sample_ranks(ranks: list[int], count: int = 8) -> list[int]:
    """``count`` ranks spread evenly over ``ranks`` (sorted), first and last included."""
    ranks = sorted(ranks)
    if len(ranks) <= count:
        return ranks
    step = (len(ranks) - 1) / (count - 1)
    return sorted({ranks[round(i * step)] for i in range(count)})


def _pick(trace_ranks: list[int], ranks) -> list[int] | None:
    """The ranks to draw: ``ranks`` as given, a sample above :data:`SAMPLE_ABOVE`, else all (None)."""
    if ranks is None:
        return sample_ranks(trace_ranks) if len(trace_ranks) > SAMPLE_ABOVE else None
    chosen = sorted(set(ranks))
    unknown = [r for r in chosen if r not in set(trace_ranks)]
    if unknown or not chosen:
        raise ValueError(f"timeline_figure: ranks={list(ranks)!r} must be ranks of the trace "
                         f"({len(trace_ranks)} ranks); not in it: {unknown}")
    return chosen

_OP_COLOURS = OP_COLOURS
_COMPUTE_COLOUR = "rgb(150, 150, 150)"
_WAIT_COLOUR = "rgb(255, 255, 255)"
_EXPOSED_PATTERN = "x"
_BACKWARD_PATTERN = "/"
_FONT = dict(size=MIN_FONT_PX, color="rgb(30, 30, 30)")


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


def _hover(event: TraceEvent, start: float, end: float, unit: str, scale: float, extra: str = "") -> str:
    lines = [f"<b>{event.op}</b> ({event.phase}), step {event.step}, rank {event.rank}"]
    if event.op != "compute":
        shape = f"{event.shape} -> {event.out_shape}" if event.shape is not None else "no tensor"
        lines += [f"group {list(event.group)}" + (" (async)" if event.async_op else ""),
                  f"shape {shape} {event.dtype or ''}".rstrip(),
                  f"sent {human_bytes(sum(event.sent.values()))}, "
                  f"received {human_bytes(sum(event.received.values()))}"]
    lines.append(f"{start * scale:.4g} to {end * scale:.4g} {unit}" + extra)
    return "<br>".join(lines)


def _title(headline: str, subtitle: str) -> dict:
    # a subtitle in a span of its own size: <sup> would shrink it below the projector minimum
    return dict(text=f"{headline}<br><span style='font-size:{MIN_FONT_PX}px'>{subtitle}</span>",
                x=0.01, xanchor="left", font=dict(size=18))


def _measured_source(trace: Trace, source: str | None) -> str:
    backend = source or getattr(trace, "backend", None)
    if backend in (None, ""):
        return ("measured wall-clock time of the traced run (seconds since it started); "
                "modelled=True gives the cost model's picture")
    if str(backend).lower() in ("sim", "simcomm", "simulator"):
        return "measured time of the simulated run (threads of one process: order and overlap, not link speed)"
    return f"measured time on real processes ({backend}), each rank's clock from the start of the run"


def _bar(name: str, group: str, items: list[tuple[str, float, float, str]], colour: str, pattern: str,
         scale: float, show: bool = True) -> dict:
    return dict(
        type="bar", orientation="h", name=name, legendgroup=group, showlegend=show,
        y=[row for row, _, _, _ in items], base=[s * scale for _, s, _, _ in items],
        x=[(e - s) * scale for _, s, e, _ in items], customdata=[h for *_, h in items],
        hovertemplate="%{customdata}<extra></extra>",
        marker=dict(color=colour, line=dict(color="rgb(60, 60, 60)", width=1),
                    pattern=dict(shape=pattern, fgcolor="rgb(30, 30, 30)", solidity=0.35)),
        width=0.7)


def _layout(rows: list[str], unit: str, title: dict, height_per_row: int, right: int = 30) -> dict:
    return dict(
        title=title, barmode="overlay", bargap=0.25, plot_bgcolor="white", paper_bgcolor="white",
        font=_FONT, hoverlabel=dict(font=dict(size=MIN_FONT_PX)),
        xaxis=dict(title=dict(text=f"time ({unit})", font=_FONT), tickfont=_FONT, showgrid=True,
                   gridcolor="rgb(225, 225, 225)", zeroline=False),
        yaxis=dict(categoryorder="array", categoryarray=rows, autorange="reversed", tickfont=_FONT),
        legend=dict(font=_FONT, title=dict(font=_FONT)), height=170 + height_per_row * len(rows),
        margin=dict(l=150, r=right, t=110, b=60))


def _measured_figure(trace: Trace, source: str | None, ranks: list[int] | None) -> go.Figure:
    all_ranks = trace.ranks
    if ranks is not None:
        keep = set(ranks)
        trace = Trace([e for e in trace.events if e.rank in keep])
    placed = [(e, e.start, max(e.end, e.start)) for e in trace.events]
    unit, scale = _time_unit(max(end for _, _, end in placed) or 1e-6)
    ops = sorted({e.op for e in trace.events if e.op != "compute"})
    colours = {op: _OP_COLOURS[i % len(_OP_COLOURS)] for i, op in enumerate(ops)}
    groups: dict[tuple[str, str], list] = {}
    for event, start, end in placed:
        groups.setdefault((event.op, event.phase), []).append(
            (f"rank {event.rank}", start, end, _hover(event, start, end, unit, scale)))
    traces = []
    for (op, phase), items in sorted(groups.items(), key=lambda kv: (kv[0][0] == "compute", kv[0])):
        if op == "compute":
            traces.append(_bar("compute", op, items, _COMPUTE_COLOUR, "", scale))
        else:
            traces.append(_bar(f"{op} ({phase})", op, items, colours[op],
                               _BACKWARD_PATTERN if phase == "backward" else "", scale))
    rows = [f"rank {r}" for r in trace.ranks]
    title = _title("timeline: one row per rank, one bar per call; hatched bars are backward",
                   _measured_source(trace, source) + _sampled(ranks, all_ranks))
    layout = _layout(rows, unit, title, 48)
    layout["legend"]["title"]["text"] = "op (phase)"
    return go.Figure(data=traces, layout=layout)


def _split(timeline: Timeline, item: Placed) -> tuple[list, list]:
    """(exposed, hidden) pieces of a communication bar."""
    exposed = timeline.exposed_parts(item)
    hidden, cursor = [], item.start
    for start, end in sorted(exposed):
        if start > cursor:
            hidden.append((cursor, start))
        cursor = max(cursor, end)
    if item.end > cursor:               # calls of no duration (subgroup) draw nothing
        hidden.append((cursor, item.end))
    return exposed, hidden


def _plain(value: float) -> str:
    """A duration in the figure's unit without scientific notation: 3 significant digits, ``0`` for
    what would not show at that precision (a rounding remainder such as 9.06e-07), thousands
    separated."""
    if abs(value) < 5e-3:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 999.5 else f"{value:.3g}"


def _summary(summary, unit: str, scale: float) -> str:
    def fmt(seconds: float) -> str:
        return _plain(seconds * scale)
    compute = fmt(summary.compute)
    if compute == "0" and summary.compute > 0:
        compute = "under 0.005"          # there is compute, too little for the unit's 3 digits
    text = (f"compute {compute} {unit}<br>comm {fmt(summary.communication)} {unit}: "
            f"<b>exposed {fmt(summary.exposed)}</b>, hidden {fmt(summary.hidden)}")
    if summary.waiting > 0:
        text += f"<br>waits {fmt(summary.waiting)} {unit} for peers"
    return text


def _sampled(ranks: list[int] | None, all_ranks: list[int]) -> str:
    if ranks is None:
        return ""
    return f"<br>{len(ranks)} of {len(all_ranks)} ranks drawn: {', '.join(map(str, ranks))}"


def _overall(timeline: Timeline, unit: str, scale: float) -> str:
    """One line over every rank: step time, and communication exposed / hidden (mean and max)."""
    summaries = list(timeline.ranks.values())
    n = len(summaries)
    step = max(s.end for s in summaries)
    mean = lambda values: sum(values) / n  # noqa: E731
    exposed = [s.exposed for s in summaries]
    return (f"all {n} ranks: step {_plain(step * scale)} {unit}; communication per rank: exposed mean "
            f"{_plain(mean(exposed) * scale)} (max {_plain(max(exposed) * scale)}), hidden mean "
            f"{_plain(mean([s.hidden for s in summaries]) * scale)} {unit}")


def _members(group: list[int]) -> str:
    """``8, 16, ..., 1016`` (first two and last) for a long group; all of a short one."""
    return ", ".join(map(str, group)) if len(group) <= 3 else f"{group[0]}, {group[1]}, ..., {group[-1]}"


def _group_lines(timeline: Timeline, groups: dict, unit: str, scale: float) -> list[str]:
    """Per named partition of the ranks: the mean over its groups of their ranks' mean exposed
    communication, and the group where it is largest."""
    lines = []
    for name, partition in groups.items():
        means = []
        for index, group in enumerate(partition):
            summaries = [timeline.ranks[r] for r in group if r in timeline.ranks]
            if summaries:
                means.append((sum(s.exposed for s in summaries) / len(summaries), index, group))
        if not means:
            continue
        worst = max(means)
        lines.append(f"{name} groups ({len(means)}): exposed comm per rank {sum(m for m, _, _ in means) / len(means) * scale:.3g} "
                     f"{unit} on average, {worst[0] * scale:.3g} in the worst (group {worst[1]}: ranks "
                     f"{_members(worst[2])})")
    return lines


#: a compute block narrower than this share of the time axis is also drawn as a tick (a bar of
#: less than a pixel or two would leave the compute row looking as if it only waited)
TICK_BELOW = 0.004
#: line height of the title's headline and its subtitle lines, and of a legend row (px)
_HEADLINE_PX, _LINE_PX, _LEGEND_ROW_PX = 26, 20, 26


def _compute_ticks(items: list[tuple[str, float, float, str]], end: float, scale: float) -> dict | None:
    """A marker trace: one vertical tick on its compute row for every compute block narrower than
    :data:`TICK_BELOW` of the axis (``end`` seconds), hovering with the block's own times; ``None``
    when every block is wide enough to see as its bar."""
    narrow = [item for item in items if item[2] - item[1] < TICK_BELOW * end]
    if not narrow:
        return None
    return dict(type="scatter", mode="markers", name="compute (too short for a bar)", legendgroup="compute ticks",
                y=[row for row, _, _, _ in narrow], x=[(s + e) / 2 * scale for _, s, e, _ in narrow],
                customdata=[h for *_, h in narrow], hovertemplate="%{customdata}<extra></extra>",
                marker=dict(symbol="line-ns", size=24, line=dict(width=3, color="rgb(70, 70, 70)")))


def _legend_rows(names: list[str], title: str, width: float) -> int:
    """Rows a horizontal legend of ``names`` (after its ``title``) takes when plotly wraps it at
    ``width`` px (the plot area's) at :data:`MIN_FONT_PX`: each entry its text at about 0.6 em a
    character, plus the swatch (a generous estimate: a row too many only adds white space)."""
    def entry(text: str) -> float:
        return 0.6 * MIN_FONT_PX * len(text) + 50
    rows, used = 1, entry(title)
    for name in names:
        if used + entry(name) > width:
            rows, used = rows + 1, 0.0
        used += entry(name)
    return rows


def _title_above_legend_below(layout: dict, title_text: str, names: list[str]) -> None:
    """Lay out a modelled timeline so its title and legend never overlap, however many lines the
    title and rows the legend have: the title at the top of the figure in a top margin sized to its
    lines, the legend at the bottom in a bottom margin sized to its estimated rows (below the axis
    title)."""
    lines = title_text.count("<br>")
    top = 20 + _HEADLINE_PX + _LINE_PX * lines + 20
    legend_title = "op: exposed / hidden"
    rows = _legend_rows(names, legend_title, MAX_WIDTH_PX - layout["margin"]["l"] - layout["margin"]["r"])
    bottom = 70 + _LEGEND_ROW_PX * rows + 10
    layout["title"].update(y=1.0, yref="container", yanchor="top", pad=dict(t=20))
    layout["legend"].update(title=dict(text=legend_title, font=_FONT), orientation="h", x=0.0, xref="container",
                            xanchor="left", y=0.0, yref="container", yanchor="bottom")
    layout["height"] += top - layout["margin"]["t"] + bottom - layout["margin"]["b"]
    layout["margin"].update(t=top, b=bottom)


def _modelled_figure(trace: Trace, topology: str | Topology | None, ranks: list[int] | None,
                     groups: dict | None = None) -> go.Figure:
    timeline = modelled_timeline(trace, topology)
    all_ranks = sorted(timeline.ranks)
    keep = set(ranks) if ranks is not None else None
    end = max([p.end for p in timeline] + [s.end for s in timeline.stalls] + [1e-9])
    unit, scale = _time_unit(end)
    ops = sorted({p.event.op for p in timeline if p.lane == "communication"})
    colours = {op: _OP_COLOURS[i % len(_OP_COLOURS)] for i, op in enumerate(ops)}
    compute_row, comm_row = "rank {} compute".format, "rank {} comm".format
    pieces: dict[tuple[str, str], list] = {}
    for item in timeline:
        event = item.event
        if keep is not None and event.rank not in keep:
            continue
        if item.lane == "compute":
            pieces.setdefault(("compute", ""), []).append(
                (compute_row(event.rank), item.start, item.end, _hover(event, item.start, item.end, unit, scale)))
            continue
        exposed, hidden = _split(timeline, item)
        for kind, parts in (("exposed", exposed), ("hidden", hidden)):
            for start, stop in parts:
                pieces.setdefault((event.op, kind), []).append(
                    (comm_row(event.rank), start, stop,
                     _hover(event, item.start, item.end, unit, scale, f"<br>{kind}: {start * scale:.4g} "
                                                                       f"to {stop * scale:.4g} {unit}")))
    for stall in timeline.stalls:
        if keep is not None and stall.rank not in keep:
            continue
        pieces.setdefault(("waiting", ""), []).append(
            (compute_row(stall.rank), stall.start, stall.end,
             f"rank {stall.rank} waits for <b>{stall.event.op}</b> (step {stall.event.step})<br>"
             f"{stall.start * scale:.4g} to {stall.end * scale:.4g} {unit}"))
    traces = []
    if ("waiting", "") in pieces:     # first, so the compute drawn over the same row stays on top
        traces.append(_bar("compute lane waits", "waiting", pieces[("waiting", "")], _WAIT_COLOUR, ".", scale))
    ticks = _compute_ticks(pieces.get(("compute", ""), []), end, scale)
    if ("compute", "") in pieces:
        traces.append(_bar("compute", "compute", pieces[("compute", "")], _COMPUTE_COLOUR, "", scale))
    if ticks is not None:
        traces.append(ticks)
    for op in ops:
        for kind in ("exposed", "hidden"):
            if (op, kind) in pieces:
                traces.append(_bar(f"{op}: {kind}", op, pieces[(op, kind)], colours[op],
                                   _EXPOSED_PATTERN if kind == "exposed" else "", scale))
    drawn = ranks if ranks is not None else all_ranks
    rows = [row for rank in drawn for row in (compute_row(rank), comm_row(rank))]
    subtitle = ("cross-hatched: exposed (the program waits for it); plain: hidden under compute; "
                "dotted: the program waits"
                + ("<br>a tick |: a compute block too short to show as a bar (hover for its times)" if ticks else "")
                + _sampled(ranks, all_ranks)
                + (f"<br>{_overall(timeline, unit, scale)}" if ranks is not None else "")
                + "".join(f"<br>{line}" for line in _group_lines(timeline, groups or {}, unit, scale)))
    title = _title("modelled timeline: per rank a compute row and a communication row (its own stream)", subtitle)
    layout = _layout(rows, unit, title, 40, right=330)
    _title_above_legend_below(layout, title["text"], [t["name"] for t in traces])
    layout["annotations"] = [
        dict(text=_summary(timeline.ranks[rank], unit, scale), x=1.01, xref="paper", xanchor="left",
             y=comm_row(rank), yref="y", showarrow=False, align="left", font=_FONT)
        for rank in drawn]
    figure = go.Figure(data=traces, layout=layout)
    figure.layout.meta = {"timeline": {rank: vars(s) for rank, s in timeline.ranks.items() if rank in drawn}}
    return figure


def timeline_figure(trace: Trace, modelled: bool = False, *, topology: str | Topology | None = None,
                    source: str | None = None, ranks: list[int] | None = None,
                    groups: dict[str, list[list[int]]] | None = None) -> go.Figure:
    """Where each rank's time went.

    ``modelled=False`` draws the measured start and end of every call, one row
    per rank, bars coloured by op, backward calls hatched; the subtitle says
    where the times come from (``source``, e.g. ``"sim"`` or ``"gloo"``, or the
    trace's ``backend`` attribute when it has one). ``modelled=True`` draws the
    cost model's picture (:func:`simcomm.model.cost.modelled_timeline`): per rank a
    compute row and a communication row, exposed and hidden communication told
    apart by pattern and legend, and a summary per rank (communication,
    exposed, hidden, waiting for peers). ``topology``: annotate the trace for
    this preset first; without it every event must already have a
    ``modelled`` duration (``simcomm.model.cost.annotate``).

    ``ranks``: the ranks to draw. By default a trace of more than
    :data:`SAMPLE_ABOVE` ranks draws 8 of them, spread evenly
    (:func:`sample_ranks`), and says which; the modelled picture is still laid
    out for every rank, and its subtitle sums up all of them (step time,
    exposed and hidden communication, mean and max). ``groups`` (modelled only):
    named partitions of the ranks, e.g. ``layout.partitions()`` of a :class:`simcomm.parallel.mesh.Layout`;
    the subtitle gives each partition's exposed communication per rank, on
    average over its groups and in its worst group.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"timeline_figure: trace must be a simcomm.Trace, got {type(trace).__name__}")
    if not trace.events:
        raise ValueError("timeline_figure: the trace has no events; run a program with World(n).run first")
    picked = _pick(trace.ranks, ranks)
    if not modelled:
        return _measured_figure(trace, source, picked)
    missing = [e for e in trace.events if e.modelled is None]
    if missing and topology is None:
        raise ValueError(
            f"timeline_figure: modelled=True but {len(missing)} of {len(trace.events)} events have no "
            f"modelled duration (first: {missing[0].op} on rank {missing[0].rank}); call "
            f"simcomm.model.cost.annotate(trace, topology) first or pass topology=")
    return _modelled_figure(trace, topology, picked, groups)
