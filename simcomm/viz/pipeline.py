"""The stage x time chart of a pipeline schedule, drawn from a program's own trace.

``pipeline_figure(trace, plans)`` lays the trace out in modelled time
(:func:`simcomm.model.cost.modelled_timeline`), takes each rank's ``compute`` events
in program order and names them by the rank's schedule (``plans[rank]``, the
``("F", i)`` / ``("B", i)`` / ``("W", i)`` actions of :mod:`simcomm.parallel.pipeline`, or
``(kind, i, chunk)`` for interleaved stages): one row per stage, the gaps are the bubble.

What encodes what (the legend says it too): the **colour** is the micro-batch; the
**shade** is the kind of work (forward light, backward full, weight gradient ``W`` dark);
a **hatch** marks the model chunk of an interleaved schedule (none for chunk v0, ``/`` for
v1, ``x`` for v2, ...). Labels (``F3``) are drawn at 14 px in black or white, whichever
contrasts with the box, and only where they fit; every box has hover text. Plain plotly:
it survives an HTML export.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..model.cost import modelled_timeline
from ..trace import Trace

__all__ = ["pipeline_figure", "pipeline_boxes", "KINDS", "CHUNK_PATTERNS", "blend", "luminance", "rgb_triple",
           "text_colour"]

_FONT = dict(size=15, color="rgb(30, 30, 30)")
_PALETTE = plotly.colors.qualitative.Plotly + plotly.colors.qualitative.Set3
#: kind -> (legend text, how far the micro-batch colour is blended: + towards white, - towards black)
KINDS = {"F": ("F: forward (light)", 0.6), "B": ("B: backward (full colour)", 0.0),
         "W": ("W: weight gradient (dark)", -0.45)}
#: the hatch of chunk v0, v1, ... of an interleaved schedule
CHUNK_PATTERNS = ("", "/", "x", "\\", "+", ".")
_GREY = "rgb(128, 128, 128)"


def pipeline_boxes(trace: Trace, plans: Sequence[Sequence[tuple]], preset: str = "h100-nvswitch"
                   ) -> list[tuple[int, str, int, float, float]]:
    """``(stage, kind, microbatch, start, end)`` of every action, in modelled seconds.

    Raises ``ValueError`` when a rank's compute events are not one per action of its plan.
    """
    timeline = modelled_timeline(trace, preset)
    boxes = []
    for stage, plan in enumerate(plans):
        compute = [p for p in timeline if p.lane == "compute" and p.event.rank == stage]
        if len(compute) != len(plan):
            raise ValueError(f"pipeline_figure: rank {stage} has {len(compute)} compute events but its plan has "
                             f"{len(plan)} actions; is this the trace of that schedule?")
        boxes += [(stage, action[0], action[1], p.start, p.end) for action, p in zip(plan, compute)]
    return boxes


def rgb_triple(colour: str) -> tuple[float, float, float]:
    """``(r, g, b)`` of a ``#rrggbb`` or ``rgb(r, g, b)`` colour."""
    if colour.startswith("#"):
        return tuple(int(colour[k:k + 2], 16) for k in (1, 3, 5))
    return tuple(float(v) for v in colour[colour.index("(") + 1:colour.index(")")].split(",")[:3])


