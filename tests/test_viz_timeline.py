"""timeline_figure: a row per rank, a bar per call, backward hatched; modelled durations from the cost model."""
import pytest
import torch

import simcomm
from simcomm.cost import annotate
from simcomm.viz import timeline_figure


def forward_backward(comm):
    x = torch.ones(2, 4, requires_grad=True)
    y = comm.all_gather(x, dim=0)
    comm.compute(seconds=1e-3)
    comm.all_reduce(y).sum().backward()
    return x.grad


@pytest.fixture
def trace():
    world = simcomm.World(3)
    world.run(forward_backward)
    return world.trace


def test_one_bar_per_event_on_its_rank_row(trace):
    fig = timeline_figure(trace)
    bars = [(y, trace_.name) for trace_ in fig.data for y in trace_.y]
    assert len(bars) == len(trace.events)
    for rank in range(3):
        assert sum(1 for y, _ in bars if y == f"rank {rank}") == len(trace.filter(rank=rank).events)
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0", "rank 1", "rank 2"]
    names = {t.name for t in fig.data}
    # the backward of all_gather is a reduce-scatter
    assert names == {"all_gather (forward)", "reduce_scatter (backward)", "all_reduce (forward)",
                     "all_reduce (backward)", "compute"}
    for bar in fig.data:
        assert bar.marker.pattern.shape == ("/" if "(backward)" in bar.name else "")


def test_hover_names_op_phase_shape_and_bytes(trace):
    fig = timeline_figure(trace)
    gather = next(t for t in fig.data if t.name == "all_gather (forward)")
    hover = gather.customdata[0]
    assert "<b>all_gather</b> (forward)" in hover
    assert "shape (2, 4) -> (6, 4) float32" in hover
    assert "sent 64 B, received 64 B" in hover  # 32 bytes to each of 2 peers


def test_modelled_bars_use_the_cost_model_durations(trace):
    with pytest.raises(ValueError, match=r"timeline_figure: modelled=True but .* call simcomm.cost.annotate"):
        timeline_figure(trace, modelled=True)
    annotate(trace, "h100-nvswitch")
    fig = timeline_figure(trace, modelled=True)
    unit_scale = {"µs": 1e6, "ms": 1e3, "s": 1.0}[fig.layout.xaxis.title.text.split("(")[1].rstrip(")")]
    widths = sorted(w for t in fig.data for w in t.x)
    assert widths == pytest.approx(sorted(e.modelled * unit_scale for e in trace.events))
    compute = next(t for t in fig.data if t.name == "compute")
    assert list(compute.x) == pytest.approx([1e-3 * unit_scale] * 3)
    for t in fig.data:  # every rank's calls are laid end to end: no bar starts before zero
        assert min(t.base) >= 0


def test_errors():
    with pytest.raises(ValueError, match="timeline_figure: the trace has no events"):
        timeline_figure(simcomm.Trace())
