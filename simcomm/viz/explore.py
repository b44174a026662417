"""``explore()``: widgets that redraw :func:`~simcomm.viz.collective_figure` on every change.

Built from plain ipywidgets controls and an ``Output`` widget that shows a
plain ``go.Figure`` through plotly's JupyterLab renderer (the
``application/vnd.plotly.v1+json`` output that the ``jupyterlab-plotly``
extension shipped with plotly draws), so no ``FigureWidget`` or other
front-end package is needed.
"""
from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence

import ipywidgets as widgets
import plotly.graph_objects as go

from ..checks import REDUCE_OPS
from .collective import OPS, collective_figure

__all__ = ["Explorer", "explore", "parse_shape"]

_A2A_DIRECTIONS = {"sequence -> heads (2, 1)": (2, 1), "heads -> sequence (1, 2)": (1, 2)}


def parse_shape(text: str) -> tuple[int, ...] | None:
    """``"2, 4"`` or ``"(2, 4)"`` as ``(2, 4)``; an empty string as ``None`` (the op's default shape)."""
    cleaned = text.strip().strip("()[]").strip()
    if not cleaned:
        return None
    try:
        shape = tuple(int(part) for part in cleaned.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise ValueError(f"explore: shape {text!r} must be positive ints separated by commas, e.g. 2, 4") from None
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"explore: shape {text!r} must be positive ints separated by commas, e.g. 2, 4")
    return shape


def _plotly_output(fig: go.Figure) -> dict:
    """The display_data output JupyterLab renders with plotly's mime renderer."""
    spec = json.loads(fig.to_json())
    spec["config"] = {"displaylogo": False}
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": spec,
                     "text/plain": f"collective figure: {fig.layout.title.text.split('<br>')[0]}"}}


class Explorer(widgets.VBox):
    """The panel :func:`explore` returns: controls, a status line and the figure.

    ``controls`` maps ``op``, ``world_size``, ``shape``, ``dim``, ``reduce_op``
    and ``direction`` (all_to_all_4D) to their widgets; ``figure`` is the
    figure drawn last and ``error`` the message of the last failed redraw.
    """

    def __init__(self, op: str = "all_gather", world_size: int = 4, shape: Sequence[int] | None = None,
                 max_world_size: int = 8):
        if op not in OPS:
            raise ValueError(f"explore: op={op!r} is not one of {sorted(OPS)}")
        if not isinstance(max_world_size, int) or max_world_size < 2:
            raise ValueError(f"explore: max_world_size={max_world_size!r} must be an int >= 2")
        if not isinstance(world_size, int) or not 1 <= world_size <= max_world_size:
            raise ValueError(f"explore: world_size={world_size!r} must be an int from 1 to {max_world_size}")
        style = {"description_width": "80px"}
        self.controls = {
            "op": widgets.Dropdown(options=list(OPS), value=op, description="op", style=style),
            "world_size": widgets.IntSlider(value=world_size, min=1, max=max_world_size, description="world size",
                                            continuous_update=False, style=style),
            "shape": widgets.Text(value=", ".join(map(str, shape)) if shape else "", placeholder="default",
                                  description="shape", continuous_update=False, style=style),
            "dim": widgets.Dropdown(options=[-1, 0, 1, 2, 3], value=-1, description="dim", style=style),
            "reduce_op": widgets.Dropdown(options=list(REDUCE_OPS), value="sum", description="reduce op",
                                          style=style),
            "direction": widgets.Dropdown(options=list(_A2A_DIRECTIONS), description="all_to_all", style=style),
        }
        self.status = widgets.HTML()
        self.output = widgets.Output()
        self.figure: go.Figure | None = None
        self.error: str | None = None
        rows = [widgets.HBox([self.controls["op"], self.controls["world_size"], self.controls["shape"]]),
                widgets.HBox([self.controls["dim"], self.controls["reduce_op"], self.controls["direction"]])]
        super().__init__(rows + [self.status, self.output])
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        self.redraw()

    def _on_change(self, change: dict) -> None:
        self.redraw()

    def op_args(self) -> dict:
        """The keyword arguments the current controls give ``collective_figure``."""
        op = self.controls["op"].value
        takes = OPS[op].args
        args = {}
        if "dim" in takes:
            args["dim"] = self.controls["dim"].value
        if "reduce_op" in takes:
            args["reduce_op"] = self.controls["reduce_op"].value
        if "scatter_dim" in takes:
            args["scatter_dim"], args["gather_dim"] = _A2A_DIRECTIONS[self.controls["direction"].value]
        return args

    def redraw(self) -> None:
        """Draw the figure for the current controls; on a bad combination show the reason instead."""
        op = self.controls["op"].value
        takes = OPS[op].args
        self.controls["dim"].disabled = "dim" not in takes
        self.controls["reduce_op"].disabled = "reduce_op" not in takes
        self.controls["direction"].disabled = "scatter_dim" not in takes
        started = time.perf_counter()
        try:
            shape = parse_shape(self.controls["shape"].value)
            fig = collective_figure(op, self.controls["world_size"].value, shape, **self.op_args())
        except ValueError as error:
            self.error = str(error)
            self.status.value = f'<span style="color:#b2182b">{html.escape(self.error)}</span>'
            self.output.outputs = ()
            return
        self.figure, self.error = fig, None
        self.output.outputs = (_plotly_output(fig),)
        self.status.value = (f'<span style="color:#666">{html.escape(op)} on '
                             f'{self.controls["world_size"].value} ranks, drawn in '
                             f'{(time.perf_counter() - started) * 1e3:.0f} ms</span>')


def explore(op: str = "all_gather", world_size: int = 4, shape: Sequence[int] | None = None,
            max_world_size: int = 8) -> Explorer:
    """A panel of widgets (op, world size, shape, dim, reduce op) that redraws ``collective_figure``.

    Every change of a control reruns the op on virtual ranks and replaces
    the figure; a combination that cannot run (a shape the world size does
    not divide, a dim out of range) shows the error instead. Display the
    returned :class:`Explorer` (last expression of a cell).
    """
    return Explorer(op, world_size, shape, max_world_size)
