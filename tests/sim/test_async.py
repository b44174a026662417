"""Collectives issued with async_op=True on virtual ranks: values and gradients against the
single-device float64 reference, handle semantics, the errors the simulator raises, the trace."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

import simcomm
from real.cases import async_cases
from real.verify import evaluate, run_cases
from simcomm import DeadlockError, P2POp, RankError, SimcommError, UnwaitedHandleError

from .. import reference as ref


@pytest.mark.parametrize("world_size", [1, 5, 6, 7, 8])
def test_every_async_case_matches_the_single_device_reference_at_more_sizes(world_size):
    """The sizes beyond the gloo clusters' (2-4 ranks: ``tests/core/test_async.py``)."""
    names = [case.name for case in async_cases()]
    rows = evaluate(world_size, simcomm.World(world_size).run(run_cases, names))
    assert len(rows) == len(names)
    failed = [row for row in rows if not row["passed"]]
    assert not failed, failed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["all_gather", "reduce_scatter", "all_reduce_max", "broadcast"])
def test_async_backward_is_the_blocking_dual(world_size, method):
    """Independent oracle (tests/reference.py); the async form records the same backward op."""
    gen = torch.Generator().manual_seed(world_size)
    xs = [torch.randn(2, 2 * world_size, generator=gen, dtype=torch.float64) for _ in range(world_size)]

    def weight(rank, shape):                 # the per-rank loss is sum(y * weight)
        return torch.randn(shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    call = {"all_gather": (lambda comm, x: comm.all_gather(x, dim=0, async_op=True), ref.all_gather, {"dim": 0}),
            "reduce_scatter": (lambda comm, x: comm.reduce_scatter(x, dim=1, async_op=True), ref.reduce_scatter,
                               {"dim": 1}),
            "all_reduce_max": (lambda comm, x: comm.all_reduce(x, op="max", async_op=True), ref.all_reduce,
                               {"op": "max"}),
            "broadcast": (lambda comm, x: comm.broadcast(x, src=world_size - 1, async_op=True), ref.broadcast,
                          {"src": world_size - 1})}[method]
    issue, reference_fn, kwargs = call

    def program(comm):
        x = xs[comm.rank].clone().requires_grad_()
        handle = issue(comm, x)
        y = handle.wait()
        assert handle.wait() is y and handle.is_completed()
        (y * weight(comm.rank, y.shape)).sum().backward()
        return y.detach(), x.grad

    outs = simcomm.World(world_size).run(program)
    leaves = [x.clone().requires_grad_() for x in xs]
    ys = reference_fn(leaves, **kwargs)
    sum((y * weight(r, y.shape)).sum() for r, y in enumerate(ys)).backward()
    for rank, (y, grad) in enumerate(outs):
        torch.testing.assert_close(y, ys[rank].detach(), rtol=1e-12, atol=1e-12)
        expected = leaves[rank].grad if leaves[rank].grad is not None else torch.zeros_like(xs[rank])
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_async_all_gather_backward_is_a_reduce_scatter_in_the_trace():
    def program(comm):
        x = torch.ones(2, requires_grad=True)
        comm.all_gather(x, dim=0, async_op=True).wait().sum().backward()
        return x.grad

    world = simcomm.World(3)
    assert all(torch.equal(g, torch.full((2,), 3.0)) for g in world.run(program))
    assert [(op, phase) for _, op, phase in world.trace.ops()] == [
        ("all_gather", "forward"), ("reduce_scatter", "backward")]
    forward = world.trace.filter(op="all_gather").events
    assert all(e.async_op and e.waited is not None and e.start < e.end <= e.waited for e in forward)
    backward = world.trace.filter(op="reduce_scatter").events
    assert all(not e.async_op and e.waited is None for e in backward)


def test_input_changed_after_issue_does_not_change_the_result():
    def program(comm):
        x = torch.full((3,), float(comm.rank + 1))
        handle = comm.all_reduce(x, async_op=True)
        x.fill_(100.0)                       # the program reuses its buffer before the wait
        return handle.wait()

    assert all(torch.equal(out, torch.full((3,), 10.0)) for out in simcomm.World(4).run(program))


def test_polling_is_completed_lets_the_other_ranks_run():
    def program(comm):
        handle = comm.all_reduce(torch.ones(2), async_op=True)
        polls = 0
        while not handle.is_completed():
            polls += 1
        return handle.wait(), polls

    outs = simcomm.World(3).run(program)
    assert all(torch.equal(out, torch.full((2,), 3.0)) for out, _ in outs)
    # rank 0 issued first: its first poll let ranks 1 and 2 issue, so no poll saw it incomplete
    assert [polls for _, polls in outs] == [0, 0, 0]


def test_async_barrier_and_gather_and_compute_free_methods():
    def program(comm):
        barrier = comm.barrier(async_op=True)
        gathered = comm.gather(torch.full((1,), float(comm.rank)), dst=0, dim=0, async_op=True)
        x = torch.arange(4.0 * comm.world_size)
        sliced = comm.slice(x, dim=0, scale_grad=False, async_op=True)
        copied = comm.copy_to_group(x, async_op=True)
        reduced = comm.reduce_from_group(x, async_op=True)
        assert sliced.is_completed() and copied.is_completed()
        return barrier.wait(), gathered.wait(), sliced.wait(), copied.wait(), reduced.wait()

    outs = simcomm.World(2).run(program)
    assert outs[0][0] is None and torch.equal(outs[0][1], torch.tensor([0.0, 1.0])) and outs[1][1] is None
    assert torch.equal(outs[1][2], torch.arange(4.0, 8.0)) and torch.equal(outs[1][3], torch.arange(8.0))
    assert torch.equal(outs[0][4], 2 * torch.arange(8.0))


def test_issue_order_mismatch_is_reported_at_the_issuing_step():
    def program(comm):
        if comm.rank == 0:
            first, second = comm.all_reduce(torch.ones(2), async_op=True), comm.all_gather(torch.ones(2), dim=0,
                                                                                           async_op=True)
        else:
            second, first = comm.all_gather(torch.ones(2), dim=0, async_op=True), comm.all_reduce(torch.ones(2),
                                                                                                 async_op=True)
        return first.wait(), second.wait()

    with pytest.raises(simcomm.CollectiveMismatchError, match=r"step 0[\s\S]*all_reduce[\s\S]*all_gather"):
        simcomm.World(2).run(program)


def test_a_wait_nobody_can_satisfy_is_a_deadlock():
    def program(comm):
        if comm.rank == 0:
            comm.all_reduce(torch.ones(2), async_op=True).wait()
        else:
            comm.recv((2,), src=0)

    with pytest.raises(DeadlockError, match=r"rank 0 waits in wait\(\) on all_reduce[\s\S]*rank 1 waits in recv"):
        simcomm.World(2).run(program)


def _issue_and_forget(comm):
    comm.all_reduce(torch.ones(2), async_op=True)   # never waited on
    return comm.rank


ISSUE_LINE = inspect.getsourcelines(_issue_and_forget)[1] + 1


def test_a_handle_never_waited_on_is_an_error_naming_rank_and_line():
    with pytest.raises(RankError) as info:
        simcomm.World(2).run(_issue_and_forget)
    cause = info.value.__cause__
    assert isinstance(cause, UnwaitedHandleError)
    assert f"rank {info.value.rank}" in str(cause)
    assert f"test_async.py:{ISSUE_LINE} in _issue_and_forget" in str(cause)
    assert "all_reduce(step 0" in str(cause)


def test_unwaited_isend_in_a_subgroup_is_reported_too():
    def program(comm):
        pair = comm.subgroup([[0, 1]])
        if comm.rank == 0:
            pair.isend(torch.ones(1), dst=1)
        else:
            pair.recv((1,), src=0)

    with pytest.raises(RankError, match="isend to rank 1") as info:
        simcomm.World(2).run(program)
    assert info.value.rank == 0 and isinstance(info.value.__cause__, UnwaitedHandleError)


def test_a_wait_after_the_run_has_ended_is_an_error():
    kept = []

    def program(comm):
        kept.append(comm.all_reduce(torch.ones(2), async_op=True))

    with pytest.raises(RankError):
        simcomm.World(2).run(program)
    with pytest.raises(SimcommError, match=r"all_reduce\(step 0.*outside that rank's program"):
        kept[0].wait()


# -- point to point --------------------------------------------------------------------

def test_both_ranks_sending_first_deadlocks_but_the_batched_form_completes():
    def blocking(comm):
        comm.send(torch.ones(2), dst=1 - comm.rank)
        return comm.recv((2,), src=1 - comm.rank)

    with pytest.raises(DeadlockError, match=r"rank 0 waits in send to rank 1[\s\S]*rank 1 waits in send to rank 0"):
        simcomm.World(2).run(blocking)

    def batched(comm):
        peer = 1 - comm.rank
        handles = comm.batch_isend_irecv([P2POp("isend", torch.full((2,), float(comm.rank)), peer),
                                          P2POp("irecv", ((2,), torch.float32), peer)])
        return [handle.wait() for handle in handles]

    outs = simcomm.World(2).run(batched)
    assert outs[0][0] is None and torch.equal(outs[0][1], torch.ones(2)) and torch.equal(outs[1][1], torch.zeros(2))


def test_isend_irecv_in_order_and_their_trace():
    def program(comm):
        if comm.rank == 0:
            handles = [comm.isend(torch.tensor([float(i)]), dst=1) for i in range(3)]
            return [h.wait() for h in handles]
        handles = [comm.irecv((1,), torch.float32, src=0) for _ in range(3)]
        return [h.wait().item() for h in reversed(handles)]

    world = simcomm.World(2)
    assert world.run(program) == [[None] * 3, [2.0, 1.0, 0.0]]
    sends, recvs = world.trace.filter(op="send").events, world.trace.filter(op="recv").events
    assert sorted(e.step for e in sends) == sorted(e.step for e in recvs) == [0, 1, 2]
    for e in sends + recvs:
        assert e.async_op and e.start <= e.end <= e.waited and e.nbytes == 4


@pytest.mark.parametrize("ops, match", [
    ([], "non-empty list"),
    ([P2POp("send", torch.ones(1), 1)], r"ops\[0\] on rank 0"),
    ([P2POp("irecv", torch.ones(1), 1)], r"irecv with data=tensor"),
    ([P2POp("isend", torch.ones(1), 5)], r"peer=5 on rank 0"),
    ([P2POp("isend", torch.ones(1), 0)], r"peer=0 on rank 0 is the calling rank itself"),
])
def test_bad_batch_ops_name_the_op_rank_and_value(ops, match):
    def program(comm):
        if comm.rank == 0:
            comm.batch_isend_irecv(ops)

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program)
    assert isinstance(info.value.__cause__, ValueError)
    assert "batch_isend_irecv" in str(info.value.__cause__)
    assert __import__("re").search(match, str(info.value.__cause__))


