"""The alpha-beta cost model, its presets against their cited figures, and trace annotation."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import simcomm
from simcomm import cost
from simcomm.cost import GB, OPS, PRESETS, Topology, annotate, busbw_factor, estimate

SIZES = [0] + [1 << k for k in range(0, 36, 3)]


# --- busbw factors ---------------------------------------------------------------------------

@pytest.mark.parametrize("op, world_size, factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 2, 1.0), ("all_reduce", 16, 2 * 15 / 16),
    ("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4), ("all_to_all", 8, 7 / 8),
    ("gather", 2, 1 / 2),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send_recv", 8, 1.0), ("send", 2, 1.0),
])
def test_busbw_factor_is_nccl_tests(op, world_size, factor):
    assert busbw_factor(op, world_size) == pytest.approx(factor)


def test_busbw_is_algbw_times_factor():
    for op in OPS:
        result = estimate(op, 1 << 26, 8, "h100-nvswitch")
        assert result.algbw == pytest.approx(result.nbytes / result.time)
        assert result.busbw == pytest.approx(result.algbw * busbw_factor(op, 8))


def test_unknown_op_and_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'allreduc'"):
        busbw_factor("allreduc", 8)
    with pytest.raises(ValueError, match="world_size.*0"):
        busbw_factor("all_reduce", 0)
    with pytest.raises(ValueError, match=r"estimate\('all_gather'\).*algorithm='tree'"):
        estimate("all_gather", 1024, 8, "h100-nvswitch", algorithm="tree")
    with pytest.raises(ValueError, match=r"estimate\('all_reduce'\).*world_size=16.*8 GPUs"):
        estimate("all_reduce", 1024, 16, "h100-nvswitch")
    with pytest.raises(ValueError, match=r"world_size must be an int >= 2.*1"):
        estimate("all_reduce", 1024, 1, "h100-nvswitch")
    with pytest.raises(ValueError, match=r"nbytes.*-1"):
        estimate("broadcast", -1, 4, "h100-nvswitch")
    with pytest.raises(ValueError, match=r"ranks \[9\]"):
        estimate("all_reduce", 1024, 2, "h100-nvswitch", ranks=(0, 9))
    with pytest.raises(ValueError, match="unknown topology preset 'dgx-z'"):
        estimate("all_reduce", 1024, 2, "dgx-z")
    with pytest.raises(ValueError, match="link_efficiency"):
        Topology(name="bad", gpus_per_node=2, nodes=1, link_bandwidth=1e9, link_efficiency=1.5,
                 link_latency=1e-6)
    with pytest.raises(ValueError, match="3 nodes need nics_per_node"):
        Topology(name="bad", gpus_per_node=2, nodes=3, link_bandwidth=1e9, link_efficiency=0.5,
                 link_latency=1e-6)


# --- shape of the model ----------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("op", OPS)
def test_more_bytes_is_never_faster(preset, op):
    topology = PRESETS[preset]
    world_size = min(topology.max_ranks, 16)
    for algorithm in [None, *cost.ALGORITHMS[op]]:
        times = [estimate(op, size, world_size, topology, algorithm).time for size in SIZES]
        assert all(a < b for a, b in zip(times, times[1:])), (algorithm, times)
        busbws = [estimate(op, size, world_size, topology, algorithm).busbw for size in SIZES]
        assert all(a <= b for a, b in zip(busbws, busbws[1:])), (algorithm, busbws)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("op", OPS)
def test_latency_dominates_small_and_bandwidth_large(preset, op):
    topology = PRESETS[preset]
    world_size = min(topology.max_ranks, 16)
    small = estimate(op, 8, world_size, topology)
    large = estimate(op, 16 << 30, world_size, topology)
    assert small.latency / small.time > 0.99
    assert large.bandwidth_time / large.time > 0.9
    if op not in ("all_to_all", "gather"):
        # ring and chain algorithms: busbw approaches the busiest link's bandwidth, never above
        place = cost._placement(op, world_size, topology, None)
        assert large.busbw <= cost._bus_bandwidth(topology, place) * (1 + 1e-9)


def test_ring_and_tree_cross_over_for_all_reduce():
    topology = PRESETS["h100-nvswitch"]
    winners = []
    for size in SIZES[1:]:
        ring = estimate("all_reduce", size, 8, topology, "ring")
        tree = estimate("all_reduce", size, 8, topology, "tree")
        chosen = estimate("all_reduce", size, 8, topology)
        assert chosen.time == min(ring.time, tree.time)
        winners.append(chosen.algorithm)
    # tree (2 log2 n steps) wins while latency dominates, ring (2(n-1)/n of the bytes) once bandwidth does
    assert winners[0] == "tree" and winners[-1] == "ring"
    switch = winners.index("ring")
    assert set(winners[switch:]) == {"ring"}
    cross_over = SIZES[1:][switch]
    assert 1 << 10 < cross_over < 1 << 30


def test_tree_cross_over_moves_up_when_the_ring_is_long():
    """Across 16 nodes the ring's 2(n-1) network hops keep tree ahead up to larger messages."""
    def cross_over(world_size):
        for size in SIZES[1:]:
            if estimate("all_reduce", size, world_size, "a100-hdr-cluster").algorithm == "ring":
                return size
        return math.inf
    assert cross_over(16) < cross_over(128)


