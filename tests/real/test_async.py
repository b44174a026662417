"""Async collectives, isend/irecv and batch_isend_irecv on real gloo processes: the same values,
gradients and trace fields as on virtual ranks, checked against the single-device reference."""
from __future__ import annotations

import pytest
import torch

import simcomm
from real.cases import async_cases

from .test_collectives import assert_cases_pass
from ..sim.test_async import _dp_step, _model, assert_single_device_gradients

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2ranks", "3ranks", "4ranks"])
def cluster(request, gloo_cluster):
    return gloo_cluster(request.param)


def test_async_cases_match_reference_and_simulator(cluster):
    assert_cases_pass(cluster, [case.name for case in async_cases()])


def _ring(comm):
    x = torch.arange(3, dtype=torch.float64) + 10 * comm.rank
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    send, recv = comm.batch_isend_irecv([simcomm.P2POp("isend", x, nxt),
                                         simcomm.P2POp("irecv", ((3,), torch.float64), prev)])
    return recv.wait(), send.wait()


def test_batch_ring(cluster):
    world_size = cluster.world_size
    for rank, (got, sent) in enumerate(cluster.run(_ring)):
        assert sent is None
        assert torch.equal(got, torch.arange(3, dtype=torch.float64) + 10 * ((rank - 1) % world_size))
    events = cluster.trace.filter(op="recv").events
    assert len(events) == world_size
    assert all(e.async_op and e.start <= e.end <= e.waited and e.args == {} for e in events)


def test_bucketed_data_parallel_step_and_trace(cluster):
    world_size = cluster.world_size
    state = _model().state_dict()
    assert_single_device_gradients(cluster.run(_dp_step, state), state, world_size)
    reduces = cluster.trace.filter(op="all_reduce").events
    assert len(reduces) == 2 * world_size
    assert all(e.async_op and e.start < e.end <= e.waited and e.args == {"op": "avg"} for e in reduces)
    # the same records on both backends
    world = simcomm.World(world_size)
    world.run(_dp_step, state)

    def fields(trace):
        return sorted((e.rank, e.step, e.op, e.phase, e.async_op, e.nbytes, str(e.args)) for e in trace)

    assert fields(cluster.trace) == fields(world.trace)


def _changed_after_the_call(comm):
    """Every async call's input changed (and freed) right after the call, before any wait: what
    moves is what the program passed at the call. Rank 1 is slow, so checked mode's checks are
    still pending on rank 0 when it changes its tensors."""
    import time
    world, rank = comm.world_size, comm.rank
    if rank == 1:
        time.sleep(0.2)
    x = torch.full((4,), float(rank + 1), dtype=torch.float64)
    handles = [comm.all_reduce(x, async_op=True), comm.all_gather(x, dim=0, async_op=True),
               comm.reduce_scatter(x.repeat(world), dim=0, async_op=True),
               comm.broadcast(x, src=0, async_op=True),
               comm.isend(x, (rank + 1) % world), comm.irecv((4,), torch.float64, (rank - 1) % world)]
    ring = comm.batch_isend_irecv([simcomm.P2POp("isend", x * 10, (rank + 1) % world),
                                   simcomm.P2POp("irecv", ((4,), torch.float64), (rank - 1) % world)])
    x.fill_(-1.0)
    del x
    return [h.wait() for h in handles + ring]


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_an_async_call_moves_what_the_program_passed_at_the_call(checked):
    import real

    world = 3
    want = simcomm.World(world).run(_changed_after_the_call)
    total = sum(range(1, world + 1))
    for rank, outs in enumerate(want):       # the single-process values, from what each rank passed
        left = (rank - 1) % world + 1.0
        assert torch.equal(outs[0], torch.full((4,), float(total), dtype=torch.float64))
        assert torch.equal(outs[1], torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(4))
        assert torch.equal(outs[2], torch.full((4,), float(total), dtype=torch.float64))
        assert torch.equal(outs[3], torch.ones(4, dtype=torch.float64))
        assert outs[4] is None and outs[6] is None
        assert torch.equal(outs[5], torch.full((4,), left, dtype=torch.float64))
        assert torch.equal(outs[7], torch.full((4,), 10 * left, dtype=torch.float64))
    with real.Cluster(world, backend="gloo", checked=checked) as cluster:
        for _ in range(2):
            got = cluster.run(_changed_after_the_call)
            for rank in range(world):
                for index, (g, w) in enumerate(zip(got[rank], want[rank], strict=True)):
                    assert (g is None and w is None) or torch.equal(g, w), (rank, index, g, w)
