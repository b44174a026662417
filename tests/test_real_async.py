"""Async collectives, isend/irecv and batch_isend_irecv on real gloo processes: the same values,
gradients and trace fields as on virtual ranks, checked against the single-device reference."""
from __future__ import annotations

import pytest
import torch

import simcomm
from real.cases import async_cases

from .test_real_collectives import assert_cases_pass
from .test_sim_async import _dp_step, _model, assert_single_device_gradients

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
