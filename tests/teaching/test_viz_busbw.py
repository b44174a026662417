"""busbw_figure: measured rows beside the model's curves, each line told apart without colour alone."""
from __future__ import annotations

import json
import math

import pytest

from simcomm.model.cost import GB, estimate
from simcomm.viz.busbw import _PLOT_PX, busbw_figure, load_measured

ROWS = [{"op": "all_reduce", "size": s, "busbw": b, "wrong": 0} for s, b in ((1024, 0.01), (4096, 0.03))] + \
       [{"op": "all_gather", "size": s, "busbw": b, "wrong": 0} for s, b in ((1024, 0.02), (4096, 0.05))]


def _assert_lines_distinct(figure):
    styles = [(t.line.color, t.line.dash) for t in figure.data]
    assert len(set(t.line.color for t in figure.data)) == len(figure.data), styles
    model = [t for t in figure.data if "measured" not in t.name]
    assert len({t.line.dash for t in model}) == len(model), styles
    labels = figure.layout.annotations
    assert [a.text for a in sorted(labels, key=lambda a: a.font.color)] == [
        t.meta["label"] for t in sorted(figure.data, key=lambda t: t.line.color)]
    for trace in figure.data:
        assert trace.line.width >= 3
        label, = [a for a in labels if a.font.color == trace.line.color]   # at its right end, in its colour
        assert label.x == pytest.approx(math.log10(trace.x[-1])) and label.font.size >= 14
    # labels never overlap: their heights on the plot (value's pixel + nudge) are 20 px apart
    log = figure.layout.yaxis.type == "log"
    values = [math.log10(v) if log else v for t in figure.data for v in t.y if v > 0 or not log]
    low, high = (min(values), max(a.y for a in labels)) if log else (min(0, min(values)), max(a.y for a in labels))
    heights = sorted((a.y - low) / ((high - low) or 1) * _PLOT_PX + a.yshift for a in labels)
    assert all(b - a >= 20 - 1e-6 for a, b in zip(heights, heights[1:])), heights
    assert figure.layout.font.size >= 14 and figure.layout.xaxis.tickfont.size >= 14
    assert "<sup>" not in figure.layout.title.text


def test_measured_and_model_traces(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"world_size": 8, "backend": "nccl", "rows": ROWS}))
    figure = busbw_figure(path, "h100-nvswitch", algorithms=True)
    names = [trace.name for trace in figure.data]
    assert names == ["all_reduce measured", "all_reduce model h100-nvswitch (ring)",
                     "all_reduce model h100-nvswitch (tree)", "all_reduce model h100-nvswitch (nvls)",
                     "all_gather measured", "all_gather model h100-nvswitch (ring)"]
    measured = figure.data[0]
    assert list(measured.x) == [1024, 4096] and list(measured.y) == [0.01, 0.03]
    ring = figure.data[1]
    assert ring.x[0] == 1024 and ring.x[-1] == 4096
    assert ring.y[-1] == pytest.approx(estimate("all_reduce", 4096, 8, "h100-nvswitch", "ring").busbw / GB)
    assert [t.meta["label"] for t in figure.data] == ["all_reduce measured", "all_reduce ring", "all_reduce tree",
                                               "all_reduce nvls", "all_gather measured", "all_gather ring"]
    assert figure.layout.xaxis.type == "log"
    assert "8 ranks" in figure.layout.title.text
    _assert_lines_distinct(figure)
    html = figure.to_html(full_html=False, include_plotlyjs=False)
    assert all(f'"name":"{name}"' in html for name in names)


def test_log_axis_when_the_values_span_decades():
    wide = busbw_figure(topology="h100-nvswitch", world_size=8, algorithms=True)      # 1 KiB to 4 GiB
    assert wide.layout.yaxis.type == "log" and "log scale" in wide.layout.yaxis.title.text
    values = [v for t in wide.data for v in t.y]
    assert max(values) / min(values) > 100
    narrow = busbw_figure(topology="h100-nvswitch", world_size=8, sizes=[1 << 30, 2 << 30])
    assert narrow.layout.yaxis.type == "linear"
    assert busbw_figure(topology="h100-nvswitch", world_size=8, log_y=False).layout.yaxis.type == "linear"
    _assert_lines_distinct(wide)


def test_model_only_and_errors():
    figure = busbw_figure(topology=["a100-hdr-cluster", "h100-ndr-cluster"], world_size=16,
                          ops=["allreduce"], sizes=[1 << 20, 1 << 30])
    a100, h100 = figure.data
    assert [t.name for t in figure.data] == ["all_reduce model a100-hdr-cluster",
                                             "all_reduce model h100-ndr-cluster"]
    assert a100.y[-1] < h100.y[-1]          # 4 HDR NICs per node against 8 NDR NICs
    _assert_lines_distinct(figure)
    # no NVLS line where the switch cannot do it (across nodes)
    across = busbw_figure(topology="h100-ndr-cluster", world_size=16, algorithms=True)
    assert [t.name.split("(")[1].rstrip(")") for t in across.data] == ["ring", "tree"]
    with pytest.raises(ValueError, match="world_size=16 exceeds the 8 GPUs"):
        busbw_figure(topology="a100-nvswitch", world_size=16)
    with pytest.raises(ValueError, match="measured rows, a topology"):
        busbw_figure()
    with pytest.raises(ValueError, match="world_size is needed"):
        busbw_figure(topology="h100-nvswitch")
    with pytest.raises(ValueError, match="lacks \\['busbw'\\]"):
        load_measured([{"op": "all_reduce", "size": 8}])
    with pytest.raises(ValueError, match="busbw_figure: unknown op 'all_reduc'"):
        busbw_figure(topology="h100-nvswitch", world_size=8, ops=["all_reduc"])
