"""The "simcomm" c10d backend's asynchronous calls and native ops: Works backed by simulator
handles, isend/irecv/batch_isend_irecv, and the trace; checked against one device in float64."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm import DeadlockError, RankError, UnwaitedHandleError

from .. import torch_dist_programs as progs
from .test_c10d import _assert_same, assert_clean

WORLD = progs.WORLD


def _line_of(function, text: str) -> int:
    """The line number of the first line of ``function`` that contains ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


# -- values --------------------------------------------------------------------------------

def test_every_async_form_matches_the_single_device_reference():
    world = simcomm.World(WORLD)
    outs = world.run(progs.async_program)
    for rank, (got, want) in enumerate(zip(outs, progs.async_reference(), strict=True)):
        _assert_same(got, want, rank)
    for event in world.trace:
        assert event.async_op, event
        assert event.start <= event.end <= event.waited, event
    ops = [op for _, op, _ in world.trace.ops() if op not in ("send", "recv")]
    assert ops == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_single", "broadcast",
                   "reduce", "scatter", "barrier"]
    assert {e.op for e in world.trace.filter(rank=0)} >= {"send", "recv"}


def test_an_async_all_reduce_does_not_block_until_the_program_waits():
    """Rank 0 sends rank 1 what rank 1 needs before it joins the all-reduce: with the
    all-reduce issued asynchronously the program finishes; blocking, it is a deadlock."""
    world = simcomm.World(WORLD)
    outs = world.run(progs.overlap_program)
    for rank, ((got, message), (want, want_message)) in enumerate(
            zip(outs, progs.overlap_reference(), strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")
        if want_message is not None:
            torch.testing.assert_close(message, want_message, rtol=0, atol=0)
    issued = world.trace.filter(rank=0, op="all_reduce").events[0]
    sent = world.trace.filter(rank=0, op="send").events[0]
    received = world.trace.filter(rank=1, op="recv").events[0]
    joined = world.trace.filter(rank=1, op="all_reduce").events[0]
    assert issued.async_op and not sent.async_op and not joined.async_op and joined.waited is None
    # issued, then the send ran, rank 1 received and joined, the data moved, and rank 0 waited
    assert issued.start <= sent.start <= received.end <= joined.start <= issued.end <= issued.waited
    assert issued.sent == {1: 48, 2: 48, 3: 48}

    def blocking(comm):
        t = torch.ones(2)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
            dist.send(torch.ones(2), dst=1)
        elif dist.get_rank() == 1:
            dist.recv(torch.empty(2), src=0)
            dist.all_reduce(t)
        else:
            dist.all_reduce(t)

    with pytest.raises(DeadlockError) as info:
        simcomm.World(WORLD).run(blocking)
    assert "rank 0 waits in all_reduce" in str(info.value)
    assert "rank 1 waits in recv from rank 0" in str(info.value)
    assert_clean()


def test_a_work_polled_until_complete_holds_the_result_without_wait():
    def program(comm):
        t = progs.rank_input(dist.get_rank())
        work = dist.all_reduce(t, async_op=True)
        while not work.is_completed():   # a poll lets the ranks that have not issued it go first
            pass
        return t.clone(), work.wait(), work.is_completed()

    world = simcomm.World(WORLD)
    outs = world.run(program)
    total = torch.stack([progs.rank_input(r) for r in range(WORLD)]).sum(0)
    for rank, (t, waited, completed) in enumerate(outs):
        torch.testing.assert_close(t, total, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")
        assert waited is True and completed
    assert all(e.async_op and e.end <= e.waited for e in world.trace)


def test_ddp_with_its_allreduce_comm_hook_equals_single_device_training():
    """DDP's comm hooks chain a future on the Work of an async all_reduce."""
    world = simcomm.World(WORLD)
    outs = world.run(progs.ddp_program, hook="allreduce")
    want = progs.data_parallel_reference()
    for params in outs:
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(got, ref)
    reduces = world.trace.filter(op="all_reduce").events
    assert reduces and all(e.phase == "backward" and e.async_op and e.waited is not None for e in reduces)


# -- the unwaited Work -------------------------------------------------------------------------

def test_a_work_never_waited_is_reported_naming_the_rank_and_line():
    def program(comm):
        pair = dist.new_group([2, 3])
        t = torch.ones(2)
        if dist.get_rank() in (2, 3):
            work = dist.all_reduce(t, group=pair, async_op=True)
            if dist.get_rank() == 3:
                work.wait()
        return t

    with pytest.raises(RankError) as info:
        simcomm.World(WORLD).run(program)
    assert info.value.rank == 2 and isinstance(info.value.__cause__, UnwaitedHandleError)
    message = str(info.value.__cause__)
    line = _line_of(program, "work = dist.all_reduce")
    assert f"all_reduce(step 0, group [2, 3]) issued at {__file__}:{line} in program" in message
    assert_clean()


def test_an_isend_never_waited_is_reported():
    def program(comm):
        if dist.get_rank() == 0:
            dist.isend(torch.ones(2), dst=1)
        else:
            dist.recv(torch.empty(2), src=0)

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program)
    assert info.value.rank == 0 and isinstance(info.value.__cause__, UnwaitedHandleError)
    line = _line_of(program, "dist.isend")
    assert f"isend to rank 1 (float32 (2,)) issued at {__file__}:{line}" in str(info.value.__cause__)


# -- native ops in the trace ------------------------------------------------------------------

def test_reduce_scatter_and_uneven_all_to_all_single_are_traced_as_themselves():
    world = simcomm.World(WORLD)
    world.run(progs.collectives_program)
    row = 3 * 8                                          # float64 rows of 3
    for rank in range(WORLD):
        events = world.trace.filter(rank=rank)
        reduce = events.filter(op="reduce").events
        assert len(reduce) == 1
        if rank == 1:      # the root receives every other rank's (4, 3) float64
            assert reduce[0].received == {r: 96 for r in range(WORLD) if r != 1} and reduce[0].sent == {}
        else:
            assert reduce[0].sent == {1: 96} and reduce[0].received == {}
        scatter = events.filter(op="scatter").events
        assert len(scatter) == 1
        if rank == 1:      # the source sends each other rank its (4, 3) piece
            assert scatter[0].sent == {r: 96 for r in range(WORLD) if r != 1}
        else:
            assert scatter[0].received == {1: 96} and scatter[0].sent == {}
        uneven = [e for e in events.filter(op="all_to_all_single").events
                  if e.args["input_split_sizes"] != [2] * WORLD and e.shape[1:] == (3,)]
        assert len(uneven) == 1
        assert uneven[0].sent == {dst: progs.split_rows(rank, dst) * row
                                  for dst in range(WORLD) if dst != rank}
        assert uneven[0].received == {src: progs.split_rows(src, rank) * row
                                      for src in range(WORLD) if src != rank}
    # no helper collectives: all-reduces and broadcasts only where the program calls them
    ops = [op for _, op, _ in world.trace.ops()]
    assert ops.count("all_reduce") == 6 and ops.count("broadcast") == 1


# -- point to point ---------------------------------------------------------------------------

def test_batch_isend_irecv_ring_is_traced_async_on_every_rank():
    world = simcomm.World(WORLD)
    outs = world.run(progs.batch_isend_irecv_ring)
    for rank, got in enumerate(outs):
        torch.testing.assert_close(got, progs.rank_input((rank - 1) % WORLD), rtol=0, atol=0)
    for rank in range(WORLD):
        events = world.trace.filter(rank=rank).events
        assert sorted((e.op, e.root, e.nbytes, e.async_op) for e in events) == [
            ("recv", (rank - 1) % WORLD, 96, True), ("send", (rank + 1) % WORLD, 96, True)]
        assert all(e.start <= e.end <= e.waited for e in events)


def test_an_irecv_buffer_is_written_when_its_work_is_waited():
    def program(comm):
        if dist.get_rank() == 0:
            dist.send(progs.rank_input(0), dst=1)
            return None
        buffer = torch.zeros(4, 3, dtype=torch.float64)
        work = dist.irecv(buffer, src=0)
        work.wait()
        return buffer, work.is_completed()

    outs = simcomm.World(2).run(program)
    torch.testing.assert_close(outs[1][0], progs.rank_input(0), rtol=0, atol=0)
    assert outs[1][1]
