"""Bytes each rank holds, stacked by label: the figure of :mod:`simcomm.memory` reports.

``memory_figure(world.memory, "after step 2")`` draws one bar per rank, one
colour per label (parameters, gradients, optimizer state, ...), at the mark a
program made with :func:`simcomm.memory.mark` (``"peak"``: at each rank's peak;
``"end"``: when the program returned), and a marker at each rank's peak over
the whole run. Give a dict of reports (``{"ZeRO-1": report1, "ZeRO-3": report3}``)
to draw them side by side, grouped. Plain plotly: it survives an HTML export.
"""
from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from ..memory import LABELS, MemoryReport
from .style import BODY_FONT_PX

__all__ = ["memory_figure", "LABEL_COLOURS"]

#: one colour per label (plotly's "Safe" palette, readable for colour-blind viewers); other labels cycle "Pastel"
LABEL_COLOURS = dict(zip(LABELS, ("#88CCEE", "#CC6677", "#DDCC77", "#117733", "#332288", "#AA4499",
                                  "#BBBBBB")))
_OTHER_COLOURS = ("#66C5CC", "#F6CF71", "#F89C74", "#DCB0F2", "#87C55F", "#9EB9F3")
_FONT = BODY_FONT_PX


def _unit(nbytes: float) -> tuple[str, int]:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return unit, size
    return "B", 1


def memory_figure(report: MemoryReport | Mapping[str, MemoryReport], mark: str | None = None, *,
                  peak: bool = True, title: str | None = None) -> go.Figure:
    """Stacked bars of live bytes per rank by label at ``mark`` (default: the last mark, else ``"end"``).

    ``peak`` adds a marker at each rank's highest live bytes over the whole run.
    Hover text gives exact bytes. Raises ``KeyError`` naming the marks a rank has
    when ``mark`` is not one of them.
    """
    reports = dict(report) if isinstance(report, Mapping) else {"": report}
    if not reports or any(not isinstance(r, MemoryReport) or len(r) == 0 for r in reports.values()):
        raise ValueError("memory_figure: report must be a non-empty MemoryReport (World(n, memory=True)"
                         " then world.memory), or a dict of them")
    if mark is None:
        marks = next(iter(reports.values())).marks
        mark = marks[-1] if marks else "end"
    grouped = len(reports) > 1 or "" not in reports
    groups, ranks, snaps, peaks = [], [], [], []
    for name, rep in reports.items():
        for rank_memory, snap in zip(rep.ranks, rep.at(mark)):
            groups.append(name)
            ranks.append(f"rank {rank_memory.rank}")
            snaps.append(snap)
            peaks.append(rank_memory.peak)
    labels: dict[str, None] = {}
    for rep in reports.values():
        labels.update((name, None) for name in rep.labels)
    unit, size = _unit(max([*peaks, *(s.total for s in snaps)]) if peak else max(s.total for s in snaps))
    x = [groups, ranks] if grouped else ranks
    traces = []
    others = iter(_OTHER_COLOURS * (1 + len(labels) // len(_OTHER_COLOURS)))
    for name in [n for n in labels if any(s[n] for s in snaps)]:
        values = [s[name] for s in snaps]
        traces.append(go.Bar(
            x=x, y=[v / size for v in values], name=name.replace("_", " "),
            marker_color=LABEL_COLOURS.get(name) or next(others),
            customdata=values, hovertemplate=f"{name.replace('_', ' ')}: %{{customdata:,}} B<extra></extra>"))
    if peak:
        traces.append(go.Scatter(
            x=x, y=[p / size for p in peaks], mode="markers", name="peak (whole run)",
            marker=dict(symbol="line-ew-open", size=36, color="black", line=dict(width=3, color="black")),
            customdata=peaks, hovertemplate="peak: %{customdata:,} B<extra></extra>"))
    where = {"peak": "at each rank's peak", "end": "when the program returned"}.get(mark, f"at mark '{mark}'")
    layout = go.Layout(
        barmode="stack", font=dict(size=_FONT), template="plotly_white",
        title=dict(text=title or f"Memory per rank {where}", font=dict(size=_FONT + 4)),
        yaxis=dict(title=f"live tensor storage ({unit})", rangemode="tozero"),
        legend=dict(traceorder="normal", font=dict(size=_FONT)),
        margin=dict(l=80, r=20, t=70, b=60), height=480)
    return go.Figure(data=traces, layout=layout)
