"""Per-rank tensor grids: one heatmap panel per rank's tensor, on shared colour scales.

:func:`rank_grid` is the public entry; :func:`draw_panels` lays out any table of
:class:`Panel` (ranks down, stages across) and is what
:func:`simcomm.viz.collective_figure` draws with.

Tensors of any rank are shown as 2-D grids, row-major, so the flat position of
an element is the same in the tensor and in the grid:

=====  ==================================  ===================================
ndim   grid                                 layout named in the figure
=====  ==================================  ===================================
0      1 x 1                                scalar
1      1 x n                                one row: dim 0
2      as is                                rows: dim 0, columns: dim 1
3      (d0 d1) x d2                         rows: dim 0 x dim 1, columns: dim 2
4      (d0 d1) x (d2 d3)                    rows: dim 0 x dim 1, columns: dim 2 x dim 3
>4     (all but last) x last
=====  ==================================  ===================================
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from .provenance import decode
from .style import MIN_FONT_PX as _STYLE_MIN_FONT_PX
from .style import MAX_WIDTH_PX, MIXED_COLOURSCALE, VALUE_COLOURSCALE, rank_colourscale

__all__ = ["Panel", "as_grid", "grid_layout", "draw_panels", "rank_grid"]

#: the smallest font of a grid's labels and numbers, in px: one below the figures' minimum
#: (:data:`simcomm.viz.style.MIN_FONT_PX`), so a grid of many cells still fits its labels
MIN_FONT_PX = _STYLE_MIN_FONT_PX - 1

_MAX_CELL_PX = 34
_MIN_CELL_PX = 6
_GAP_PX = 24
_WIDTH_PX = MAX_WIDTH_PX - 60 - 95   # the panels, the left margin and the colour bar's fit MAX_WIDTH_PX
_HEIGHT_PX = 640   # and within a projected screen (SCREEN_HEIGHT_PX in collective.py, with titles)


def _dim_name(dim: int, dim_names: Sequence[str] | None) -> str:
    return dim_names[dim] if dim_names is not None else f"dim {dim}"


def grid_layout(shape: Sequence[int], dim_names: Sequence[str] | None = None) -> str:
    """In words, how a tensor of ``shape`` is laid out as a grid (see the module's table)."""
    ndim = len(shape)
    if dim_names is not None and len(dim_names) != ndim:
        raise ValueError(f"grid_layout: dim_names={list(dim_names)} names {len(dim_names)} dims but "
                         f"shape {tuple(shape)} has {ndim}")
    names = [_dim_name(dim, dim_names) for dim in range(ndim)]
    if ndim == 0:
        return "scalar"
    if ndim == 1:
        return f"one row: {names[0]}"
    if ndim == 2:
        return f"rows: {names[0]}, columns: {names[1]}"
    if ndim == 4:
        return f"rows: {names[0]} x {names[1]}, columns: {names[2]} x {names[3]}"
    return f"rows: {' x '.join(names[:-1])}, columns: {names[-1]}"


def as_grid(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """The 2-D float64 grid a tensor is drawn as (row-major; see the module's table)."""
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu().to(torch.float64).numpy()
    array = np.asarray(tensor, dtype=np.float64)
    shape = array.shape
    if array.ndim == 0:
        return array.reshape(1, 1)
    if array.ndim == 1:
        return array.reshape(1, -1)
    if array.ndim == 4:
        return array.reshape(shape[0] * shape[1], shape[2] * shape[3])
    return array.reshape(-1, shape[-1])


@dataclass
class Panel:
    """One heatmap of a figure: a rank's tensor at one stage.

    ``coded``: the values are provenance codes (colour by source rank; hover
    names the source rank and the element's position in ``source_shape``).
    Otherwise they combine several ranks: drawn in one neutral colour, the
    cell naming the ranks combined; ``mixed`` says how, so the cell and hover
    can name them and the position: ``"sum"`` /
    ``"avg"`` (sum / mean over all ranks of one position), ``"scaled"`` (a
    code divided by the world size). ``tensor=None`` draws an empty panel
    showing ``note``.
    """

    tensor: torch.Tensor | None
    name: str
    rank: int
    coded: bool = True
    source_shape: tuple[int, ...] | None = None
    note: str = ""
    mixed: str = ""
    #: the cell text of a coded element, from its source rank and position in ``source_shape``
    #: (``None``: the code itself)
    label: Callable[[int, tuple[int, ...]], str] | None = None


def _index_labels(shape: tuple[int, ...]) -> list[str]:
    """``"(i, j)"`` for every flat position of ``shape``."""
    if not shape:
        return ["()"]
    indices = np.unravel_index(np.arange(math.prod(shape)), shape)
    if len(shape) == 1:
        return [f"({i},)" for i in indices[0]]
    return ["(" + ", ".join(str(int(part[k])) for part in indices) + ")" for k in range(indices[0].size)]


def _format_value(value: float) -> str:
    return str(int(value)) if value == round(value) and abs(value) < 1e15 else f"{value:.4g}"


def _mixed_explainer(panel: Panel, base: int | None, world_size: int, shape: tuple[int, ...]):
    """A function from a mixed value to words: which ranks and which position it combines.

    With codes ``s * base + p`` on ``n`` ranks, a sum over all ranks of
    position ``p`` is ``base * n(n-1)/2 + n p``, a mean is ``base (n-1)/2 + p``
    and a scaled code is ``(s * base + p) / n``; ``base`` exceeds ``n`` times
    every position, so each inverts exactly.
    """
    source_shape = panel.source_shape or shape
    numel = math.prod(source_shape)
    labels = _index_labels(source_shape)
    n = world_size
    everyone = f"ranks 0-{n - 1}" if n > 1 else "rank 0"

    def position(value: float) -> int | None:
        if base is None:
            return None
        if panel.mixed == "sum":
            q = (value - base * n * (n - 1) / 2) / n
        elif panel.mixed == "avg":
            q = value - base * (n - 1) / 2
        else:
            return None
        return int(q) if q == round(q) and 0 <= q < numel else None

    ranks_text = f"0-{n - 1}" if n > 1 else "0"

    def short(value: float) -> str:
        """The cell's text: which ranks the value combines (``Σ0-3``), or the value itself."""
        if panel.mixed == "scaled" and base is not None:
            code = value * n
            if code == round(code) and 0 <= code < n * base:
                return f"{_format_value(code)}/{n}"
        if position(value) is not None:
            return ("Σ" if panel.mixed == "sum" else "avg ") + ranks_text
        return _format_value(value)

    def explain(value: float) -> str:
        if panel.mixed == "scaled" and base is not None:
            code = value * n
            if code == round(code) and 0 <= code < n * base and int(code) % base < numel:
                return (f"= (rank {int(code) // base}'s element {labels[int(code) % base]}) / {n}: "
                        f"a code divided by the world size")
        where = position(value)
        if where is not None:
            what = "sum" if panel.mixed == "sum" else "mean"
            return f"= {what} over {everyone} of their element {labels[where]}"
        if value == 0:
            return "= 0: nothing reaches this element"
        return "mixes several ranks' values"
    return short, explain


def _panel_cells(panel: Panel, base: int | None, world_size: int, function: str
                 ) -> tuple[np.ndarray, list[list[str]], list[list[str]]]:
    """The grid, cell texts and hover texts of one panel."""
    grid = as_grid(panel.tensor)
    shape = tuple(panel.tensor.shape)
    flat = grid.reshape(-1)
    labels = _index_labels(shape)
    texts = [_format_value(v) for v in flat]
    head = [f"rank {panel.rank} {panel.name}{labels[k]} = {texts[k]}" for k in range(flat.size)]
    if panel.coded:
        try:
            ranks, positions = decode(flat, base)
        except ValueError as error:
            raise ValueError(f"{function}: {panel.name} on rank {panel.rank} is not provenance-coded "
                             f"with base={base}: {error}") from None
        if ranks.size and ranks.max() >= world_size:
            raise ValueError(f"{function}: {panel.name} on rank {panel.rank} holds code "
                             f"{_format_value(flat[ranks.argmax()])}, from rank {ranks.max()}, but "
                             f"world_size={world_size}")
        source_labels = _index_labels(panel.source_shape or shape)
        if panel.label is not None:
            source_shape = panel.source_shape or shape
            texts = [panel.label(int(ranks[k]), tuple(int(i) for i in np.unravel_index(positions[k], source_shape)))
                     for k in range(flat.size)]
        hover = [f"{head[k]}<br>came from rank {ranks[k]}, element "
                 f"{source_labels[positions[k]] if positions[k] < len(source_labels) else positions[k]}"
                 for k in range(flat.size)]
    else:
        short, explain = _mixed_explainer(panel, base, world_size, shape)
        texts = [short(v) for v in flat]
        hover = [f"{head[k]}<br>{explain(flat[k])}" for k in range(flat.size)]
    columns = grid.shape[1]
    rows = lambda items: [items[i:i + columns] for i in range(0, len(items), columns)]  # noqa: E731
    return grid, rows(texts), rows(hover)


def _axis_name(kind: str, index: int) -> str:
    return kind if index == 1 else f"{kind}{index}"


def _domains(sizes_px: Sequence[float], total: float) -> list[tuple[float, float]]:
    """Paper fractions ``(start, end)`` of consecutive spans of ``sizes_px`` pixels out of ``total``, gaps between."""
    domains, offset = [], 0.0
    for size in sizes_px:
        domains.append((offset / total, min(1.0, (offset + size) / total)))
        offset += size + _GAP_PX
    return domains


def _text_px(text: str, size: int = 12) -> float:
    """Rough pixel width of the longest line of ``text`` (``<br>`` separates lines)."""
    return max((len(line) for line in text.split("<br>")), default=0) * size * 0.5 + 8


def draw_panels(panels: Sequence[Sequence[Panel]], *, world_size: int, base: int | None,
                title: str = "", column_titles: Sequence[str] | None = None,
                row_titles: Sequence[str] | None = None, panel_titles: Sequence[Sequence[str]] | None = None,
                show_values: bool | None = None, function: str = "draw_panels") -> go.Figure:
    """A figure with ``panels[row][column]`` laid out as a table of heatmaps.

    Coded panels share one colour axis that colours each value by its source
    rank; values that combine ranks (``Panel.mixed`` set) are neutral, with
    the ranks named in each cell; plain values (``rank_grid`` of any tensors)
    share a grey value scale. No number is drawn below :data:`MIN_FONT_PX`. Cells are square and the same
    size in every panel, so a tensor twice as long is drawn twice as long.
    The figure is built from plain dicts and validated once by ``go.Figure``
    (adding panels one by one through plotly's API is ten times slower).
    """
    row_count = len(panels)
    col_count = max((len(row) for row in panels), default=0)
    if row_count == 0 or col_count == 0:
        raise ValueError(f"{function}: no panels to draw")
    if any(panel.coded and panel.tensor is not None for row in panels for panel in row) and base is None:
        raise ValueError(f"{function}: coded panels need base= (the provenance base)")
    cells = [[_panel_cells(panel, base, world_size, function) if panel.tensor is not None else None
              for panel in row] for row in panels]
    grid_rows = [max((c[0].shape[0] for c in row if c is not None), default=1) for row in cells]
    grid_cols = [max((cells[r][c][0].shape[1] for r in range(row_count)
                      if c < len(cells[r]) and cells[r][c] is not None), default=1)
                 for c in range(col_count)]
    # a column is as wide as its widest grid, or its title when that is wider (the grid is centred)
    titles_of = [[column_titles[c]] if column_titles and c < len(column_titles) else [] for c in range(col_count)]
    for row_titles_ in panel_titles or []:
        for c, text in enumerate(row_titles_):
            titles_of[c].append(text)
    title_px = [max([0.0] + [_text_px(t) for t in titles_of[c]]) for c in range(col_count)]

    def widths(cell: float) -> list[float]:
        return [max(grid_cols[c] * cell, title_px[c]) for c in range(col_count)]

    # the largest cell (up to _MAX_CELL_PX) that keeps the panels within _WIDTH_PX and _HEIGHT_PX
    cell_px = max(_MIN_CELL_PX, min(_MAX_CELL_PX, _HEIGHT_PX / sum(grid_rows)))
    # (very long tensors: cells down to a pixel, colour only, rather than a figure wider than its column)
    while cell_px > 1 and sum(widths(cell_px)) + (col_count - 1) * _GAP_PX > _WIDTH_PX:
        cell_px -= 0.5
    col_px = widths(cell_px)
    row_px = [rows * cell_px for rows in grid_rows]
    plot_width = sum(col_px) + (col_count - 1) * _GAP_PX
    plot_height = sum(row_px) + (row_count - 1) * _GAP_PX
    # numbers are never drawn below MIN_FONT_PX (readable when projected): when the cells are too
    # small for that (many ranks, long tensors), the values are dropped and stay on hover
    font_px = max(MIN_FONT_PX, min(16, int(cell_px * 0.45)))

    def panel_font(panel_texts: list[list[str]]) -> int | None:
        """The largest font from ``font_px`` down to MIN_FONT_PX at which the panel's texts fit its cells.

        ``None``: they do not fit even at MIN_FONT_PX, so the numbers are left to hover.
        """
        if show_values is False:
            return None
        lines = [line for row in panel_texts for text in row for line in text.split("<br>")]
        widest = max((len(line) for line in lines), default=1)
        rows = max((text.count("<br>") + 1 for row in panel_texts for text in row), default=1)
        for size in range(font_px, MIN_FONT_PX - 1, -1):
            if widest * size * 0.58 + 2 <= cell_px * 1.05 and rows * size * 1.15 <= cell_px:
                return size
        return MIN_FONT_PX if show_values else None
    # colour bars need room for one label per rank: a short figure gets white space below its panels
    has_coded = any(p.coded and p.tensor is not None for row in panels for p in row)
    plot_height = max(plot_height, 30 * world_size * has_coded)
    x_domains = _domains(col_px, plot_width)
    y_domains = [(1 - end, 1 - start) for start, end in _domains(row_px, plot_height)]
    layout: dict[str, Any] = {}
    traces, annotations = [], []
    mixed_values = []
    text_font = dict(size=font_px, color="rgb(40, 40, 40)")
    for r, row in enumerate(panels):
        for c, panel in enumerate(row):
            index = r * col_count + c + 1
            x_name, y_name = _axis_name("x", index), _axis_name("y", index)
            axis = dict(showticklabels=False, showgrid=False, zeroline=False, constrain="domain")
            layout[_axis_name("xaxis", index)] = dict(axis, domain=x_domains[c], anchor=y_name)
            layout[_axis_name("yaxis", index)] = dict(axis, domain=y_domains[r], anchor=x_name,
                                                     autorange="reversed", scaleanchor=x_name)
            if panel_titles is not None and panel_titles[r][c]:
                annotations.append(dict(text=panel_titles[r][c], xref=f"{x_name} domain",
                                        yref=f"{y_name} domain", x=0.5, y=1.0, xanchor="center", yanchor="bottom",
                                        showarrow=False, font=dict(size=MIN_FONT_PX)))
            if cells[r][c] is None:  # an axis without a trace is not drawn: place the note on the paper
                annotations.append(dict(text=panel.note or "None", xref="paper", yref="paper",
                                        x=sum(x_domains[c]) / 2, y=sum(y_domains[r]) / 2, xanchor="center",
                                        showarrow=False, font=dict(size=MIN_FONT_PX, color="rgb(110, 110, 110)")))
                layout[_axis_name("xaxis", index)]["visible"] = False
                layout[_axis_name("yaxis", index)]["visible"] = False
                continue
            grid, texts, hover = cells[r][c]
            size = panel_font(texts)
            if not panel.coded:
                mixed_values.append(grid)
            traces.append(dict(
                type="heatmap", z=grid, customdata=hover, hovertemplate="%{customdata}<extra></extra>",
                text=texts, texttemplate="%{text}" if size else "", textfont=dict(text_font, size=size or font_px),
                coloraxis="coloraxis" if panel.coded else "coloraxis2", xgap=1, ygap=1,
                name=f"rank {panel.rank} {panel.name}", xaxis=x_name, yaxis=y_name))
    for c, text in enumerate(column_titles or []):
        annotations.append(dict(text=text, xref="paper", yref="paper", x=sum(x_domains[c]) / 2, y=1.0,
                                xanchor="center", yanchor="bottom", yshift=4, showarrow=False,
                                font=dict(size=MIN_FONT_PX)))
    for r, text in enumerate(row_titles or []):
        layout[_axis_name("yaxis", r * col_count + 1)]["title"] = dict(text=text, font=dict(size=MIN_FONT_PX))
    combined = all(p.mixed for row in panels for p in row if not p.coded and p.tensor is not None)
    if has_coded:
        layout["coloraxis"] = dict(
            colorscale=rank_colourscale(world_size), cmin=-0.5, cmax=world_size * base - 0.5,
            colorbar=dict(title=dict(text="came from", side="top"), thickness=14,
                          tickvals=[(rank + 0.5) * base - 0.5 for rank in range(world_size)],
                          ticktext=[f"rank {rank}" for rank in range(world_size)],
                          tickfont=dict(size=MIN_FONT_PX), len=0.48 if mixed_values and not combined else 1.0,
                          y=1.0, yanchor="top"))
    if mixed_values and combined:   # one neutral colour; each cell's text names the ranks it combines
        layout["coloraxis2"] = dict(colorscale=MIXED_COLOURSCALE, cmin=0.0, cmax=1.0, showscale=False)
    elif mixed_values:              # plain values (rank_grid of any tensors): a value scale
        low = min(0.0, min(float(v.min()) for v in mixed_values))
        high = max(float(v.max()) for v in mixed_values)
        layout["coloraxis2"] = dict(
            colorscale=VALUE_COLOURSCALE, cmin=low, cmax=high if high > low else low + 1.0,
            colorbar=dict(title=dict(text="value", side="top"), thickness=14, tickfont=dict(size=MIN_FONT_PX),
                          len=0.48 if has_coded else 1.0, y=0.0, yanchor="bottom"))
    title_lines = title.count("<br>") + 1 if title else 0
    heading_lines = max([t.count("<br>") + 1 for ts in titles_of for t in ts], default=0)
    # plotly places the first line of a multi-line title at its y and lets the rest hang below it
    top = 36 + 19 * max(title_lines - 1, 0) + 16 * heading_lines + 6
    right = max(95, _text_px(title.split("<sup>")[0], 14) + 20 - plot_width - 60)  # room for the title
    right = min(right, max(95, MAX_WIDTH_PX - plot_width - 60))
    height = int(plot_height + top + 20)
    layout.update(
        title=dict(text=title, x=0.01, xanchor="left", y=1.0 - 28 / height, yref="container",
                   yanchor="bottom", font=dict(size=14)) if title else None,
        width=int(plot_width + 60 + right), height=height,
        margin=dict(l=60, r=right, t=top, b=20), plot_bgcolor="white", paper_bgcolor="white",
        annotations=annotations)
    return go.Figure(data=traces, layout=layout)


def rank_grid(tensors: Sequence[torch.Tensor | None], *, base: int | None = None,
              world_size: int | None = None, titles: Sequence[str] | None = None, title: str = "",
              dim_names: Sequence[str] | None = None, columns: int | None = None,
              show_values: bool | None = None) -> go.Figure:
    """One heatmap panel per rank's tensor, on one shared colour scale, values on hover.

    ``tensors[r]`` is rank ``r``'s tensor (``None`` draws an empty panel).
    With ``base`` the tensors are provenance codes (see
    :mod:`simcomm.viz.provenance`): each element is coloured by the rank it
    came from, and hover shows where it sat. Without it, values share one grey
    scale. Tensors that are not 2-D are drawn as grids named in the title
    (``dim_names`` names the dims, e.g. ``("batch", "seq", "heads", "head_dim")``).
    Panels wrap after ``columns`` (default: up to 4 per row).
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("rank_grid: tensors is empty; pass one tensor per rank")
    for rank, tensor in enumerate(tensors):
        if tensor is not None and not isinstance(tensor, (torch.Tensor, np.ndarray)):
            raise ValueError(f"rank_grid: tensors[{rank}] is a {type(tensor).__name__}, not a tensor")
    world_size = len(tensors) if world_size is None else world_size
    if titles is not None and len(titles) != len(tensors):
        raise ValueError(f"rank_grid: {len(titles)} titles for {len(tensors)} tensors")
    columns = min(len(tensors), 4) if columns is None else columns
    if not isinstance(columns, int) or columns < 1:
        raise ValueError(f"rank_grid: columns={columns!r} must be a positive int")
    first = next((t for t in tensors if t is not None), None)
    shapes = {tuple(t.shape) for t in tensors if t is not None}
    layout = grid_layout(tuple(first.shape), dim_names) if first is not None and len(shapes) == 1 else ""
    panels = [Panel(torch.as_tensor(t) if t is not None else None, "x", rank, coded=base is not None,
                    note="None") for rank, t in enumerate(tensors)]
    rows = [panels[i:i + columns] for i in range(0, len(panels), columns)]
    panel_titles = list(titles) if titles is not None else [f"rank {rank}" for rank in range(len(tensors))]
    full_title = title or ("tensors per rank" + (", coloured by source rank" if base is not None else ""))
    if layout and (first is None or first.dim() != 2):
        full_title += f"<br><sup>grid layout: {layout}</sup>"
    titles_by_row = [panel_titles[i:i + columns] for i in range(0, len(panel_titles), columns)]
    return draw_panels(rows, world_size=world_size, base=base, title=full_title, panel_titles=titles_by_row,
                       show_values=show_values, function="rank_grid")
