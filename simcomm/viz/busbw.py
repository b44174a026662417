"""Bus bandwidth against message size: measured (``real.bench``) beside the cost model.

``busbw_figure(measured, topology)`` draws measured rows as markers joined
by a solid line and the model's prediction for the same op and world size as
lines of their own (one per algorithm with ``algorithms=True``). Every line
has its own colour *and* dash style, is 3 px wide and is labelled at its right
end, so lines can be told apart on a projector and in greyscale. The x axis
is the message size in nccl-tests' convention (:mod:`simcomm.model.cost`),
logarithmic; the y axis is logarithmic when the values span more than two
decades (small messages reach a tiny fraction of the link rate). Fonts are at
least 14 px.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import plotly.colors
import plotly.graph_objects as go

from ..model.cost import ALGORITHMS, GB, OPS, Topology, estimate, get_topology
from ..ops import canonical_op
from .style import MIN_FONT_PX

__all__ = ["busbw_figure", "load_measured"]

_COLOURS = plotly.colors.qualitative.Dark2 + plotly.colors.qualitative.Set1
_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star")
_FONT = {"size": MIN_FONT_PX}


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
                 algorithms: bool = False, sizes: Sequence[int] | None = None,
                 log_y: bool | None = None) -> go.Figure:
    """busbw (GB/s) against size: measured rows and/or the model on one or more topologies.

    ``measured``: a ``real.bench --json`` path, its dict, or a list of rows
    (``op``, ``size``, ``busbw`` in GB/s). ``topology``: preset name(s) or
    :class:`~simcomm.model.topology.Topology` objects to model. ``world_size``
    defaults to the measured one. ``algorithms``: one line per algorithm the
    model knows for the op (ring, tree, nvls...) instead of one line for the
    fastest. ``sizes`` for the model default to the measured range (or 1 KiB
    to 4 GiB). ``log_y``: ``None`` picks a log axis when the values span more
    than a factor 100.
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
    ops = [canonical_op(op, OPS, where="busbw_figure") for op in ops] if ops is not None else (
        list(dict.fromkeys(r["op"] for r in rows)) or ["all_reduce"])
    if sizes is None:
        measured_sizes = [r["size"] for r in rows if r["op"] in ops]
        sizes = _size_grid(min(measured_sizes), max(measured_sizes)) if measured_sizes else \
            _size_grid(1 << 10, 4 << 30)
    lines: list[tuple[str, str, list, list, bool]] = []       # (name, label, x, y, measured)

    def label(*parts: str) -> str:   # only what tells this line from the others
        return " ".join(p for p in parts if p) or "model"

    op_part = (lambda op: op) if len(ops) > 1 else (lambda op: "")
    topo_part = (lambda t: t.name) if len(topologies) > 1 else (lambda t: "")
    for op in ops:
        points = sorted((r["size"], r["busbw"]) for r in rows if r["op"] == op)
        if points:
            lines.append((f"{op} measured", label(op_part(op), "measured"), [p[0] for p in points],
                          [p[1] for p in points], True))
        for topo in topologies:
            choices = [a for a in ALGORITHMS[op] if a != "nvls" or (
                topo.nvls_busbw > 0 and world_size <= topo.gpus_per_node)] if algorithms else [None]
            for algorithm in choices:
                busbw = [estimate(op, size, world_size, topo, algorithm).busbw / GB for size in sizes]
                lines.append((f"{op} model {topo.name}" + (f" ({algorithm})" if algorithm else ""),
                              label(op_part(op), topo_part(topo), algorithm or ""), list(sizes), busbw, False))
    figure = go.Figure()
    for index, (name, text, x, y, is_measured) in enumerate(lines):
        colour, dash = _COLOURS[index % len(_COLOURS)], _DASHES[index % len(_DASHES)]
        figure.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers" if is_measured else "lines", name=name,
            line={"color": colour, "dash": "solid" if is_measured else dash, "width": 3},
            marker={"symbol": _SYMBOLS[index % len(_SYMBOLS)], "size": 9, "color": colour},
            meta={"label": text},
            hovertemplate=f"{name}<br>%{{x}} B: %{{y:.3f}} GB/s<extra></extra>"))
    values = [v for *_, y, _ in lines for v in y if v > 0]
    if log_y is None:
        log_y = bool(values) and max(values) / min(values) > 100
    figure.update_layout(annotations=_end_labels(lines, log_y))
    where = []
    if rows:
        where.append(f"measured: {meta.get('backend', '?')}, {meta.get('world_size', '?')} ranks")
    if topologies:
        where.append(f"model: {', '.join(t.name for t in topologies)}, {world_size} ranks")
    ticks = _size_grid(min(sizes), max(sizes), per_octave=1)[::2]
    figure.update_layout(
        title={"text": f"Bus bandwidth vs message size<br><span style='font-size:14px'>{'; '.join(where)}"
                       "</span>", "font": {"size": 18}},
        font=_FONT,
        xaxis={"title": {"text": "size (bytes, nccl-tests convention)", "font": _FONT}, "type": "log",
               "tickvals": ticks, "ticktext": [_label_size(t) for t in ticks], "tickfont": _FONT},
        yaxis={"title": {"text": "busbw (GB/s)" + (", log scale" if log_y else ""), "font": _FONT},
               "type": "log" if log_y else "linear", "tickfont": _FONT,
               **({"dtick": 1} if log_y else {"rangemode": "tozero"})},
        legend={"groupclick": "toggleitem", "font": _FONT, "orientation": "h", "x": 0, "y": -0.2,
                "yanchor": "top"},
        template="plotly_white", height=620, margin={"r": 170, "t": 90, "b": 150})
    return figure



_PLOT_PX = 380              # the plot area's height: 620 px less the top and bottom margins
_LABEL_PX = 20              # labels at least this far apart


def _end_labels(lines: list, log_y: bool) -> list[dict]:
    """A label at the right end of every line, in its colour, nudged apart so none overlap."""
    def to_axis(value: float) -> float:
        return math.log10(value) if log_y else value
    ends = [(to_axis(y[-1]) if (y[-1] > 0 or not log_y) else None) for *_, y, _ in lines]
    known = [e for e in ends if e is not None]
    if not known:
        return []
    low, high = min(min(to_axis(v) for *_, y, _ in lines for v in y if v > 0 or not log_y), 0 if not log_y
                    else min(known)), max(known)
    span = (high - low) or 1.0
    order = sorted((i for i, e in enumerate(ends) if e is not None), key=lambda i: -ends[i])
    placed: dict[int, float] = {}
    previous = None
    for i in order:
        px = (ends[i] - low) / span * _PLOT_PX
        if previous is not None and px > previous - _LABEL_PX:
            px = previous - _LABEL_PX
        placed[i] = px
        previous = px
    labels = []
    for i, px in placed.items():
        name, text, x, y, _ = lines[i]
        labels.append(dict(
            text=text, x=math.log10(x[-1]), y=ends[i], xanchor="left", xshift=8, showarrow=False,
            yshift=px - (ends[i] - low) / span * _PLOT_PX,
            font={"size": 14, "color": _COLOURS[i % len(_COLOURS)]}))
    return labels
