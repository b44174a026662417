"""Planning a cluster from a trace: bytes by op and link class, modelled step time, one figure.

A shape-only run (``World(1024, tensors="shape")``) gives the trace of a
program at cluster scale; these functions read it against a topology:

* :func:`cluster` sizes a preset for the run (as many nodes as the ranks need);
* :func:`bytes_by_link` / :func:`link_table`: bytes sent per op, split by the
  link they cross: inside a node (NVLink, or PCIe on a PCIe preset) or between
  nodes (the network), ranks placed ``gpus_per_node`` to a node in rank order;
* :func:`step_summary`: the modelled step time (:func:`simcomm.model.cost.modelled_timeline`)
  and each rank's communication, exposed (the program waits) and hidden
  (under compute), summed up over all ranks and per group;
* :func:`plan_figure`: the node-by-node traffic matrix, the bytes by op and
  link class, and the modelled time of a sample of ranks, in one figure.

Bytes per peer follow each op's definition as a direct exchange
(:mod:`simcomm.trace`), as the trace records them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..model.cost import modelled_timeline
from ..model.overlap import Timeline
from ..model.topology import Topology, get_topology
from ..trace import Trace
from .matrix import aggregated_matrix, blocks_of
from .style import MIN_FONT_PX, TEXT_COLOUR, TITLE_FONT_PX
from .timeline import human_bytes, sample_ranks

__all__ = ["cluster", "link_class", "bytes_by_link", "link_table", "step_summary", "group_summary",
           "plan_figure", "NETWORK"]

#: the link class of traffic between nodes
NETWORK = "network"
_FONT = dict(size=MIN_FONT_PX, color=TEXT_COLOUR)
_COMPUTE, _EXPOSED = "rgb(150, 150, 150)", "rgb(228, 26, 28)"
_WAITING = "rgb(255, 217, 47)"
_LINK_COLOURS = {"nvlink": "rgb(102, 194, 165)", "pcie": "rgb(141, 160, 203)", NETWORK: "rgb(252, 141, 98)"}


def cluster(preset: str | Topology, world_size: int) -> Topology:
    """``preset`` with as many nodes as ``world_size`` ranks need (``gpus_per_node`` each)."""
    topology = get_topology(preset)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"cluster: world_size={world_size!r} must be a positive int")
    nodes = -(-world_size // topology.gpus_per_node)
    if nodes == topology.nodes:
        return topology
    if nodes > 1 and topology.nics_per_node < 1:
        raise ValueError(f"cluster: preset {topology.name!r} is a single node without NICs; "
                         f"{world_size} ranks need {nodes} nodes: pick a cluster preset")
    return dataclasses.replace(topology, name=f"{topology.name} x{nodes} nodes", nodes=nodes)


def link_class(topology: Topology, rank: int, peer: int) -> str:
    """``topology.link_type`` (``"nvlink"``/``"pcie"``) inside a node, :data:`NETWORK` between nodes."""
    return topology.link_type if topology.node_of(rank) == topology.node_of(peer) else NETWORK


def _world_size(trace: Trace) -> int:
    return max((max(e.group) for e in trace.events), default=-1) + 1


def bytes_by_link(trace: Trace, topology: str | Topology) -> dict[str, dict[str, int]]:
    """Bytes sent, by op, then by link class: ``{"all_reduce": {"nvlink": ..., "network": ...}}``."""
    topology = get_topology(topology)
    size = _world_size(trace)
    if size > topology.max_ranks:
        raise ValueError(f"bytes_by_link: the trace has {size} ranks but topology {topology.name!r} has "
                         f"{topology.max_ranks} GPUs; use cluster({topology.name!r}, {size})")
    per_node = topology.gpus_per_node
    totals: dict[str, dict[str, int]] = {}
    for event in trace.events:
        sent = event.sent
        if not sent:
            continue
        by_link = totals.setdefault(event.op, {})
        node = event.rank // per_node
        for peer, nbytes in sent.items():
            link = topology.link_type if peer // per_node == node else NETWORK
            by_link[link] = by_link.get(link, 0) + nbytes
    return totals


def link_table(trace: Trace, topology: str | Topology) -> str:
    """:func:`bytes_by_link` as a plain-text table (bytes summed over all ranks), with totals."""
    topology = get_topology(topology)
    totals = bytes_by_link(trace, topology)
    links = [topology.link_type, NETWORK]
    rows = [[op, *(human_bytes(by.get(link, 0)) for link in links), human_bytes(sum(by.values()))]
            for op, by in sorted(totals.items())]
    rows.append(["total", *(human_bytes(sum(by.get(link, 0) for by in totals.values())) for link in links),
                 human_bytes(sum(sum(by.values()) for by in totals.values()))])
    head = ["op", *links, "all links"]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *rows])


def group_summary(timeline: Timeline, groups: Sequence[Sequence[int]]) -> list[dict]:
    """Per group of global ranks: its ranks' mean and max communication, exposed and hidden
    time, and the latest end (seconds)."""
    rows = []
    for index, group in enumerate(groups):
        summaries = [timeline.ranks[r] for r in group if r in timeline.ranks]
        if not summaries:
            continue
        n = len(summaries)
        rows.append({"group": index, "ranks": list(group),
                     "communication": sum(s.communication for s in summaries) / n,
                     "exposed": sum(s.exposed for s in summaries) / n,
                     "exposed_max": max(s.exposed for s in summaries),
                     "hidden": sum(s.hidden for s in summaries) / n,
                     "end": max(s.end for s in summaries)})
    return rows


def step_summary(trace: Trace, topology: str | Topology, timeline: Timeline | None = None) -> dict:
    """The modelled step on ``topology``: ``step_time`` (the last rank's end), and over ranks the
    mean ``compute``, ``communication``, ``exposed`` and ``hidden`` seconds, the max
    ``exposed``, and the ``slowest_rank``. Annotates the trace (:func:`simcomm.model.cost.annotate`)."""
    timeline = timeline if timeline is not None else modelled_timeline(trace, get_topology(topology))
    summaries = list(timeline.ranks.values())
    if not summaries:
        raise ValueError("step_summary: the trace has no events")
    n = len(summaries)
    slowest = max(summaries, key=lambda s: s.end)
    return {"ranks": n, "step_time": slowest.end, "slowest_rank": slowest.rank,
            "compute": sum(s.compute for s in summaries) / n,
            "communication": sum(s.communication for s in summaries) / n,
            "exposed": sum(s.exposed for s in summaries) / n,
            "exposed_max": max(s.exposed for s in summaries),
            "hidden": sum(s.hidden for s in summaries) / n}


def plan_figure(trace: Trace, topology: str | Topology, *, by="node", ranks: Sequence[int] | None = None
                ) -> go.Figure:
    """One figure for a cluster-scale trace on ``topology`` (a preset sized with :func:`cluster`):

    * left: bytes sent from node (group) i to node (group) j (``by="node"`` or a list of groups);
    * top right: bytes by op, stacked by link class (inside a node vs network);
    * bottom right: the program's own (compute) lane of a sample of ranks (``ranks``,
      default 8 spread evenly, plus the slowest): compute, waiting for exposed
      communication, waiting for peers; the title gives the step time and the mean over
      all ranks of communication, exposed and hidden under compute.
    """
    if not isinstance(trace, Trace) or not trace.events:
        raise ValueError("plan_figure: needs a simcomm.Trace with events (run a program first)")
    topology = get_topology(topology)
    labels, block = blocks_of(trace, by, topology=topology)
    matrix = aggregated_matrix(trace, block, len(labels))
    links = bytes_by_link(trace, topology)
    timeline = modelled_timeline(trace, topology)
    summary = step_summary(trace, topology, timeline)
    drawn = sorted(set(ranks) if ranks is not None else
                   {*sample_ranks(sorted(timeline.ranks), 8), summary["slowest_rank"]})
    unit = "node" if by == "node" else "group"
    figure = make_subplots(rows=2, cols=2, column_widths=[0.5, 0.5], row_heights=[0.5, 0.5],
                           specs=[[{"rowspan": 2}, {}], [None, {}]], horizontal_spacing=0.26,
                           vertical_spacing=0.2,
                           subplot_titles=(f"bytes sent, {unit} (row) to {unit} (column)",
                                           "bytes sent by op and link", "modelled time of sampled ranks"))
    # colour by log10(bytes): traffic inside a node would otherwise hide what crosses the network
    logs = [[math.log10(v) if v > 0 else None for v in row] for row in matrix]
    top = max((v for row in logs for v in row if v is not None), default=1.0)
    figure.add_trace(go.Heatmap(
        z=logs, customdata=matrix, colorscale="Blues", zmin=max(0.0, top - 4), zmax=top,
        colorbar=dict(title=dict(text="bytes", side="top", font=_FONT), x=0.38, xanchor="left", len=0.9,
                      thickness=12,
                      tickvals=list(range(int(max(0.0, top - 4)), int(top) + 1)),
                      ticktext=[human_bytes(10 ** k) for k in range(int(max(0.0, top - 4)), int(top) + 1)],
                      tickfont=_FONT),
        hovertemplate=f"{unit} %{{y}} -> {unit} %{{x}}: %{{customdata}} B<extra></extra>"), row=1, col=1)
    figure.update_yaxes(autorange="reversed", title_text=f"from {unit}", row=1, col=1)
    figure.update_xaxes(title_text=f"to {unit}", row=1, col=1)
    if len(labels) <= 16:       # whole nodes or groups: no fractional ticks
        figure.update_xaxes(dtick=1, row=1, col=1)
        figure.update_yaxes(dtick=1, row=1, col=1)
    ops = sorted(links)
    for link in (topology.link_type, NETWORK):
        figure.add_trace(go.Bar(
            x=ops, y=[links[op].get(link, 0) for op in ops], name=f"{link}" + (" (inside a node)" if link != NETWORK
                                                                              else " (between nodes)"),
            marker_color=_LINK_COLOURS[link], legendgroup="links",
            hovertemplate="%{x}: %{y} B<extra>" + link + "</extra>"), row=1, col=2)
    figure.update_yaxes(title_text="bytes", ticksuffix="B", exponentformat="SI", row=1, col=2)
    scale, time_unit = (1e3, "ms") if summary["step_time"] >= 1e-3 else (1e6, "µs")
    names = [f"rank {r}" for r in drawn]
    parts = (("compute", _COMPUTE, lambda s: s.compute), ("exposed comm", _EXPOSED, lambda s: s.exposed),
             ("waits for peers", _WAITING, lambda s: s.waiting))
    for name, colour, value in parts:
        figure.add_trace(go.Bar(
            y=names, x=[value(timeline.ranks[r]) * scale for r in drawn], name=name, orientation="h",
            marker_color=colour, legendgroup="time",
            hovertemplate="%{y}: %{x:.4g} " + time_unit + "<extra>" + name + "</extra>"), row=2, col=2)
    figure.update_xaxes(title_text=f"time ({time_unit}) of the program's own lane", row=2, col=2)
    figure.update_yaxes(autorange="reversed", row=2, col=2)
    total = sum(sum(by.values()) for by in links.values())
    network = sum(by.get(NETWORK, 0) for by in links.values())
    title = (f"{summary['ranks']} ranks on {topology.name}: modelled step {summary['step_time'] * scale:.4g} "
             f"{time_unit}<br><span style='font-size:{MIN_FONT_PX}px'>per rank (mean): compute "
             f"{summary['compute'] * scale:.3g}, communication {summary['communication'] * scale:.3g} of which "
             f"exposed {summary['exposed'] * scale:.3g} (max {summary['exposed_max'] * scale:.3g}),<br>hidden under "
             f"compute {summary['hidden'] * scale:.3g} {time_unit}; "
             f"{human_bytes(total)} sent in all, {100 * network / total if total else 0:.0f}% over the network"
             f"</span>")
    figure.update_layout(
        title=dict(text=title, x=0.01, xanchor="left", font=dict(size=TITLE_FONT_PX)), font=_FONT, barmode="stack",
        autosize=True, height=760, plot_bgcolor="white", paper_bgcolor="white",
        legend=dict(font=_FONT, orientation="h", x=0.0, y=-0.12, yanchor="top"),
        margin=dict(l=80, r=40, t=140, b=110))
    figure.update_annotations(font=_FONT)
    figure.layout.meta = {"step": summary}
    return figure