def test_spanning_nodes_is_limited_by_the_slower_level():
    topology = PRESETS["a100-hdr-cluster"]
    inside = estimate("all_reduce", 8 << 30, 8, topology, "ring")
    across = estimate("all_reduce", 8 << 30, 16, topology, "ring")
    assert inside.nodes == 1 and across.nodes == 2
    assert inside.busbw == pytest.approx(topology.intra_bandwidth, rel=0.02)
    assert across.busbw == pytest.approx(topology.nic_share(8), rel=0.02)
    assert across.busbw < 0.5 * inside.busbw
    # the same two ranks are faster on one node than on two
    same_node = estimate("send_recv", 1 << 30, 2, topology, ranks=(0, 1))
    two_nodes = estimate("send_recv", 1 << 30, 2, topology, ranks=(0, 8))
    assert two_nodes.nodes == 2 and two_nodes.time > same_node.time


# --- presets reproduce their cited figures ----------------------------------------------------

CITED = [
    # preset, op, ranks, bytes, cited busbw (GB/s), source
    ("h100-nvswitch", "all_reduce", 8, 8 << 30, 370,
     "https://github.com/NVIDIA/nccl-tests/issues/212"),   # 8x H100, NCCL_ALGO=RING: ~370 GB/s
    ("a100-nvswitch", "all_reduce", 8, 8 << 30, 230,
     "https://github.com/NVIDIA/nccl-tests/issues/149"),   # 8x A100 SXM4: ~230 GB/s at 8 GB
    ("pcie-2gpu", "all_reduce", 2, 1 << 30, 22,
     "https://github.com/NVIDIA/nccl/issues/1202"),        # L40S on one PCIe Gen4 switch: 22 GB/s
    ("a100-hdr-cluster", "all_reduce", 16, 8 << 30, 91,
     "https://github.com/NVIDIA/nccl-tests/issues/100"),   # 2 HGX A100 nodes, 4x HDR: 91 GB/s
    ("h100-ndr-cluster", "all_reduce", 2, 8 << 30, 47,
     "https://github.com/NVIDIA/nccl-tests/issues/290"),   # NDR 400 Gb/s: 46-48 GB/s per NIC
]


@pytest.mark.parametrize("preset, op, world_size, nbytes, cited, url", CITED, ids=[c[0] for c in CITED])
def test_preset_reproduces_its_cited_figure(preset, op, world_size, nbytes, cited, url):
    topology = PRESETS[preset]
    ref = topology.reference
    assert (ref.op, ref.world_size, ref.nbytes, ref.busbw, ref.url) == (op, world_size, nbytes,
                                                                        cited * GB, url)
    model = estimate(op, nbytes, world_size, topology, ranks=ref.ranks)
    assert model.busbw == pytest.approx(cited * GB, rel=0.20), f"{preset} vs {url}"
    if ref.ranks is not None:
        assert model.nodes == len({topology.node_of(r) for r in ref.ranks})


