"""Figures and the layout widget of lessons 09-12: text at least 14 px, a static HTML export
holds the data, and the widget reruns and redraws for the chosen layout."""
from __future__ import annotations

import json

import pytest
import torch

from simcomm.planning.layout_choice import TOPOLOGIES
from simcomm.parallel.mesh import Layout
from simcomm.models.transformer import make_block
from simcomm.viz import scaling as figures


def font_sizes(fig) -> list[float]:
    """Every font size set anywhere in the figure's JSON."""
    sizes = []

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "size" and "font" in key and isinstance(v, (int, float)):
                    sizes.append(v)
                walk(v, k if "font" in k else key)
        elif isinstance(node, list):
            for item in node:
                walk(item, key)

    walk(json.loads(fig.to_json()))
    return sizes


ROWS = [{"tp": 1, "dp": 8, "pp": 1, "peak_bytes": 4096, "NVLink node": 1e-5, "InfiniBand cluster": 2e-5},
        {"tp": 2, "dp": 4, "pp": 1, "peak_bytes": 2048, "NVLink node": 3e-5, "InfiniBand cluster": 5e-5}]


@pytest.mark.parametrize("fig", [
    figures.bars_per_rank({"contiguous": [1, 2, 3, 4], "zigzag": [2.5] * 4}, title="work", y_title="flops"),
    figures.tokens_per_expert_figure([[1, 0, 3], [2, 2, 0]], title="tokens"),
    figures.layout_figure(ROWS, list(TOPOLOGIES)),
    figures.load_balance_figure({"before": [6, 1, 1], "after": [3, 3, 2]}, title="load"),
], ids=["bars", "tokens", "layouts", "load balance"])
def test_text_is_at_least_14_px_and_survives_html_export(fig):
    sizes = font_sizes(fig)
    assert sizes and min(sizes) >= 14, sizes
    html = fig.to_html(include_plotlyjs=False, full_html=False)
    assert fig.layout.title.text in html and '"type":"bar"' in html.replace(" ", "")


def test_layout_explorer_runs_the_chosen_layout_and_redraws():
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 8, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    choices = [Layout(pp=1, dp=2, tp=2), Layout(pp=1, dp=4, tp=1), Layout(pp=2, dp=1, tp=2)]
    explorer = figures.LayoutExplorer(x, w, make_block(8, 16), 4, choices, TOPOLOGIES, layout=choices[0])
    first = explorer.figure
    assert explorer.row["tp"] == 2 and explorer.row["max_error"] < 1e-10
    assert "tp=2 dp=2 pp=1" in first.layout.title.text and len(explorer.output.outputs) == 1
    # lesson 12: the retitled figure keeps the title at the top and the legend at the bottom (no overlap)
    assert (first.layout.title.yref, first.layout.title.yanchor) == ("container", "top")
    assert (first.layout.legend.yref, first.layout.legend.yanchor) == ("container", "bottom")
    assert first.layout.margin.t >= 26 + 20 * first.layout.title.text.count("<br>") + 20
    explorer.layout.value = choices[2]                      # as a learner picking from the dropdown
    assert explorer.figure is not first and "tp=2 dp=1 pp=2" in explorer.figure.layout.title.text
    explorer.topology.value = "InfiniBand cluster"
    assert "InfiniBand cluster" in explorer.figure.layout.title.text
    assert explorer.output.outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"]


def test_load_balance_figure_names_each_routings_imbalance_and_draws_the_mean():
    fig = figures.load_balance_figure({"before": [6, 1, 1], "after": [3, 3, 2]}, title="load")
    assert [t.name for t in fig.data] == ["before (max/mean 2.25)", "after (max/mean 1.12)"]
    assert [list(t.y) for t in fig.data] == [[6, 1, 1], [3, 3, 2]]
    assert [shape.y0 for shape in fig.layout.shapes] == [8 / 3]
