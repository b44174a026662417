"""The simulator's error contract: mismatches, deadlocks and rank errors are named at once."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import simcomm
from simcomm import CollectiveMismatchError, DeadlockError, RankError, RunTimeoutError


def rank_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("simcomm-rank")]


def raises_fast(world, program, error_type, *, within=1.0):
    start = time.perf_counter()
    with pytest.raises(error_type) as info:
        world.run(program)
    elapsed = time.perf_counter() - start
    assert elapsed < within, f"{error_type.__name__} took {elapsed:.2f} s"
    assert rank_threads() == [], "rank threads were left behind"
    return info.value


def test_mismatched_ops_name_ranks_ops_arguments_and_lines():
    def program(comm):
        x = torch.ones(4)
        if comm.rank == 2:
            return comm.all_gather(x, dim=0)   # the odd one out
        return comm.all_reduce(x)

    error = raises_fast(simcomm.World(4), program, CollectiveMismatchError)
    message = str(error)
    assert "ranks [0, 1, 3]" in message or "rank 2 called all_gather" in message
    assert "all_reduce(shape=(4,), dtype=float32, op=sum)" in message
    assert "all_gather(shape=(4,), dtype=float32, dim=0)" in message
    assert "sim/test_errors.py" in message and "in program" in message


def test_mismatched_shapes():
    def program(comm):
        return comm.all_reduce(torch.ones(2 + comm.rank % 2))

    error = raises_fast(simcomm.World(2), program, CollectiveMismatchError)
    assert "shape=(2,)" in str(error) and "shape=(3,)" in str(error)


def test_mismatched_roots_and_dtypes():
    def roots(comm):
        return comm.broadcast(torch.ones(2), src=comm.rank)

    assert "src=0" in str(raises_fast(simcomm.World(2), roots, CollectiveMismatchError))

    def dtypes(comm):
        return comm.all_gather(torch.ones(2, dtype=torch.float64 if comm.rank else torch.float32))

    message = str(raises_fast(simcomm.World(2), dtypes, CollectiveMismatchError))
    assert "float64" in message and "float32" in message


def test_recv_nobody_sends_is_a_deadlock_naming_who_waits_for_whom():
    def program(comm):
        if comm.rank == 0:
            return comm.recv((2,), torch.float32, src=1)
        comm.barrier()

    message = str(raises_fast(simcomm.World(3), program, DeadlockError))
    assert "rank 0 waits in recv from rank 1" in message
    assert "rank 1 waits in barrier" in message and "for ranks [0]" in message


def test_collective_a_rank_never_reaches_is_a_deadlock():
    def program(comm):
        if comm.rank != 3:
            comm.all_reduce(torch.ones(1))

    message = str(raises_fast(simcomm.World(4), program, DeadlockError))
    assert "for ranks [3]" in message and "rank 3 has finished its program" in message


def test_both_ranks_send_first_deadlocks():
    def program(comm):
        comm.send(torch.ones(3))          # blocks until the peer receives
        return comm.recv((3,), torch.float32)

    message = str(raises_fast(simcomm.World(2), program, DeadlockError))
    assert "rank 0 waits in send to rank 1" in message and "rank 1 waits in send to rank 0" in message


def test_backward_on_some_ranks_only_deadlocks():
    def program(comm):
        y = comm.all_gather(torch.ones(2, requires_grad=True))
        if comm.rank == 0:
            y.sum().backward()

    message = str(raises_fast(simcomm.World(2), program, DeadlockError))
    assert "reduce_scatter" in message   # the all-gather's backward is where rank 0 waits


def test_send_recv_shape_mismatch():
    def program(comm):
        if comm.rank == 0:
            comm.send(torch.ones(4), dst=1)
        else:
            comm.recv((5,), torch.float32, src=0)

    message = str(raises_fast(simcomm.World(2), program, CollectiveMismatchError))
    assert "rank 0 sends float32 (4,)" in message and "rank 1 expects float32 (5,)" in message


def test_a_raising_rank_gives_rank_error_with_the_original_cause():
    def program(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        comm.all_reduce(torch.ones(2))

    error = raises_fast(simcomm.World(3), program, RankError)
    assert error.rank == 1 and isinstance(error.__cause__, KeyError)
    assert "rank 1 raised KeyError" in str(error) and "in program" in str(error)


@pytest.mark.parametrize("call,expected", [
    (lambda comm, x: comm.slice(x, dim=1, scale_grad=False), "slice: size 5 of dim=1"),
    (lambda comm, x: comm.reduce_scatter(x, dim=-1), "reduce_scatter: size 5 of dim=1"),
    (lambda comm, x: comm.all_gather(x, dim=2), "all_gather: dim=2 is out of range"),
    (lambda comm, x: comm.all_to_all_4D(x), "all_to_all_4D: expects a 4-D"),
    (lambda comm, x: comm.all_to_all_4D(x.reshape(1, 2, 5, 1)), "all_to_all_4D: size 5 of scatter_dim (heads)=2"),
    (lambda comm, x: comm.all_to_all_4D(x.reshape(1, 2, 5, 1), 2, 3), "only (2, 1)"),
    (lambda comm, x: comm.gather(x, dst=3), "gather: dst=3"),
    (lambda comm, x: comm.send(x, dst=comm.rank), "is the sending rank itself"),
    (lambda comm, x: comm.subgroup([[0], [0, 1]]), "must partition the ranks 0..1"),
    (lambda comm, x: comm.all_reduce(x, op="median"), "unsupported reduce op"),
])
def test_bad_arguments_raise_value_error_naming_op_argument_value_and_world_size(call, expected):
    def program(comm):
        return call(comm, torch.ones(2, 5))

    error = raises_fast(simcomm.World(2), program, RankError)
    assert isinstance(error.__cause__, ValueError)
    assert expected in str(error.__cause__)
    if "divisible" in str(error.__cause__):
        assert "world size 2" in str(error.__cause__) and "rank" in str(error.__cause__)


def test_world_is_usable_after_every_kind_of_error():
    world = simcomm.World(2)
    bad = [lambda comm: comm.all_reduce(torch.ones(comm.rank + 1)),
           lambda comm: comm.recv((1,), torch.float32) if comm.rank == 0 else None,
           lambda comm: 1 / 0]
    for program in bad:
        with pytest.raises(simcomm.SimcommError):
            world.run(program)
    assert world.run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]
    assert rank_threads() == []


def test_timeout_names_where_each_rank_is_and_stops_a_rank_in_python_code():
    def program(comm):
        if comm.rank == 1:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:   # keeps the turn: rank 0 cannot run either
                pass
        comm.barrier()

    start = time.perf_counter()
    with pytest.raises(RunTimeoutError) as info:
        simcomm.World(2).run(program, timeout=0.5)
    assert time.perf_counter() - start < 0.5 + simcomm.sim.world.STOP_GRACE_S + 1.0
    assert "rank 1 computes at" in str(info.value) and "in program" in str(info.value)
    assert rank_threads() == []


def test_exceptions_in_the_program_do_not_swallow_an_abort():
    def program(comm):
        try:
            if comm.rank == 0:
                comm.recv((1,), torch.float32)
        except Exception:   # noqa: BLE001 - the abort is not an Exception
            return "swallowed"

    with pytest.raises(DeadlockError):
        simcomm.World(2).run(program)
