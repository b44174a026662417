"""simcomm.viz.render: figures carry an HTML form without plotly.js; the library is shown once."""
from __future__ import annotations

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from simcomm.viz import render


@pytest.fixture
def restore_default():
    before = pio.renderers.default
    yield
    pio.renderers.default = before


def test_use_export_renderer_is_the_default_and_idempotent(restore_default):
    render.use_export_renderer()
    assert pio.renderers.default == render.RENDERER
    pending = list(pio.renderers._to_activate)
    render.use_export_renderer()                       # a second call does not queue plotly.js again
    assert pio.renderers._to_activate == pending


def test_bundle_holds_the_plotly_mimetype_and_html_without_the_library():
    fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))
    bundle = render._CombinedRenderer().to_mimebundle(fig.to_dict())
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html"}
    html = bundle["text/html"]
    assert "Plotly.newPlot(" in html and json.dumps([[1, 2], [3, 4]]).replace(" ", "") in html.replace(" ", "")
    assert "plotly.js v" not in html and "<script src=" not in html    # no library, no CDN, no MathJax
    # a figure wider than the page scrolls inside its box (checked in Chromium at 1024 px in test_handout)
    assert html.startswith(f'<div class="{render.SCROLL_CLASS}" style="max-width:100%;overflow-x:auto">')


def test_not_in_a_kernel_here():
    assert render.in_kernel() is False
