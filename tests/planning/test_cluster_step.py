"""The shape-only 3-D step puts its ranks on the one mesh: each rank's tensor, data and pipeline
collectives run on exactly the groups simcomm.parallel.mesh.Layout gives it (which
tests/parallel/test_mesh.py checks against torch's init_device_mesh); a layout is named, never positional."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.planning import cluster_step
from simcomm.parallel.mesh import Layout

SMALL = cluster_step.Block(hidden=16, heads=2, seq=4, micro_batches=2, layers=1, dtype=torch.float32)


@pytest.mark.parametrize("tensors", ["real", "shape"])
@pytest.mark.parametrize("sizes", [dict(pp=2, dp=3, tp=2), dict(pp=3, dp=2, tp=1), dict(pp=1, dp=2, tp=2)])
def test_each_collective_runs_on_the_mesh_group_of_its_dimension(sizes, tensors):
    layout = Layout(**sizes)
    world = simcomm.World(layout.world_size, tensors=tensors)
    world.run(cluster_step.step, layout, SMALL)
    for rank in range(layout.world_size):
        groups = {}
        for event in world.trace.filter(rank=rank).events:
            if event.op not in ("compute", "subgroup"):
                groups.setdefault(event.op, set()).add(event.group)
        tp, dp, pp = (tuple(layout.group_of(rank, dim)) for dim in ("tp", "dp", "pp"))
        assert groups.get("all_reduce", set()) == {tp, dp}, rank
        assert groups.get("send", set()) == groups.get("recv", set()) == ({pp} if len(pp) > 1 else set()), rank


def test_the_layout_is_a_named_mesh():
    with pytest.raises(TypeError, match="by name only"):
        Layout(2, 2, 2)
    with pytest.raises(simcomm.RankError) as info:
        simcomm.World(8).run(cluster_step.step, (2, 2, 2), SMALL)
    assert "cluster_step.step: rank 0: layout=(2, 2, 2) must be a simcomm.parallel.mesh.Layout" in str(
        info.value.__cause__)
    with pytest.raises(simcomm.RankError, match="cp=2; this step has no context parallelism"):
        simcomm.World(4).run(cluster_step.step, Layout(cp=2, tp=2), SMALL)