HELD_OUT = [
    # figures no parameter was set from: preset, op, ranks, bytes, cited busbw (GB/s), source
    ("a100-hdr-cluster", "all_reduce", 24, 128 << 20, 96,
     "https://github.com/NVIDIA/nccl-tests/issues/119"),   # 3 A100 nodes, 4x HDR: ~96 GB/s peak
    ("a100-nvswitch", "send_recv", 8, 1 << 30, 195,                # 8x A100 sendrecv_perf: 195 GB/s
     "https://github.com/li-plus/playground/blob/b85070fb449ea55858fed14cf69cefe10592261b/cuda/nccl.md"),
    ("h100-nvswitch", "all_gather", 8, 8 << 30, 370,
     "https://github.com/NVIDIA/nccl-tests/issues/212"),   # ~370 GB/s as busbw of non-allreduce ops
]


@pytest.mark.parametrize("preset, op, world_size, nbytes, cited, url", HELD_OUT,
                         ids=[f"{c[0]}-{c[1]}" for c in HELD_OUT])
def test_preset_meets_held_out_figures(preset, op, world_size, nbytes, cited, url):
    assert (preset, cost.Reference(op, world_size, nbytes, cited * GB, url, figure="")) in [
        (name, dataclasses.replace(ref, figure="")) for name, ref in cost.CROSS_CHECKS]
    model = estimate(op, nbytes, world_size, preset)
    assert model.busbw == pytest.approx(cited * GB, rel=0.20), f"{preset} {op} vs {url}"


def test_every_preset_is_cited_and_in_the_validation_table():
    rows = cost.validation_table()
    assert {row["preset"] for row in rows if row["kind"] == "calibration"} == set(PRESETS) == {
        c[0] for c in CITED}
    assert len([row for row in rows if row["kind"] == "cross-check"]) == len(HELD_OUT)
    for row in rows:
        assert abs(row["error"]) < 0.20
        assert row["source"].startswith("https://github.com/")
    for topology in PRESETS.values():
        assert topology.compute_flops > 0


# --- annotate --------------------------------------------------------------------------------

def _program(comm):
    x = (torch.arange(8.0) + comm.rank).requires_grad_()
    y = comm.all_gather(x, dim=0)                    # (32,)
    z = comm.reduce_scatter(y * 2, dim=0)            # (8,)
    w = comm.all_reduce(z)
    comm.compute(seconds=1e-3)
    comm.compute(flops=2e12)
    b = comm.broadcast(w, src=1)
    comm.gather(b.detach(), dst=0, dim=0)
    if comm.rank % 2 == 0:
        comm.send(b.detach(), dst=comm.rank + 1)
    else:
        comm.recv((8,), torch.float32, src=comm.rank - 1)
    comm.barrier()
    pair = comm.subgroup([[0, 1], [2, 3]])
    pair.all_reduce(b.detach())
    b.sum().backward()
    return x.grad


def test_annotate_fills_every_event():
    world = simcomm.World(4)
    world.run(_program)
    trace = world.trace
    events_before = list(trace.events)
    assert all(event.modelled is None for event in trace)
    topology = PRESETS["h100-nvswitch"]
    result = annotate(trace, topology)
    assert result is trace and trace.events == events_before
    assert {e.op for e in trace} >= {"all_gather", "reduce_scatter", "all_reduce", "compute",
                                    "broadcast", "gather", "send", "recv", "barrier", "subgroup"}
    assert {e.phase for e in trace} == {"forward", "backward"}
    for event in trace:
        assert event.modelled is not None and event.modelled >= 0, event
        if event.op not in ("subgroup", "compute"):
            assert event.modelled >= topology.base_latency, event
    seconds = [e.modelled for e in trace if e.op == "compute" and e.args["seconds"] is not None]
    flops = [e.modelled for e in trace if e.op == "compute" and e.args["flops"] is not None]
    assert seconds == [1e-3] * 4
    assert flops == [pytest.approx(2e12 / topology.compute_flops)] * 4
    gather_event = next(e for e in trace if e.op == "all_gather" and e.phase == "forward")
    assert gather_event.nbytes == 8 * 4          # the rank's input: 8 float32
    assert gather_event.modelled == estimate("all_gather", 4 * 32, 4, topology).time
    pair_event = next(e for e in trace if e.op == "all_reduce" and len(e.group) == 2)
    assert pair_event.modelled == estimate("all_reduce", 32, 2, topology).time
    chrome = trace.to_chrome_trace()
    assert any("modelled_us" in e.get("args", {}) for e in chrome["traceEvents"])