def test_chrome_trace_shows_the_async_span_and_a_wait_marker():
    def program(comm):
        handle = comm.all_reduce(torch.ones(4), async_op=True)
        comm.compute(seconds=1e-3)
        return handle.wait()

    world = simcomm.World(2)
    world.run(program)
    data = json.loads(json.dumps(world.trace.to_chrome_trace()))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"] == "all_reduce"]
    marks = [e for e in data["traceEvents"] if e["ph"] == "i"]
    assert len(spans) == len(marks) == 2
    for span in spans:
        assert span["args"]["async_op"] is True
        mark = next(m for m in marks if m["tid"] == span["tid"])
        assert mark["name"] == "wait all_reduce" and span["ts"] <= mark["ts"] == span["args"]["waited_us"]
        assert span["ts"] + span["dur"] <= mark["ts"] + 1e-6


def test_polling_a_handle_that_cannot_complete_is_a_deadlock_not_a_hang():
    def program(comm):
        if comm.rank == 0:
            handle = comm.irecv((1,), src=1)
            while not handle.is_completed():   # rank 1 waits for rank 0's message first
                pass
            comm.send(torch.ones(1), dst=1)
        else:
            comm.recv((1,), src=0)
            comm.send(torch.ones(1), dst=0)

    with pytest.raises(DeadlockError, match=r"rank 0 polls is_completed\(\) on the handle of irecv from rank 1"):
        simcomm.World(2).run(program)


def test_a_handle_of_an_ended_run_cannot_be_waited_on_in_a_later_run():
    kept = []

    def first(comm):
        kept.append(comm.all_reduce(torch.ones(2), async_op=True))

    def second(comm):
        return kept[0].wait() if comm.rank == 0 else None   # rank 0 issued it in the first run

    world = simcomm.World(2)
    with pytest.raises(RankError):
        world.run(first)
    with pytest.raises(RankError, match="outside that rank's program") as info:
        world.run(second)
    assert info.value.rank == 0 and isinstance(info.value.__cause__, SimcommError)
