"""Lesson 14's loss curves: text at least 14 px, at most 1024 px wide, the largest difference in the title,
the data in a static HTML export."""
from __future__ import annotations

import json

import plotly.io
import pytest
import torch

from simcomm.viz.loss_curves import loss_curves
from simcomm.viz.style import MIN_FONT_PX


def _font_sizes(node, key="") -> list[float]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "size" and "font" in key and isinstance(v, (int, float))] + [
            size for k, v in node.items() for size in _font_sizes(v, k if "font" in k else key)]
    if isinstance(node, list):
        return [size for item in node for size in _font_sizes(item, key)]
    return []


def test_curves_lie_on_each_other_and_the_title_gives_the_largest_difference():
    reference = torch.tensor([3.0, 2.5, 2.25, 2.0], dtype=torch.float64)
    fig = loss_curves({"one device": reference, "4-D": reference + torch.tensor([0, 1e-15, 0, 0.0]),
                       "resumed": [2.25, 2.0 + 3e-13]}, first_steps={"resumed": 2})
    assert [trace.name for trace in fig.data] == ["one device", "4-D", "resumed"]
    assert list(fig.data[2].x) == [2, 3]
    assert "largest difference from one device: 3.0e-13" in fig.layout.title.text
    sizes = _font_sizes(json.loads(fig.to_json()))
    assert sizes and min(sizes) >= MIN_FONT_PX and fig.layout.width is None   # sized to its column
    assert "2.25" in plotly.io.to_html(fig, include_plotlyjs=False)


def test_loss_curves_needs_a_series():
    with pytest.raises(ValueError, match="at least one name"):
        loss_curves({})