def test_annotate_places_groups_on_nodes():
    """The same 2-rank all-reduce is slower when its ranks sit on different nodes."""
    topology = dataclasses.replace(PRESETS["a100-hdr-cluster"], gpus_per_node=2, nodes=2)

    def program(comm):
        inside = comm.subgroup([[0, 1], [2, 3]])
        inside.all_reduce(torch.ones(1 << 16))
        across = comm.subgroup([[0, 2], [1, 3]])
        across.all_reduce(torch.ones(1 << 16))

    world = simcomm.World(4)
    world.run(program)
    annotate(world.trace, topology)
    by_group = {e.group: e.modelled for e in world.trace if e.op == "all_reduce"}
    assert by_group[(0, 1)] < by_group[(0, 2)]


def test_annotate_rejects_a_trace_larger_than_the_topology():
    world = simcomm.World(4)
    world.run(lambda comm: comm.all_reduce(torch.ones(4)))
    with pytest.raises(ValueError, match=r"all_reduce.*ranks \[2, 3\].*2 GPUs"):
        annotate(world.trace, "pcie-2gpu")


def test_annotate_flops_needs_a_compute_rate():
    world = simcomm.World(2)
    world.run(lambda comm: comm.compute(flops=1e9))
    no_rate = dataclasses.replace(PRESETS["pcie-2gpu"], compute_flops=0.0)
    with pytest.raises(ValueError, match="flops=1000000000.0.*compute_flops=0.0"):
        annotate(world.trace, no_rate)


# --- modelled timeline -----------------------------------------------------------------------

def test_modelled_timeline_waits_for_the_last_rank():
    def program(comm):
        comm.compute(seconds=1e-3 * (comm.rank + 1))     # rank 1 arrives 1 ms later
        comm.all_reduce(torch.ones(1024))
        if comm.rank == 0:
            comm.send(torch.ones(256), dst=1)
        else:
            comm.compute(seconds=5e-3)
            comm.recv((256,), torch.float32, src=0)

    world = simcomm.World(2)
    world.run(program)
    topology = PRESETS["pcie-2gpu"]
    timeline = cost.modelled_timeline(annotate(world.trace, topology))
    assert len(timeline) == len(world.trace)
    reduce_time = estimate("all_reduce", 4096, 2, topology).time
    p2p_time = estimate("send_recv", 1024, 2, topology).time
    by_rank_op = {}
    for event, start, end in timeline:
        by_rank_op.setdefault((event.rank, event.op), []).append((start, end))
    assert by_rank_op[(0, "all_reduce")] == by_rank_op[(1, "all_reduce")] == [
        (2e-3, pytest.approx(2e-3 + reduce_time))]
    after_reduce = 2e-3 + reduce_time
    assert by_rank_op[(1, "compute")][1] == (pytest.approx(after_reduce), pytest.approx(after_reduce + 5e-3))
    # rank 0's send waits for rank 1 to reach its recv
    assert by_rank_op[(0, "send")] == by_rank_op[(1, "recv")]
    assert by_rank_op[(0, "send")][0][0] == pytest.approx(after_reduce + 5e-3)
    assert by_rank_op[(0, "send")][0][1] == pytest.approx(after_reduce + 5e-3 + p2p_time)


def test_modelled_timeline_needs_annotated_complete_traces():
    world = simcomm.World(2)
    world.run(lambda comm: comm.all_reduce(torch.ones(4)))
    with pytest.raises(ValueError, match=r"all_reduce of rank [01] .*annotate"):
        cost.modelled_timeline(world.trace)
    annotate(world.trace, "pcie-2gpu")
    with pytest.raises(ValueError, match="do not match up.*all_reduce step 0"):
        cost.modelled_timeline(world.trace.filter(rank=0))


def test_integer_arguments_may_be_numpy_or_torch_integers():
    import numpy as np

    expected = estimate("all_reduce", 1 << 20, 8, "h100-nvswitch")
    assert estimate("all_reduce", np.int64(1 << 20), np.int32(8), "h100-nvswitch") == expected
    assert estimate("all_reduce", torch.tensor(1 << 20).item(), 8, "h100-nvswitch") == expected
    with pytest.raises(ValueError, match="nbytes must be an int >= 0, got 1.5"):
        estimate("all_reduce", 1.5, 8, "h100-nvswitch")
    with pytest.raises(ValueError, match="world_size must be an int >= 2.*True"):
        estimate("all_reduce", 8, True, "h100-nvswitch")
