"""busbw_figure: measured rows beside the model's curves."""
from __future__ import annotations

import json

import pytest

from simcomm.cost import GB, estimate
from simcomm.viz.busbw import busbw_figure, load_measured

ROWS = [{"op": "all_reduce", "size": s, "busbw": b, "wrong": 0} for s, b in ((1024, 0.01), (4096, 0.03))] + \
       [{"op": "all_gather", "size": s, "busbw": b, "wrong": 0} for s, b in ((1024, 0.02), (4096, 0.05))]


def test_measured_and_model_traces(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"world_size": 8, "backend": "nccl", "rows": ROWS}))
    figure = busbw_figure(path, "h100-nvswitch", algorithms=True)
    names = [trace.name for trace in figure.data]
    assert names == ["all_reduce measured", "all_reduce model h100-nvswitch",
                     "all_reduce model h100-nvswitch (ring)", "all_reduce model h100-nvswitch (tree)",
                     "all_gather measured", "all_gather model h100-nvswitch"]
    measured = figure.data[0]
    assert list(measured.x) == [1024, 4096] and list(measured.y) == [0.01, 0.03]
    model = figure.data[1]
    assert model.x[0] == 1024 and model.x[-1] == 4096
    assert model.y[-1] == pytest.approx(estimate("all_reduce", 4096, 8, "h100-nvswitch").busbw / GB)
    assert figure.layout.xaxis.type == "log"
    assert "8 ranks" in figure.layout.title.text


def test_model_only_and_errors():
    figure = busbw_figure(topology=["a100-hdr-cluster", "h100-ndr-cluster"], world_size=16,
                          ops=["all_reduce"], sizes=[1 << 20, 1 << 30])
    a100, h100 = figure.data
    assert [t.name for t in figure.data] == ["all_reduce model a100-hdr-cluster",
                                             "all_reduce model h100-ndr-cluster"]
    assert a100.y[-1] < h100.y[-1]          # 4 HDR NICs per node against 8 NDR NICs
    with pytest.raises(ValueError, match="world_size=16 exceeds the 8 GPUs"):
        busbw_figure(topology="a100-nvswitch", world_size=16)
    with pytest.raises(ValueError, match="measured rows, a topology"):
        busbw_figure()
    with pytest.raises(ValueError, match="world_size is needed"):
        busbw_figure(topology="h100-nvswitch")
    with pytest.raises(ValueError, match="lacks \\['busbw'\\]"):
        load_measured([{"op": "all_reduce", "size": 8}])
