"""Exposed vs hidden communication per DDP bucket size, and a slider that shows each size's timeline.

``bucket_overlap_figure(rows)`` draws, per bucket size, the modelled
communication of one rank split into *exposed* (the program waits for it) and
*hidden* (it overlaps backward compute), with the step's modelled end as a
marker. ``bucket_slider(figures, default)`` is an ipywidgets slider over the
bucket sizes that shows the precomputed timeline figure of the chosen size
(no program runs when it moves, so it works on either backend). A slider needs
a running kernel; its display also carries a static fallback, the default
size's figure as HTML (``text/html``), which a static page shows where the
widget cannot run (:mod:`simcomm.handout`'s pages; ``jupyter nbconvert`` of a
notebook saved without widget state). JupyterLab shows the live slider.
"""
from __future__ import annotations

import functools
import html
from collections.abc import Mapping

import plotly.graph_objects as go

__all__ = ["bucket_overlap_figure", "bucket_slider"]

_FONT = dict(size=15, color="rgb(30, 30, 30)")


def bucket_overlap_figure(rows: Mapping[str, Mapping[str, float]]) -> go.Figure:
    """``rows``: ``{bucket size label: {"exposed", "hidden", "end"} in seconds}``, drawn in microseconds."""
    labels = list(rows)
    figure = go.Figure()
    for kind, colour in (("exposed", "rgb(204, 102, 119)"), ("hidden", "rgb(136, 204, 238)")):
        figure.add_trace(go.Bar(x=labels, y=[rows[k][kind] * 1e6 for k in labels], name=f"{kind} communication",
                                marker_color=colour, text=[f"{rows[k][kind] * 1e6:.1f}" for k in labels],
                                textposition="inside", textfont=dict(size=14)))
    figure.add_trace(go.Scatter(x=labels, y=[rows[k]["end"] * 1e6 for k in labels], name="step ends at",
                                mode="markers+lines", marker=dict(size=12, color="black")))
    figure.update_layout(
        barmode="stack", font=_FONT, template="plotly_white", height=430,
        title=dict(text="one backward step per bucket size (modelled, rank 0)", font=dict(size=17)),
        xaxis=dict(title=dict(text="bucket size", font=_FONT), tickfont=_FONT),
        yaxis=dict(title=dict(text="microseconds", font=_FONT), tickfont=_FONT, rangemode="tozero"),
        legend=dict(font=_FONT), margin=dict(l=80, r=20, t=70, b=70))
    return figure


def bucket_slider(figures: Mapping[str, go.Figure], default: str | None = None):
    """An ipywidgets ``VBox``: a ``SelectionSlider`` over ``figures``' labels and an output area showing
    the chosen figure (``default``: the first label). Displayed, it also offers ``default``'s figure
    as ``text/html`` (its ``fallback_html``), for static pages where the slider cannot run."""
    import ipywidgets as widgets
    from IPython.display import display

    labels = list(figures)
    if not labels:
        raise ValueError("bucket_slider: figures is empty")
    if default is None:
        default = labels[0]
    if default not in figures:
        raise ValueError(f"bucket_slider: default={default!r} is not one of {labels}")
    # first, so that a renderer showing plotly.js once (simcomm.viz.render) writes it into the cell's
    # own output, where the static page needs it, not into the slider's output area
    fallback = _figure_html(figures[default])
    slider = widgets.SelectionSlider(options=labels, value=default, description="bucket size",
                                     continuous_update=False, style={"description_width": "initial"},
                                     layout=widgets.Layout(width="600px"))
    output = widgets.Output()

    def show(change=None) -> None:
        output.clear_output(wait=True)
        with output:
            display(figures[slider.value])

    slider.observe(show, names="value")
    show()
    box = _vbox_with_fallback()([slider, output])
    box.fallback_html = (f'<p><em>bucket size: {html.escape(default)}. The slider needs a running kernel; '
                         f'this is its figure for {html.escape(default)}.</em></p>' + fallback)
    return box


def _figure_html(figure: go.Figure) -> str:
    """``figure`` as the notebook's renderer writes it for an HTML export (:mod:`simcomm.viz.render`;
    displaying it there also writes plotly.js into the page if no figure did yet)."""
    from .render import EmbeddedHtmlRenderer

    bundle = figure._repr_mimebundle_()
    return bundle.get("text/html") or EmbeddedHtmlRenderer().to_mimebundle(figure.to_dict())["text/html"]


@functools.cache
def _vbox_with_fallback() -> type:
    """A ``VBox`` whose display adds its ``fallback_html`` as ``text/html`` beside the widget view."""
    import ipywidgets as widgets

    class VBoxWithFallback(widgets.VBox):
        fallback_html = ""

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            if bundle is not None and self.fallback_html:
                bundle = {**bundle, "text/html": self.fallback_html}
            return bundle

    return VBoxWithFallback