def blend(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` moved ``amount`` of the way to white (> 0) or to black (< 0)."""
    target = 255.0 if amount > 0 else 0.0
    return tuple(c + abs(amount) * (target - c) for c in rgb_triple(colour))


def luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG relative luminance of an sRGB colour."""
    def channel(c: float) -> float:
        c /= 255.0
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_colour(fill: tuple[float, float, float]) -> str:
    """Black or white, whichever has the higher WCAG contrast ratio on ``fill``."""
    lum = luminance(fill)
    return "black" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "white"


def _css(rgb: tuple[float, float, float]) -> str:
    return "rgb({:.0f}, {:.0f}, {:.0f})".format(*rgb)


def _panel(figure: go.Figure, boxes, chunks: list[int], row: int, scale: float) -> None:
    fills = [blend(_PALETTE[i % len(_PALETTE)], KINDS[kind][1]) for _, kind, i, _, _ in boxes]
    figure.add_trace(go.Bar(
        orientation="h", y=[f"stage {s}" for s, *_ in boxes], base=[start * scale for *_, start, _ in boxes],
        x=[(end - start) * scale for *_, start, end in boxes], showlegend=False, width=0.8, meta="boxes",
        marker=dict(color=[_css(f) for f in fills], line=dict(color="rgb(40, 40, 40)", width=1),
                    pattern=dict(shape=[CHUNK_PATTERNS[c % len(CHUNK_PATTERNS)] for c in chunks],
                                 fgcolor=[text_colour(f) for f in fills], size=8, solidity=0.25)),
        text=[f"{kind}{i}" for _, kind, i, _, _ in boxes], textposition="inside", insidetextanchor="middle",
        textangle=0, textfont=dict(size=14, color=[text_colour(f) for f in fills]),
        customdata=[[end * scale, i, c] for (_, _, i, _, end), c in zip(boxes, chunks)],
        hovertemplate="%{text} (micro-batch %{customdata[1]}, chunk v%{customdata[2]}) on %{y}: "
                      "%{base:.2f} to %{customdata[0]:.2f} ms<extra></extra>"), row=row, col=1)


def _legend(figure: go.Figure, kinds: set[str], chunks: set[int], where: str) -> None:
    """Legend-only entries in grey: the shade of each kind of work and the hatch of each chunk."""
    entries = [(KINDS[k][0], _css(blend(_GREY, KINDS[k][1])), "") for k in KINDS if k in kinds]
    if len(chunks) > 1:
        for chunk in sorted(chunks):
            pattern = CHUNK_PATTERNS[chunk % len(CHUNK_PATTERNS)]
            hatch = f"hatched {pattern}" if pattern else "no hatch"
            entries.append((f"chunk v{chunk} ({hatch})", "rgb(235, 235, 235)", pattern))
    for name, colour, pattern in entries:
        figure.add_trace(go.Bar(orientation="h", x=[0], y=[where], base=[0], name=name, showlegend=True,
                                hoverinfo="skip", marker=dict(color=colour, line=dict(color="rgb(40, 40, 40)",
                                                                                        width=1),
                                                              pattern=dict(shape=pattern, fgcolor="black"))),
                         row=1, col=1)


def pipeline_figure(trace: Trace | Mapping[str, Trace], plans, preset: str = "h100-nvswitch",
                    title: str | None = None) -> go.Figure:
    """Stage x time chart(s): one trace and its plans, or ``{name: trace}`` with ``{name: plans}``
    drawn one above the other on a shared time axis (milliseconds). An action is ``(kind, i)`` or
    ``(kind, i, chunk)``; kinds are ``"F"``, ``"B"`` and ``"W"``."""
    traces = dict(trace) if isinstance(trace, Mapping) else {"": trace}
    all_plans = dict(plans) if isinstance(plans, Mapping) else {"": plans}
    if set(traces) != set(all_plans):
        raise ValueError(f"pipeline_figure: traces for {sorted(traces)} but plans for {sorted(all_plans)}")
    names = list(traces)
    figure = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                           subplot_titles=[n for n in names] if names != [""] else None)
    scale, kinds, chunk_ids = 1e3, set(), set()
    for row, name in enumerate(names, start=1):
        boxes = pipeline_boxes(traces[name], all_plans[name], preset)
        chunks = [action[2] if len(action) > 2 else 0 for plan in all_plans[name] for action in plan]
        kinds.update(kind for _, kind, *_ in boxes)
        chunk_ids.update(chunks)
        _panel(figure, boxes, chunks, row, scale)
        stages = len(all_plans[name])
        figure.update_yaxes(categoryorder="array", categoryarray=[f"stage {s}" for s in range(stages)],
                            autorange="reversed", tickfont=_FONT, row=row, col=1)
    _legend(figure, kinds, chunk_ids, "stage 0")
    figure.update_xaxes(title=dict(text="modelled time (ms)", font=_FONT), tickfont=_FONT, showgrid=True,
                        gridcolor="rgb(225, 225, 225)", row=len(names), col=1)
    figure.update_annotations(font=dict(size=16))
    figure.update_layout(
        barmode="overlay", plot_bgcolor="white", paper_bgcolor="white", font=_FONT,
        uniformtext=dict(minsize=14, mode="hide"),      # a label that does not fit at 14 px is hidden
        title=dict(text=title or "pipeline schedule: one row per stage; gaps = bubble", font=dict(size=17)),
        legend=dict(font=_FONT, title=dict(text="colour = micro-batch<br>(F3, B3, W3: micro-batch 3)",
                                           font=_FONT)),
        height=140 + 190 * len(names), margin=dict(l=90, r=20, t=80, b=60))
    return figure
