"""Checked mode on real gloo workers runs every point-to-point pattern gloo runs, and the
simulator runs it too: the oracle is the unchecked gloo run and the simulator's run of the
same program."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import real
import simcomm

pytestmark = pytest.mark.real


def _batch_of_two_isends_received_by_recv_and_irecv(comm):
    """Rank 0 sends two tensors in one batch; rank 1 receives the first with a blocking recv
    and only then posts an irecv for the second (gloo matches them in order)."""
    if comm.rank == 0:
        ops = [dist.P2POp(dist.isend, torch.full((3,), 1.0), 1),
               dist.P2POp(dist.isend, torch.full((3,), 2.0), 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return None
    first, second = torch.empty(3), torch.empty(3)
    dist.recv(first, src=0)
    dist.irecv(second, src=0).wait()
    return first.tolist() + second.tolist()


def _comm_batch_received_by_recv_then_irecv(comm):
    """The same through the communicator: the pattern checked mode used to hold until the timeout
    (it checked the whole batch before issuing any op of it)."""
    if comm.rank == 0:
        batch = [simcomm.P2POp("isend", torch.full((3,), 1.0), 1), simcomm.P2POp("isend", torch.full((3,), 2.0), 1)]
        for handle in comm.batch_isend_irecv(batch):
            handle.wait()
        return None
    first = comm.recv((3,), torch.float32, 0)
    second = comm.irecv((3,), torch.float32, 0).wait()
    return first.tolist() + second.tolist()


def _comm_batch_received_by_irecv_then_recv(comm):
    if comm.rank == 0:
        batch = [simcomm.P2POp("isend", torch.full((3,), 1.0), 1), simcomm.P2POp("isend", torch.full((3,), 2.0), 1)]
        for handle in comm.batch_isend_irecv(batch):
            handle.wait()
        return None
    pending = comm.irecv((3,), torch.float32, 0)
    second = comm.recv((3,), torch.float32, 0)
    return pending.wait().tolist() + second.tolist()


def _batch_with_a_mismatched_second_op(comm):
    if comm.rank == 0:
        batch = [simcomm.P2POp("isend", torch.full((3,), 1.0), 1), simcomm.P2POp("isend", torch.full((3,), 2.0), 1)]
        return [handle.wait() for handle in comm.batch_isend_irecv(batch)]
    first = comm.recv((3,), torch.float32, 0)
    return first.tolist(), comm.irecv((4,), torch.float32, 0).wait()


EXPECTED = [None, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]]
PROGRAMS = [_batch_of_two_isends_received_by_recv_and_irecv, _comm_batch_received_by_recv_then_irecv,
            _comm_batch_received_by_irecv_then_recv]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda program: program.__name__.strip("_"))
def test_a_batch_of_two_isends_met_by_a_recv_and_an_irecv_runs_checked_as_unchecked(gloo_cluster, program):
    assert simcomm.World(2).run(program) == EXPECTED
    assert gloo_cluster(2, timeout=30).run(program) == EXPECTED
    with real.Cluster(2, backend="gloo", timeout=30, checked=False) as unchecked:
        assert unchecked.run(program) == EXPECTED


@pytest.mark.timeout(120)
def test_a_mismatched_op_of_a_batch_is_named_on_both_backends(gloo_cluster):
    for backend in (simcomm.World(2), gloo_cluster(2, timeout=30)):
        with pytest.raises(simcomm.CollectiveMismatchError, match=r"rank 1 expects float32 \(4,\)"):
            backend.run(_batch_with_a_mismatched_second_op)


# -- an async point-to-point mismatch is named, never a timeout ----------------------------------------

def _isend_irecv(comm):
    if comm.rank == 0:
        return comm.isend(torch.ones(2), 1).wait()
    return comm.irecv((3,), torch.float32, 0).wait()


def _isend_recv(comm):
    if comm.rank == 0:
        return comm.isend(torch.ones(2), 1).wait()
    return comm.recv((3,), torch.float32, 0)


def _send_irecv(comm):
    if comm.rank == 0:
        return comm.send(torch.ones(2), 1)
    return comm.irecv((3,), torch.float32, 0).wait()


def _isend_irecv_dtype(comm):
    if comm.rank == 0:
        return comm.isend(torch.ones(2), 1).wait()
    return comm.irecv((2,), torch.int32, 0).wait()


def _batch_exchange(comm):
    peer = 1 - comm.rank
    ops = [simcomm.P2POp("isend", torch.ones(2), peer),
           simcomm.P2POp("irecv", ((2,) if comm.rank == 0 else (4,), torch.float32), peer)]
    return [handle.wait() for handle in comm.batch_isend_irecv(ops)]


def _isend_waited_late(comm):
    if comm.rank == 0:
        handle = comm.isend(torch.ones(2), 1)
        torch.ones(300, 300) @ torch.ones(300, 300)
        return handle.wait()
    return comm.irecv((5,), torch.float32, 0).wait()


def _dist_isend_irecv(comm):
    if comm.rank == 0:
        return dist.isend(torch.ones(2), 1).wait()
    return dist.irecv(torch.empty(3), 0).wait()


def _dist_isend_polled(comm):
    if comm.rank == 0:
        work = dist.isend(torch.ones(2), 1)
        while not work.is_completed():
            pass
        return work.wait()
    return dist.irecv(torch.empty(5), 0).wait()


def _dist_batch_exchange(comm):
    peer = 1 - comm.rank
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer),
           dist.P2POp(dist.irecv, torch.empty(2 if comm.rank == 0 else 4), peer)]
    return [work.wait() for work in dist.batch_isend_irecv(ops)]


MISMATCHES = [_isend_irecv, _isend_recv, _send_irecv, _isend_irecv_dtype, _batch_exchange, _isend_waited_late,
              _dist_isend_irecv, _dist_isend_polled, _dist_batch_exchange]


@pytest.mark.timeout(300)
def test_every_async_point_to_point_mismatch_is_named_on_both_backends(gloo_cluster):
    cluster = gloo_cluster(2, timeout=30)
    for _ in range(3):        # a race would show as a RunTimeoutError in some repetition
        for program in MISMATCHES:
            for backend in (simcomm.World(2), cluster):
                with pytest.raises(simcomm.CollectiveMismatchError, match="send/recv mismatch in group"):
                    backend.run(program)
    assert cluster.run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]
