"""Bus bandwidth against message size: measured (``real.bench``) beside the cost model.

``busbw_figure(measured, topology)`` draws one colour per op: measured rows
as markers joined by a solid line, the model's prediction for the same op
and world size as a dashed line (dotted, one per algorithm, with
``algorithms=True``). The x axis is the message size in nccl-tests'
convention (:mod:`simcomm.cost`), logarithmic.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import plotly.colors
import plotly.graph_objects as go

from ..cost import ALGORITHMS, GB, Topology, estimate, get_topology

__all__ = ["busbw_figure", "load_measured"]

_OP_COLOURS = dict(zip(ALGORITHMS, plotly.colors.qualitative.Plotly))
_DASHES = ("dash", "dot", "dashdot", "longdash")


def load_measured(measured) -> tuple[list[dict], dict]:
    """(rows, meta) from a ``real.bench --json`` file path, its loaded dict, or a list of rows."""
    if measured is None:
        return [], {}
    if isinstance(measured, (str, os.PathLike)):
        with open(measured) as f:
            measured = json.load(f)
    if isinstance(measured, dict):
        if "rows" not in measured:
            raise ValueError(f"busbw_figure: measured dict has no 'rows' (keys: {sorted(measured)})")
        return list(measured["rows"]), {k: v for k, v in measured.items() if k != "rows"}
    rows = list(measured)
    for row in rows:
        missing = {"op", "size", "busbw"} - set(row)
        if missing:
            raise ValueError(f"busbw_figure: measured row {row} lacks {sorted(missing)}")
    return rows, {}


def _size_grid(low: int, high: int, per_octave: int = 4) -> list[int]:
    low, high = max(low, 1), max(high, 1)
    steps = max(1, round(math.log2(high / low) * per_octave))
    return sorted({round(low * (high / low) ** (i / steps)) for i in range(steps + 1)})


def _label_size(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def busbw_figure(measured=None, topology: str | Topology | Sequence[str | Topology] | None = None, *,
                 ops: Sequence[str] | None = None, world_size: int | None = None,
                 algorithms: bool = False, sizes: Sequence[int] | None = None) -> go.Figure:
    """busbw (GB/s) against size: measured rows and/or the model on one or more topologies.

    ``measured``: a ``real.bench --json`` path, its dict, or a list of rows
    (``op``, ``size``, ``busbw`` in GB/s). ``topology``: preset name(s) or
    :class:`~simcomm.topology.Topology` objects to model. ``world_size``
    defaults to the measured one. ``sizes`` for the model default to the
    measured range (or 1 KiB to 4 GiB).
    """
    rows, meta = load_measured(measured)
    topologies = [] if topology is None else (
        [topology] if isinstance(topology, (str, Topology)) else list(topology))
    topologies = [get_topology(t) for t in topologies]
    if not rows and not topologies:
        raise ValueError("busbw_figure: give measured rows, a topology, or both")
    world_size = world_size or meta.get("world_size")
    if topologies and world_size is None:
        raise ValueError("busbw_figure: world_size is needed to model a topology without measured rows")
    ops = list(ops) if ops is not None else (list(dict.fromkeys(r["op"] for r in rows)) or ["all_reduce"])
    if sizes is None:
        measured_sizes = [r["size"] for r in rows if r["op"] in ops]
        sizes = _size_grid(min(measured_sizes), max(measured_sizes)) if measured_sizes else \
            _size_grid(1 << 10, 4 << 30)
    figure = go.Figure()
    for op in ops:
        colour = _OP_COLOURS.get(op, "black")
        points = sorted((r["size"], r["busbw"]) for r in rows if r["op"] == op)
        if points:
            figure.add_trace(go.Scatter(
                x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                name=f"{op} measured", line={"color": colour},
                hovertemplate=f"{op} measured<br>%{{x}} B: %{{y:.3f}} GB/s<extra></extra>"))
        for index, topo in enumerate(topologies):
            choices = [None] + (list(ALGORITHMS[op]) if algorithms and len(ALGORITHMS[op]) > 1 else [])
            for k, algorithm in enumerate(choices):
                busbw = [estimate(op, size, world_size, topo, algorithm).busbw / GB for size in sizes]
                label = f"{op} model {topo.name}" + (f" ({algorithm})" if algorithm else "")
                figure.add_trace(go.Scatter(
                    x=list(sizes), y=busbw, mode="lines", name=label,
                    line={"color": colour, "dash": _DASHES[(index + k) % len(_DASHES)],
                          "width": 2 if algorithm is None else 1},
                    hovertemplate=f"{label}<br>%{{x}} B: %{{y:.3f}} GB/s<extra></extra>"))
    where = []
    if rows:
        where.append(f"measured: {meta.get('backend', '?')}, {meta.get('world_size', '?')} ranks")
    if topologies:
        where.append(f"model: {', '.join(t.name for t in topologies)}, {world_size} ranks")
    ticks = _size_grid(min(sizes), max(sizes), per_octave=1)[::2]
    figure.update_layout(
        title=f"Bus bandwidth vs message size ({'; '.join(where)})",
        xaxis={"title": "size (bytes, nccl-tests convention)", "type": "log",
               "tickvals": ticks, "ticktext": [_label_size(t) for t in ticks]},
        yaxis={"title": "busbw (GB/s)", "rangemode": "tozero"},
        legend={"groupclick": "toggleitem"}, template="plotly_white")
    return figure
