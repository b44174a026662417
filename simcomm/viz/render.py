"""How figures are shown in a notebook: live in JupyterLab, and still there after an HTML export.

Plotly's default in JupyterLab is a single ``application/vnd.plotly.v1+json``
output, drawn by the JupyterLab extension. ``jupyter nbconvert --to html``
cannot represent it, so an exported lesson loses every figure. The
``"simcomm"`` renderer registered here gives every figure two forms:

* the plotly mimetype, which JupyterLab draws (interactive, as before);
* a ``text/html`` form (a ``<div>`` and a ``Plotly.newPlot`` call) that an
  HTML export keeps and a browser draws without a kernel, sized to its output column
  (:mod:`simcomm.viz.style`), inside a box that would scroll sideways rather than cut off a
  figure wider than the page. It carries no copy
  of plotly.js: the library is written into the notebook *once*, by the
  renderer's activation before the first figure of a kernel session, so an
  exported lesson holds plotly.js once, not once per figure, and needs no
  network (no CDN, no MathJax).

:func:`use_export_renderer` makes it the default. Nothing calls it at import:
each lesson's first cell does (``viz.use_export_renderer()``), so a script or a
kernel that only imports :mod:`simcomm.viz` keeps plotly's own default.
"""
from __future__ import annotations

import plotly.io as pio
from plotly.io._base_renderers import MimetypeRenderer, PlotlyRenderer

__all__ = ["RENDERER", "SCROLL_CLASS", "EmbeddedHtmlRenderer", "use_export_renderer", "in_kernel"]

#: the name the renderer is registered under in ``plotly.io.renderers``
RENDERER = "simcomm"
#: the class of the scrolling box around each exported figure
SCROLL_CLASS = "simcomm-figure"


class EmbeddedHtmlRenderer(MimetypeRenderer):
    """``text/html`` figures that rely on one copy of plotly.js written at activation."""

    def activate(self) -> None:
        """Display plotly.js once (called by plotly before the first figure after it is made default)."""
        from IPython.display import display_html
        from plotly.offline import get_plotlyjs

        display_html(f"<script>window.PlotlyConfig = {{MathJaxConfig: 'local'}};</script>\n"
                     f"<script type=\"text/javascript\">{get_plotlyjs()}</script>", raw=True)

    def to_mimebundle(self, fig_dict: dict) -> dict:
        html = pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False, full_html=False,
                           auto_play=False, validate=False)
        # the figures fit their column (style.MAX_WIDTH_PX); one wider than the page would scroll, not be cut off
        return {"text/html": f'<div class="{SCROLL_CLASS}" style="max-width:100%;overflow-x:auto">{html}</div>'}


class _CombinedRenderer(MimetypeRenderer):
    """The plotly mimetype (JupyterLab) and the embedded HTML (exports) in one output."""

    def __init__(self) -> None:
        self.parts = (PlotlyRenderer(), EmbeddedHtmlRenderer())

    def activate(self) -> None:
        for part in self.parts:
            part.activate()

    def to_mimebundle(self, fig_dict: dict) -> dict:
        bundle: dict = {}
        for part in self.parts:
            bundle.update(part.to_mimebundle(fig_dict))
        return bundle


def in_kernel() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbval, nbconvert --execute)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def use_export_renderer() -> None:
    """Register the ``"simcomm"`` renderer and make it plotly's default (idempotent).

    Setting the default again would show plotly.js a second time, so a default
    that already is ``"simcomm"`` is left as it is.
    """
    if RENDERER not in pio.renderers:
        pio.renderers[RENDERER] = _CombinedRenderer()
    if pio.renderers.default != RENDERER:
        pio.renderers.default = RENDERER
