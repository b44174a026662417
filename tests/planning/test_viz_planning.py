"""Lesson 15's memory figure filters by memory before ranking and takes its container's width."""
from __future__ import annotations

import pytest

from simcomm.models.llama import LLAMA3_70B
from simcomm.planning import planner
from simcomm.planning.planner import GiB
from simcomm.viz.cluster_plan import plan_figure
from simcomm.viz.planning import layout_memory_figure

ROWS = planner.plan(LLAMA3_70B, 1024, seq=8192, global_batch=1024)
LIMIT = planner.H100_MEMORY


def test_bars_are_the_fastest_fitting_layouts():
    fig = layout_memory_figure(ROWS, LIMIT, top=16)
    fitting = sorted((r for r in ROWS if r["total"] <= LIMIT), key=lambda r: r["step_time"])[:16]
    names = ["tp{} cp{} pp{} dp{}".format(*planner.key(r)) for r in fitting]
    bars = [trace for trace in fig.data if trace.type == "bar"]
    assert list(bars[0].x) == names
    totals = [sum(trace.y[i] for trace in bars) for i in range(len(names))]
    assert all(total <= LIMIT / GiB + 1e-9 for total in totals)
    unfiltered = layout_memory_figure(ROWS, LIMIT, fitting_only=False)
    fastest = sorted(ROWS, key=lambda r: r["step_time"])[:16]
    assert list(unfiltered.data[0].x) == ["tp{} cp{} pp{} dp{}".format(*planner.key(r)) for r in fastest]
    assert any(r["total"] > LIMIT for r in fastest)              # so filtering first matters here
    with pytest.raises(ValueError, match="no row fits"):
        layout_memory_figure(ROWS, 1.0)


def test_figures_have_no_fixed_width():
    fig = layout_memory_figure(ROWS, LIMIT)
    assert fig.layout.width is None and fig.layout.autosize
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y < 0       # below the plot


def test_plan_figure_has_no_fixed_width():
    import simcomm
    from simcomm.planning import cluster_step
    from simcomm.parallel.mesh import Layout
    layout = Layout(pp=2, dp=2, tp=2)
    world = simcomm.World(8, tensors="shape")
    world.run(cluster_step.step, layout, cluster_step.Block(hidden=64, heads=4, seq=32, micro_batches=2))
    fig = plan_figure(world.trace, "h100-ndr-cluster")
    assert fig.layout.width is None and fig.layout.autosize
