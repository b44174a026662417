"""No figure of :mod:`simcomm.viz` asks for more width than a projector's output column.

The figures of the lessons are measured in Chromium by ``tests/teaching/test_browser_figures.py``
(slow); this is the fast tier's guard on the same rule, from the figures' layouts: a figure either
sizes to its column (no ``layout.width``: plotly's autosize) or is at most
:data:`simcomm.viz.style.MAX_WIDTH_PX` wide, also for the largest inputs the lessons draw.
"""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import viz
from simcomm.viz import recompute
from simcomm.viz.style import MAX_WIDTH_PX, fit_width


def _trace(world_size: int):
    def program(comm):
        x = torch.arange(4.0) + comm.rank
        comm.all_reduce(x)
        comm.all_gather(x, dim=0)
        return x
    world = simcomm.World(world_size)
    world.run(program)
    return world.trace


def _figures():
    trace = _trace(12)
    yield "timeline", viz.timeline_figure(trace)
    yield "modelled timeline", viz.timeline_figure(_trace(8), modelled=True, topology="h100-nvswitch")
    yield "comm matrix, 12 ranks", viz.comm_matrix_figure(trace)
    yield "busbw", viz.busbw_figure(topology="h100-nvswitch", world_size=8, algorithms=True)
    yield "shards, large MLP", viz.tp_mlp_shards_figure(hidden=16, ffn=32, world_size=4)
    yield "rank grid, 8 wide tensors", viz.rank_grid([torch.zeros(4, 64) + r for r in range(8)])
    yield "ring all-reduce, 8 ranks", viz.ring_allreduce_figure(8)
    yield "recompute trade-off", recompute.trade_figure([{"mode": "none", "bytes": 4096, "compute": 1.0},
                                                        {"mode": "full", "bytes": 1024, "compute": 1.33}])


@pytest.mark.parametrize("name, figure", list(_figures()), ids=[name for name, _ in _figures()])
def test_a_figure_sizes_to_its_column_or_fits_it(name, figure):
    width = figure.layout.width
    assert width is None or width <= MAX_WIDTH_PX, f"{name}: layout.width={width} > {MAX_WIDTH_PX}"


def test_fit_width_caps_at_the_column():
    assert fit_width(1200) == MAX_WIDTH_PX and fit_width(300.7) == 300 and MAX_WIDTH_PX <= 844
