"""Figures and tables for cluster-scale traces (simcomm.viz.cluster_plan, aggregation in matrix and
timeline): bytes by link class and by node checked by hand on a small world."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.model.cost import modelled_timeline
from simcomm.viz import comm_matrix_figure, timeline_figure
from simcomm.viz.cluster_plan import (
    NETWORK,
    bytes_by_link,
    cluster,
    group_summary,
    link_table,
    plan_figure,
    step_summary,
)

ELEMENTS = 1024           # float32: 4096 bytes per rank


def _all_reduce(comm):
    comm.compute(seconds=1e-4)
    handle = comm.all_reduce(torch.ones(ELEMENTS), async_op=True)
    comm.compute(seconds=1e-4)
    return handle.wait().shape


@pytest.fixture(scope="module")
def trace():
    world = simcomm.World(16, tensors="shape")
    world.run(_all_reduce)
    return world.trace


def test_cluster_grows_a_preset_to_the_ranks():
    topology = cluster("h100-ndr-cluster", 1024)
    assert topology.nodes == 128 and topology.max_ranks == 1024 and topology.gpus_per_node == 8
    with pytest.raises(ValueError, match="single node"):
        cluster("h100-nvswitch", 16)


def test_bytes_by_link_counts_each_peer_once(trace):
    # all_reduce of b bytes on n ranks sends 2b/n to each peer: 7 peers in the node, 8 outside
    share = 2 * 4 * ELEMENTS // 16
    totals = bytes_by_link(trace, cluster("h100-ndr-cluster", 16))
    assert totals == {"all_reduce": {"nvlink": 16 * 7 * share, NETWORK: 16 * 8 * share}}
    table = link_table(trace, cluster("h100-ndr-cluster", 16))
    assert "all_reduce" in table and "network" in table and "total" in table
    with pytest.raises(ValueError, match="cluster"):
        bytes_by_link(trace, "h100-nvswitch")


def test_comm_matrix_by_node_and_by_group(trace):
    share = 2 * 4 * ELEMENTS // 16
    by_node = comm_matrix_figure(trace, by="node", ranks_per_node=8)
    assert [list(row) for row in by_node.data[0].z] == [[8 * 7 * share, 8 * 8 * share], [8 * 8 * share, 8 * 7 * share]]
    assert "node" in by_node.layout.title.text
    by_group = comm_matrix_figure(trace, by=[list(range(0, 16, 2)), list(range(1, 16, 2))])
    assert [list(row) for row in by_group.data[0].z] == [[8 * 7 * share, 8 * 8 * share], [8 * 8 * share, 8 * 7 * share]]
    with pytest.raises(ValueError, match="partition"):
        comm_matrix_figure(trace, by=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="ranks_per_node"):
        comm_matrix_figure(trace, by="node")


def test_timeline_draws_a_sample_of_many_ranks():
    world = simcomm.World(32, tensors="shape")
    world.run(_all_reduce)
    figure = timeline_figure(world.trace, modelled=True, topology=cluster("h100-ndr-cluster", 32))
    rows = set(figure.layout.yaxis.categoryarray)
    assert len(rows) == 16                             # 8 ranks x (compute, comm)
    assert "8 of 32 ranks drawn" in figure.layout.title.text and "all 32 ranks" in figure.layout.title.text
    by_group = timeline_figure(world.trace, modelled=True, topology=cluster("h100-ndr-cluster", 32),
                               groups={"node": [list(range(0, 16)), list(range(16, 32))]})
    assert "node groups (2): exposed comm per rank" in by_group.layout.title.text
    chosen = timeline_figure(world.trace, ranks=[3, 5])
    assert set(chosen.layout.yaxis.categoryarray) == {"rank 3", "rank 5"}
    with pytest.raises(ValueError, match="ranks"):
        timeline_figure(world.trace, ranks=[99])


def test_step_summary_and_plan_figure(trace):
    topology = cluster("h100-ndr-cluster", 16)
    timeline = modelled_timeline(trace, topology)
    summary = step_summary(trace, topology, timeline)
    ranks = timeline.ranks.values()
    assert summary["ranks"] == 16
    assert summary["step_time"] == max(s.end for s in ranks)
    assert summary["compute"] == pytest.approx(2e-4)
    assert summary["exposed"] + summary["hidden"] == pytest.approx(summary["communication"])
    assert summary["hidden"] > 0                       # the async all-reduce runs under the second compute
    per_node = group_summary(timeline, [list(range(8)), list(range(8, 16))])
    assert [row["group"] for row in per_node] == [0, 1]
    figure = plan_figure(trace, topology)
    assert figure.layout.meta["step"] == summary
    assert "16 ranks" in figure.layout.title.text
